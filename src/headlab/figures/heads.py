"""Layer x head heatmaps of a head sweep, from the tidy table alone: the plain sweep's default figure set.

  heads_<metric>.png  per metric, each head's effect: its value less the clean value (the intervention
                      "none" row of the same run and seed), mean over seeds; diverging colours (RdBu)
                      centred on the clean value, limits symmetric and shared by the figure's panels;
                      one panel per intervention, method, site, position (or role) and receiver set;
                      layer 0 is the top row; grey: a head without a value
Head rows and their effects are those of headlab.tables. A table without head rows draws nothing.
Numbers, per metric over all panels, of the head with the largest |effect|: top_head_<metric> ("L0H2"),
top_effect_<metric> and top_panel_<metric>.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pandas as pd

from ..tables import effects, grid, head_name, panels, section_columns, shape, strongest
from .canvas import save

FILE_UNSAFE = re.compile(r"[^\w.-]")
MAX_ANNOTATED = 100  # cells per panel up to which each cell prints its number


def draw(table: pd.DataFrame, out: Path) -> dict:
    """heads_<metric>.png per metric with head rows; returns the strongest head per metric."""
    numbers: dict = {}
    if not {"intervention", "layer", "head"} <= set(table.columns):
        return numbers
    cells = effects(table)
    if cells.empty:
        return numbers
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for metric, rows in cells.groupby("metric", sort=False):
        top = strongest(rows, 1).iloc[0]
        numbers[f"top_head_{metric}"] = head_name(top["layer"], top["head"])
        numbers[f"top_effect_{metric}"] = float(top["effect"])
        numbers[f"top_panel_{metric}"] = str(top["panel"])
        plot(rows, str(metric), out / f"heads_{FILE_UNSAFE.sub('_', str(metric))}.png")
    return numbers


def plot(cells: pd.DataFrame, metric: str, path: Path) -> None:
    """One metric's panels side by side (at most four a row), one colour scale for all of them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    size, shown = shape(cells), panels(cells)
    cmap = matplotlib.colormaps["RdBu"].with_extremes(bad="0.75")  # a head without a value: grey, not white
    lim = float(cells["effect"].abs().max()) or 1.0
    ncols = min(4, len(shown))
    nrows = math.ceil(len(shown) / ncols)
    # sizes in inches, set by hand: a layout engine would draw every figure twice, doubling its time
    aw, ah = max(2.4, 0.3 * size[1]), max(1.0, 0.25 * size[0])  # one panel's axes
    gap_w, gap_h, left, right, top, bottom = 0.7, 0.95, 0.6, 1.3, 0.75, 0.5
    width = left + ncols * aw + (ncols - 1) * gap_w + right
    height = top + nrows * ah + (nrows - 1) * gap_h + bottom
    fig, axes = plt.subplots(nrows, ncols, figsize=(width, height), squeeze=False)
    box = (left / width, bottom / height, 1 - right / width, 1 - top / height)
    fig.subplots_adjust(*box, wspace=gap_w / aw, hspace=gap_h / ah)
    for ax, (title, rows) in zip(axes.flat, shown):
        m = grid(rows, size=size).to_numpy(float)
        im = ax.imshow(m, cmap=cmap, vmin=-lim, vmax=lim, aspect="auto")
        if m.size <= MAX_ANNOTATED:
            for (i, j), v in np.ndenumerate(m):
                if np.isfinite(v):
                    dark = abs(v) > lim / 2  # RdBu's ends are dark: white text there
                    ax.text(j, i, f"{v:.2g}", ha="center", va="center", fontsize=7, color="w" if dark else "k")
        ax.set_xticks(range(size[1]))
        ax.set_yticks(range(size[0]))
        ax.tick_params(labelsize=7)
        ax.set_xlabel("head", fontsize=8)
        ax.set_ylabel("layer", fontsize=8)
        ax.set_title(title, fontsize=8)
    for ax in axes.flat[len(shown) :]:
        ax.axis("off")
    clean = f" (clean {cells['clean'].mean():.3g})" if len(cells[section_columns(cells)].drop_duplicates()) == 1 else ""
    fig.suptitle(f"{metric}: each head's effect, value - clean{clean}", fontsize=9)
    bar = fig.add_axes((1 - (right - 0.25) / width, box[1], 0.15 / width, box[3] - box[1]))
    fig.colorbar(im, cax=bar).set_label(f"{metric} - clean", fontsize=8)
    save(fig, path, dpi=100, tight=False)


FIGURE_SET = draw
