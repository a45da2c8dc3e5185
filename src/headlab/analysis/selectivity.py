"""Which components serve recall, which serve reasoning (arXiv 2510.03366): drops, selectivity, classes.

From per-prompt correctness under each ablation: the drop in recall accuracy and in reasoning accuracy
(clean minus ablated, with a paired bootstrap interval over prompts), the selectivity index
    s = (d_recall - d_reasoning) / (d_recall + d_reasoning)      (drops clipped at 0; NaN if both are 0)
and a class: a component matters for a kind when its drop is at least `threshold` and the interval's low
end is above 0; it is `recall` (matters for recall, s >= min_selectivity), `reasoning` (matters for
reasoning, s <= -min_selectivity), `shared` (matters, |s| below), or `none`.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

THRESHOLD = 0.05  # accuracy drop (5 points) for a component to matter for a kind
MIN_SELECTIVITY = 0.5


def drops(
    correct: np.ndarray,
    kind: np.ndarray,
    labels: list[dict],
    n_boot: int = 1000,
    seed: int = 0,
    threshold: float = THRESHOLD,
    min_selectivity: float = MIN_SELECTIVITY,
) -> pd.DataFrame:
    """correct [k, n] (row 0 the clean run), kind [n] (0 recall, 1 reasoning), labels[i] for row i >= 1."""
    rng = np.random.default_rng(seed)
    out = []
    masks = {"recall": kind == 0, "reasoning": kind == 1}
    boots = {name: rng.choice(np.flatnonzero(m), size=(n_boot, int(m.sum()))) for name, m in masks.items()}
    for i, label in enumerate(labels, 1):
        row = dict(label)
        for name, m in masks.items():
            diff = correct[0] - correct[i]  # per prompt: 1 where the ablation broke it, -1 where it fixed it
            row[f"drop_{name}"] = float(diff[m].mean())
            low, high = np.percentile(diff[boots[name]].mean(1), [2.5, 97.5]) if n_boot else (np.nan, np.nan)
            row[f"drop_{name}_low"], row[f"drop_{name}_high"] = float(low), float(high)
        out.append(row)
    df = pd.DataFrame(out)
    r, q = df["drop_recall"].clip(lower=0), df["drop_reasoning"].clip(lower=0)
    df["selectivity"] = ((r - q) / (r + q)).where(r + q > 0)
    matters_r = (df["drop_recall"] >= threshold) & (df["drop_recall_low"] > 0)
    matters_q = (df["drop_reasoning"] >= threshold) & (df["drop_reasoning_low"] > 0)
    sel = df["selectivity"].fillna(0.0)
    df["class"] = np.select(
        [matters_r & (sel >= min_selectivity), matters_q & (sel <= -min_selectivity), matters_r | matters_q],
        ["recall", "reasoning", "shared"],
        "none",
    )
    return df


def top_components(table: pd.DataFrame, kind: str, k: int) -> pd.DataFrame:
    """The k components that hurt `kind` most and the other kind less (selectivity on its side): the
    selective ones (|s| >= MIN_SELECTIVITY) first, by drop, then the rest of that side, by drop; a shared
    component that breaks both kinds would otherwise lead both lists."""
    sign = 1 if kind == "recall" else -1
    leaning = table["selectivity"].fillna(0) * sign
    side = table[leaning > 0].assign(_selective=leaning[leaning > 0] >= MIN_SELECTIVITY)
    ranked = side.sort_values(["_selective", f"drop_{kind}"], ascending=[False, False], kind="stable")
    return ranked.head(k).drop(columns="_selective")
