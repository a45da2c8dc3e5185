"""The atlas's classes, model by model, from the tables of `headlab atlas` runs (`headlab reproduce atlas`):

  atlas_classes.png   each class's share of the model's heads, one bar per model
Numbers: per model its layers and heads, and per class (label) the metric its rule reads and every head it
labels with that metric's value, strongest first by the atlas's own `rank` (the ablation effects by
magnitude), so the docs table is rendered from them.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from ..tables import head_name
from .canvas import pyplot, save


def classes(table: pd.DataFrame) -> dict:
    """{model: {"n_layers", "n_heads", "classes": {label: {"metric", "heads": [[name, value], ...]}}}}."""
    out: dict = {}
    for model, rows in table[table["intervention"] == "none"].groupby("model", sort=False):
        heads = rows.dropna(subset=["layer", "head"]).drop_duplicates(["layer", "head"])
        labelled = rows[rows["label"].notna() & (rows["label"] != "")]
        found: dict = {}
        for label, group in labelled.groupby("label", sort=False):
            group = group.sort_values(["rank", "layer", "head"])  # the atlas's rank: 1 the strongest
            found[str(label)] = {
                "metric": str(group["metric"].iloc[0]),
                "heads": [[head_name(r.layer, r.head), round(float(r.value), 4)] for r in group.itertuples()],
            }
        out[str(model)] = {
            "n_layers": int(heads["layer"].max()) + 1,
            "n_heads": len(heads),
            "classes": found,
        }
    return out


def draw(table: pd.DataFrame, out: Path) -> dict:
    models = classes(table)
    labels = sorted({label for m in models.values() for label in m["classes"]})
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(labels) + 1.2))
    width = 0.8 / max(len(models), 1)
    for i, (model, found) in enumerate(models.items()):
        shares = [len(found["classes"].get(label, {}).get("heads", [])) / found["n_heads"] for label in labels]
        ax.barh([j + i * width for j in range(len(labels))], shares, height=width, label=model)
    ax.set_yticks([j + width * (len(models) - 1) / 2 for j in range(len(labels))], labels, fontsize=8)
    ax.set_xlabel("share of the model's heads")
    ax.invert_yaxis()
    ax.legend(fontsize=8)
    save(fig, out / "atlas_classes.png")
    return {"models": models}


FIGURE_SET = draw
