"""Circuit reuse from the table of `headlab reuse` (analysis/reuse.py):

  reuse.png   left: layer x head grid, each head coloured by the side(s) it is important to (both, first
              task only, second only, neither); right, when both sides are sweeps: each head's effect on
              the first task against its effect on the second, important heads marked
Numbers: the overlap's rows (shared_heads, jaccard, expected_shared_by_chance, p_value, ...).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from .canvas import save

MEMBERSHIP = ("neither", "first only", "second only", "both")
COLOURS = ("#eeeeee", "#4c72b0", "#dd8452", "#55a868")


def draw(table: pd.DataFrame, out: Path) -> dict:
    summary = table[table["intervention"] == "reuse"]
    numbers = {str(m): float(v) for m, v in zip(summary["metric"], summary["value"])}
    heads = table[(table["intervention"] == "none") & table["side"].notna()]
    if heads.empty:
        return numbers
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    wide = heads.pivot_table(index=["layer", "head"], columns="side", values=["value", "important"], aggfunc="first")
    a, b = wide["important"]["a"].astype(bool), wide["important"]["b"].astype(bool)
    code = (a.astype(int) + 2 * b.astype(int)).rename("code").reset_index()
    layers, n_heads = int(heads["layer"].max()) + 1, int(heads["head"].max()) + 1
    grid = code.pivot(index="layer", columns="head", values="code").reindex(index=range(layers), columns=range(n_heads))
    labels = heads.drop_duplicates("side").set_index("side")["label"]
    sweeps = wide["value"].notna().any().all()
    fig, axes = plt.subplots(1, 2 if sweeps else 1, figsize=(11 if sweeps else 6, 4.2), squeeze=False)
    ax = axes[0, 0]
    ax.imshow(grid.fillna(0).to_numpy(float), cmap=ListedColormap(COLOURS), vmin=-0.5, vmax=3.5, aspect="auto")
    ax.set_xticks(range(n_heads))
    ax.set_yticks(range(layers))
    ax.tick_params(labelsize=7)
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    chance, p = numbers.get("expected_shared_by_chance", np.nan), numbers.get("p_value", np.nan)
    ax.set_title(f"shared {numbers.get('shared_heads', 0):.0f} heads (chance {chance:.2g}, p={p:.2g})", fontsize=9)
    ax.legend(
        handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS],
        labels=list(MEMBERSHIP),
        fontsize=7,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.15),
        ncol=4,
    )
    if sweeps:
        ax = axes[0, 1]
        values = wide["value"]
        for i, (name, colour) in enumerate(zip(MEMBERSHIP, COLOURS)):
            chosen = (a.astype(int) + 2 * b.astype(int)) == i
            ax.scatter(
                values.loc[chosen, "a"], values.loc[chosen, "b"], s=18, color=colour, edgecolor="0.3", label=name
            )
        ax.axhline(0, color="0.7", lw=0.8)
        ax.axvline(0, color="0.7", lw=0.8)
        ax.set_xlabel(f"effect: {labels['a']}", fontsize=7)
        ax.set_ylabel(f"effect: {labels['b']}", fontsize=7)
        ax.set_title(f"Spearman of |effect| {numbers.get('spearman_importance', np.nan):.2f}", fontsize=9)
    fig.suptitle(f"{labels['a']}  vs  {labels['b']}", fontsize=8)
    fig.tight_layout()
    out = Path(out)
    save(fig, out / "reuse.png", dpi=100, tight=False)
    return numbers


FIGURE_SET = draw
