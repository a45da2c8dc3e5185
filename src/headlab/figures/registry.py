"""Figure sets by name: each draws PNGs into a folder from a result table alone and returns its numbers.

`output.figures=<name>` draws a set from one run's table; a reproduction names the set it draws from its
collected table (configs/reproduce/<name>.yaml, `figures:`). A set is a module of this package that declares
its draw function as `FIGURE_SET`, found by reading the modules (discovery.declaring) and imported when it
draws: matplotlib takes seconds to import.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from ..discovery import declaring

Draw = Callable[[pd.DataFrame, Path], dict]


def _draw(name: str, table: pd.DataFrame, out: Path) -> dict:
    return importlib.import_module(f"{__package__}.{name}").FIGURE_SET(table, out)


def _lazy(name: str) -> Draw:
    return lambda table, out: _draw(name, table, out)


FIGURES: dict[str, Draw] = {name: _lazy(name) for name in declaring(__package__, "FIGURE_SET")}
