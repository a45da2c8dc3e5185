"""The IOI circuit as a diagram in the manner of Wang et al.'s Fig. 2: a box per head class, left to right
in circuit order, higher in later layers, naming the token it acts from (S1+1, S2, END) and its heads;
arrows where one class's output enters the next (the site of the path-patching round that found it).

  ioi_circuit.png   drawn from the class rows (method "ioi_class") that study=ioi_classes writes
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402

from ..analysis.ioi_classes import CLASSES  # noqa: E402
from .canvas import save

TOKEN = {  # the position each class acts from, as in the paper's Fig. 2
    "previous token": "S1+1",
    "duplicate token": "S2",
    "induction": "S2",
    "S-inhibition": "END",
    "name mover": "END",
    "backup name mover": "END",
    "negative name mover": "END",
}
# left to right in circuit order, one column a class, so that no two boxes share a place
ORDER = (
    "previous token",
    "duplicate token",
    "induction",
    "S-inhibition",
    "name mover",
    "backup name mover",
    "negative name mover",
)
# (from, to, how the first enters the second): the composition each path-patching round measured
ARROWS = (
    ("previous token", "induction", "K"),
    ("induction", "S-inhibition", "V"),
    ("duplicate token", "S-inhibition", "V"),
    ("S-inhibition", "name mover", "Q"),
    ("name mover", "logits", ""),
    ("backup name mover", "logits", ""),
    ("negative name mover", "logits", ""),
)
COLOURS = dict(zip(CLASSES, ("#1f77b4", "#d62728", "#17becf", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")))
HEADS_PER_LINE = 4


def draw(found: dict[str, list[str]], n_layers: int, model: str, out: Path) -> str | None:
    """ioi_circuit.png into `out` (None where no class has heads); its file name otherwise."""
    present = {cls: heads for cls, heads in found.items() if heads}
    if not present:
        return None
    fig, ax = plt.subplots(figsize=(10.0, 5.5))
    centre: dict[str, tuple[float, float]] = {}
    for cls in present:
        x, y = ORDER.index(cls), _mean_layer(present[cls]) / max(1, n_layers - 1)
        centre[cls] = (x, y)
        heads = present[cls]
        lines = [", ".join(heads[i : i + HEADS_PER_LINE]) for i in range(0, len(heads), HEADS_PER_LINE)]
        text = f"{cls}\n(at {TOKEN[cls]})\n" + "\n".join(lines)
        ax.text(x, y, text, ha="center", va="center", fontsize=7, zorder=3)
        width, height = 0.9, 0.06 + 0.035 * (len(lines) + 2)
        ax.add_patch(
            FancyBboxPatch(
                (x - width / 2, y - height / 2),
                width,
                height,
                boxstyle="round,pad=0.01",
                fc=COLOURS[cls],
                alpha=0.35,
                ec=COLOURS[cls],
                zorder=2,
            )
        )
    centre["logits"] = (len(ORDER), 1.08)
    ax.text(*centre["logits"], "logits\n(IO - S)", ha="center", va="center", fontsize=8, zorder=3)
    for a, b, site in ARROWS:
        if a in centre and b in centre:
            ax.annotate(
                "",
                xy=centre[b],
                xytext=centre[a],
                arrowprops={"arrowstyle": "-|>", "color": COLOURS[a], "lw": 1.4, "shrinkA": 28, "shrinkB": 28},
                zorder=1,
            )
            if site:
                mx, my = (centre[a][0] + centre[b][0]) / 2, (centre[a][1] + centre[b][1]) / 2
                ax.text(mx, my, site, fontsize=8, color=COLOURS[a], fontweight="bold")
    ax.set_xticks([])
    ax.set_yticks([0, 0.5, 1], ["layer 0", f"layer {(n_layers - 1) / 2:g}", f"layer {n_layers - 1}"])
    ax.set_ylabel("mean layer of the class's heads")
    ax.set_xlim(-0.6, len(ORDER) + 0.5)
    ax.set_ylim(-0.15, 1.2)
    for side in ("bottom",):
        ax.spines[side].set_visible(False)
    ax.set_title(f"{model}: the IOI circuit found by path patching (after Wang et al. 2022, Fig. 2)", fontsize=9)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    save(fig, out / "ioi_circuit.png", dpi=120)
    return "ioi_circuit.png"


def _mean_layer(heads: list[str]) -> float:
    return sum(int(h.split(".")[0]) for h in heads) / len(heads)
