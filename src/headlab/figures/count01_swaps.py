"""Count01 swaps (arXiv 2502.06923): does a head alone perform like the head whose attention pattern it
keeps, or like the head whose values (or whole OV circuit) it carries?

Two matrices per model, both read from the table (rows: the head lending its part, columns: the head
kept, alone, the other heads zero-ablated; the diagonal is each head alone):
  value swap   V[j, i]: head i alone, its own pattern and W_O, with head j's values v_j = x W_V^j
               (configs/experiment/count01_value_swaps.yaml: values_from rows, head=i, other_head=j)
  pattern x OV M[p, o]: head o alone, its own values and W_O, on head p's pattern
               (count01_pattern_swaps: pattern_from rows, head=o, other_head=p)
The off-diagonal entries are compared with the performance alone of each of the two heads involved.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from scipy.stats import spearmanr  # noqa: E402

from .canvas import save
from .count01_claims import footnote  # noqa: E402

# experiment -> (the table's swap intervention, what the lending head gives, what the kept head keeps)
SWAPS = {
    "count01_value_swaps": ("values_from", "values", "pattern"),
    "count01_pattern_swaps": ("pattern_from", "pattern", "OV circuit"),
}


def correlation(x, y, rank: bool = False) -> float:
    """Pearson (rank: Spearman) over the pairs where both are finite; NaN under 3 pairs or no spread."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    ok = np.isfinite(x) & np.isfinite(y)
    if ok.sum() < 3 or np.std(x[ok]) == 0 or np.std(y[ok]) == 0:
        return float("nan")
    return float(spearmanr(x[ok], y[ok])[0] if rank else np.corrcoef(x[ok], y[ok])[0, 1])


def swap_matrix(df: pd.DataFrame, experiment: str, n_heads: int, seed: int, metric: str = "roc_auc") -> np.ndarray:
    """S[lender, kept]: head `kept` alone with the lending head's part (SWAPS); the diagonal is the head
    alone. The table names the kept head `head` and the lender `other_head`."""
    swap = SWAPS[experiment][0]
    sel = (df["experiment"] == experiment) & (df["n_heads"] == n_heads) & (df["seed"] == seed)
    rows = df[sel & (df["metric"] == metric) & (df["method"] == "zero")]
    m = np.full((n_heads, n_heads), np.nan)
    for _, r in rows.iterrows():
        if r["intervention"] == "keep_head":
            m[int(r["head"]), int(r["head"])] = r["value"]
        elif r["intervention"] == swap:
            m[int(r["other_head"]), int(r["head"])] = r["value"]
    return m


def pattern_ov_matrix(df: pd.DataFrame, n_heads: int, seed: int, metric: str = "roc_auc") -> np.ndarray:
    """M[p, o]: head o alone with head p's attention pattern (its own values and W_O)."""
    return swap_matrix(df, "count01_pattern_swaps", n_heads, seed, metric)


def value_swap_matrix(df: pd.DataFrame, n_heads: int, seed: int, metric: str = "roc_auc") -> np.ndarray:
    """V[j, i]: head i alone (its own pattern and W_O) with head j's values."""
    return swap_matrix(df, "count01_value_swaps", n_heads, seed, metric)


def swap_numbers(df: pd.DataFrame, experiment: str, prefix: str) -> tuple[dict, tuple[int, int] | None]:
    """Off-diagonal entries against the pattern head alone and the other head alone: Pearson, Spearman
    and mean |entry - alone|, per metric; and the (n_heads, seed) to draw (the most heads, seed 0)."""
    _, lends, _ = SWAPS[experiment]
    numbers: dict = {}
    shown = None
    models = df[(df["experiment"] == experiment) & (df["n_heads"] > 1)][["n_heads", "seed"]].drop_duplicates()
    for metric in ("roc_auc", "label_acc", "eos_acc"):
        entries, by_pattern, by_other = [], [], []
        for h, s in models.itertuples(index=False):
            m = swap_matrix(df, experiment, h, s, metric)
            alone = np.diag(m)
            for lender in range(h):
                for kept in range(h):
                    if lender != kept and np.isfinite(m[lender, kept]):
                        entries.append(m[lender, kept])
                        # the value swap keeps the kept head's pattern; the pattern x OV takes the lender's
                        pattern_head, other_head = (kept, lender) if lends == "values" else (lender, kept)
                        by_pattern.append(alone[pattern_head])
                        by_other.append(alone[other_head])
            shown = (h, s) if shown is None or (h >= shown[0] and s == 0) else shown
        other = "values_head" if lends == "values" else "ov_head"
        for name, alone_of in (("pattern_head", by_pattern), (other, by_other)):
            numbers[f"{prefix}_{metric}_pearson_with_{name}_alone"] = correlation(entries, alone_of)
            numbers[f"{prefix}_{metric}_spearman_with_{name}_alone"] = correlation(entries, alone_of, rank=True)
            diff = np.abs(np.subtract(entries, alone_of))
            numbers[f"{prefix}_{metric}_mean_abs_diff_to_{name}_alone"] = float(diff.mean()) if entries else np.nan
        numbers[f"{prefix}_{metric}_n_entries"] = len(entries)
    return numbers, shown


def draw_swaps(df: pd.DataFrame, experiment: str, shown: tuple[int, int], path: Path, verdict: str) -> None:
    _, lends, keeps = SWAPS[experiment]
    fig, axes = plt.subplots(1, 2, figsize=(9, 5.2), gridspec_kw={"width_ratios": [1, 1.1]})
    im = axes[0].imshow(swap_matrix(df, experiment, *shown), vmin=0.5, vmax=1.0, cmap="viridis")
    axes[0].set_xlabel(f"head alone (keeps its {keeps}{', W_O' if lends == 'values' else ''})")
    axes[0].set_ylabel(f"head whose {lends} it takes")
    axes[0].set_xticks(range(shown[0]))
    axes[0].set_yticks(range(shown[0]))
    axes[0].set_title(f"{shown[0]} heads, seed {shown[1]}: ROC AUC (diagonal: alone)", fontsize=8)
    fig.colorbar(im, ax=axes[0])
    models = df[(df["experiment"] == experiment) & (df["n_heads"] > 1)][["n_heads", "seed"]].drop_duplicates()
    for h, s in models.itertuples(index=False):
        m = swap_matrix(df, experiment, h, s)
        alone = np.diag(m)
        off = [(a, b) for a in range(h) for b in range(h) if a != b]
        pattern = [alone[b] if lends == "values" else alone[a] for a, b in off]
        axes[1].scatter(pattern, [m[a, b] for a, b in off], s=12, c="tab:blue", label=None)
    axes[1].plot([0.5, 1], [0.5, 1], "k:", lw=0.8)
    axes[1].set_xlabel("ROC AUC alone of the head whose pattern is used")
    axes[1].set_ylabel("ROC AUC of the swap")
    footnote(fig, verdict, 7)
    save(fig, path, dpi=120, tight=False)
