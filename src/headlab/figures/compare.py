"""compare.png from the table of `headlab compare` alone (compare.py): the models side by side, one
row of the figure per class, one colour per model.

  left   the class's share of each model's heads, its head count at the bar's end ("not scored" where
         the model's table lacks the class's score); for a study without classes, where a class is each
         measure's top heads, the measure's values over all heads instead: median (dot) and q10 to q90
         (line), each row scaled to its largest |q10| or |q90|, so that the models compare within a row
  right  relative depth, 0 the first layer and 1 the last: each head of the class a small dot, the mean
         a large diamond
"""

from __future__ import annotations

import io

import numpy as np
import pandas as pd

from ..tables import head_of
from .canvas import pyplot

COLOURS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c")


def png(table: pd.DataFrame) -> bytes:
    """The figure as PNG bytes (the caller writes it atomically)."""
    plt = pyplot()
    models = list(dict.fromkeys(table["model"]))
    classes = list(dict.fromkeys(table["class"]))
    distributions = bool((table["kind"] == "top heads").all())
    band = 0.8 / len(models)  # each class row's height, shared by its models
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 1.9 + len(classes) * (0.2 + 0.2 * len(models))), sharey=True)
    widest = table[["value_q10", "value_q90"]].abs().max(axis=1).groupby(table["class"]).max()
    scale = widest.reindex(classes).replace(0, 1).fillna(1).to_numpy(float)
    for i, model in enumerate(models):
        rows = table[table["model"] == model].set_index("class").reindex(classes)
        y = np.arange(len(classes)) - 0.4 + band * (i + 0.5)
        colour = COLOURS[i % len(COLOURS)]
        first = rows.iloc[0]
        label = f"{model} ({first['n_layers']} layers, {first['n_model_heads']} heads)"
        if distributions:
            left.hlines(y, rows["value_q10"] / scale, rows["value_q90"] / scale, color=colour, lw=2)
            left.plot(rows["value_median"] / scale, y, "o", color=colour, label=label)
        else:
            share = rows["share"].astype(float).fillna(0) * 100
            left.barh(y, share, height=band * 0.9, color=colour, label=label)
            for yy, s, n, measured in zip(y, share, rows["n_heads"], rows["measured"]):
                said = f" {n}" if measured else " not scored"
                left.text(s, yy, said, va="center", fontsize=7, color="0.2" if measured else "0.55")
        for yy, heads, depth, n_layers in zip(y, rows["heads"], rows["depth"], rows["n_layers"]):
            layers = [head_of(h)[0] for h in str(heads).split()] if n_layers > 1 else []
            right.plot(
                [layer / (n_layers - 1) for layer in layers], [yy] * len(layers), "o", ms=3, color=colour, alpha=0.5
            )
            if not pd.isna(depth):
                right.plot([depth], [yy], "D", ms=8, color=colour, markeredgecolor="0.2")
    left.set_yticks(range(len(classes)))
    left.set_yticklabels(classes, fontsize=8)
    left.invert_yaxis()
    if distributions:
        left.axvline(0, color="0.7", lw=0.8)
        left.set_xlabel(
            "its values over all heads: median, q10 to q90\n(each row scaled to its largest |q10| or |q90|)"
        )
    else:
        left.set_xlabel("share of the model's heads (%)\nat the bar's end: how many heads")
        top = table["share"].astype(float).max()
        left.set_xlim(0, max(5.0, 0.0 if pd.isna(top) else top * 100 * 1.25))
    right.set_xlim(-0.05, 1.05)
    right.set_xlabel("relative depth, layer / (n_layers - 1)\ndots: the class's heads, diamond: their mean")
    for ax in (left, right):
        ax.grid(axis="x", color="0.9")
        for edge in np.arange(len(classes) - 1) + 0.5:
            ax.axhline(edge, color="0.85", lw=0.6)
    handles, labels = left.get_legend_handles_labels()
    upper = 1 - 0.55 / fig.get_figheight()  # room for the title and the legend, in inches whatever the height
    fig.legend(handles, labels, fontsize=8, loc="lower center", bbox_to_anchor=(0.5, upper), ncol=3, frameon=False)
    fig.suptitle(f"{table['study'].iloc[0]}: head classes model by model", fontsize=10, y=0.995)
    fig.tight_layout(rect=(0, 0, 1, upper))
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return buffer.getvalue()
