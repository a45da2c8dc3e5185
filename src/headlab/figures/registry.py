"""Figure sets by name: each draws PNGs into a folder from a result table alone and returns its numbers.

`output.figures=<name>` draws a set from one run's table; a reproduction names the set it draws from its
collected table (configs/reproduce/<name>.yaml, `figures:`). Every set is the `draw` of the module of the
same name in this package.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path

import pandas as pd

Draw = Callable[[pd.DataFrame, Path], dict]


def _draw(name: str, table: pd.DataFrame, out: Path) -> dict:
    # imported on first draw, not with the registry: matplotlib takes seconds to import
    return importlib.import_module(f"{__package__}.{name}").draw(table, out)


def _lazy(name: str) -> Draw:
    return lambda table, out: _draw(name, table, out)


FIGURES: dict[str, Draw] = {
    name: _lazy(name)
    for name in (
        "attn_sae",
        "audit",
        "circuit",
        "count01",
        "head_attribution",
        "heads",
        "ioi",
        "markov",
        "recall_reasoning",
        "reuse",
        "scores",
    )
}
