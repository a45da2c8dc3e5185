"""What every figure shares on its way to a file: matplotlib off screen, and the save that ends each one."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display), imported when a figure is first drawn: matplotlib
    takes seconds to import."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: Path, dpi: int = 120, tight: bool = True, **savefig: Any) -> Path:
    """The figure laid out (unless its own layout is set: `tight` False), written to `path` (its folder
    made) and closed."""
    if tight:
        fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, **savefig)
    pyplot().close(fig)
    return path


def ordered(values: pd.Series, first: Sequence[str]) -> list[str]:
    """The distinct values present (as text, missing ones left out): those of `first` in its order, then the
    rest sorted. Unique before text: a million edge rows name a few methods."""
    present = {str(v) for v in values.dropna().unique()}
    return [v for v in first if v in present] + sorted(present - set(first))
