"""Figures drawn from result tables (never from live tensors)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import pandas as pd


def _ioi(table: pd.DataFrame, out: Path) -> dict:
    from .ioi import draw

    return draw(table, out)


def _recall_reasoning(table: pd.DataFrame, out: Path) -> dict:
    from .recall_reasoning import draw

    return draw(table, out)


# figure sets a single run can draw from its own table (output.figures=<name>)
FIGURES: dict[str, Callable[[pd.DataFrame, Path], dict]] = {"ioi": _ioi, "recall_reasoning": _recall_reasoning}
