"""Count01 reproduction (arXiv 2502.06923): figures and headline numbers, all from the table.

Models: one-layer attention-only transformers of several head counts and seeds, each trained under two
objectives (train.loss_positions all | decision; configs/reproduce/count01.yaml). Per objective:
  fig_single_heads_<obj>.png   each head alone (others zero-/mean-ablated): ROC AUC, label and [EOS] accuracy
  fig_aggregation_<obj>.png    learned vs norm-equalised (at SEP, at y where [EOS] is decided) vs
                               mean-of-head-logits aggregation vs the best head; the learned norm spread
  fig_value_swaps_<obj>.png    V[j, i]: head i alone (its pattern and W_O) with head j's values
  fig_pattern_ov_<obj>.png     M[p, o]: head o's OV circuit (values and W_O) on head p's pattern, alone
  fig_token_weights_<obj>.png  noise_ratio (one 2 over one 1) and the 0/1 imbalance vs ROC AUC alone
A head "solves the task alone" by ROC AUC of its logit difference: alone, its output keeps a constant
offset (SEP, positions, b_O) that can sink label accuracy while the classes are perfectly separated.
numbers.json holds, per objective, the numbers and `verdicts`: each paper claim with the measure put
beside it, how that measure differs from the paper's, and the verdict (figures/count01_claims.py); each
figure carries its claims' verdicts as a footnote. `over_seeds` holds each number computed on every seed's
models alone: the values, their mean and a 95% Student t interval over seeds (mean +- t(0.975, s - 1)
x sd / sqrt(s)), where the grid has two seeds or more; the pooled numbers above pool every seed's heads.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from scipy import stats  # noqa: E402

from .canvas import save
from .count01_claims import caption, footnote, verdicts  # noqa: E402
from .count01_swaps import correlation, draw_swaps, swap_numbers  # noqa: E402

SOLVED = 0.9  # ROC AUC (and, beside it, label accuracy) at which a head counts as solving the task
METRICS = ("roc_auc", "label_acc", "eos_acc")


def _aggregates(table: pd.DataFrame) -> pd.DataFrame:
    df = table[table["n"] > 1].copy()
    df["n_heads"] = df["model"].str.extract(r"-h(\d+)(?:-|$)", expand=False).astype(int)
    df["objective"] = df["model"].str.extract(r"-h\d+-(\w+)$", expand=False).fillna("all")
    return df


def single_heads(df: pd.DataFrame) -> pd.DataFrame:
    """n_heads, seed, head, method -> label_acc, eos_acc, roc_auc of the head alone."""
    rows = df[(df["experiment"] == "count01_heads") & (df["intervention"] == "keep_head")]
    return rows.pivot_table(index=["n_heads", "seed", "head", "method"], columns="metric", values="value").reset_index()


def token_weights(df: pd.DataFrame) -> pd.DataFrame:
    rows = df[(df["experiment"] == "count01_heads") & (df["method"] == "attention")]
    rows = rows.drop_duplicates(["n_heads", "seed", "layer", "head", "metric"])
    return rows.pivot_table(index=["n_heads", "seed", "head"], columns="metric", values="value").reset_index()


def draw(table: pd.DataFrame, out: Path) -> dict:
    df = _aggregates(table)
    return {obj: _draw_objective(df[df["objective"] == obj], out, obj) for obj in sorted(df["objective"].unique())}


def _draw_objective(df: pd.DataFrame, out: Path, obj: str) -> dict:
    """The numbers first, then the verdicts they give, then each figure with its verdicts beneath."""
    numbers, shown = objective_numbers(df)
    single = single_heads(df)
    aggregation, weights = aggregation_frame(df, single), token_weight_frame(df, single)
    said = verdicts(numbers)
    numbers["verdicts"] = said
    numbers["over_seeds"] = over_seeds(df)
    _single_figure(single, out / f"fig_single_heads_{obj}.png", caption(said["pseudo_ensemble"]))
    if len(aggregation):
        _aggregation_figure(aggregation, out / f"fig_aggregation_{obj}.png", caption(said["nonuniform_for_syntax"]))
    for experiment, prefix, claim in (
        ("count01_value_swaps", "value_swap", "pattern_over_values"),
        ("count01_pattern_swaps", "pattern_ov", "pattern_over_ov"),
    ):
        model = shown[prefix]
        if model is not None:
            name = "value_swaps" if prefix == "value_swap" else prefix
            draw_swaps(df, experiment, model, out / f"fig_{name}_{obj}.png", caption(said[claim]))
    if len(weights):
        notes = caption(said["balance_w01"]) + "\n" + caption(said["suppress_w02"])
        _token_weights_figure(weights, out / f"fig_token_weights_{obj}.png", notes)
    return numbers


def over_seeds(df: pd.DataFrame, level: float = 0.95) -> dict:
    """number -> {values (one per seed), mean, ci_low, ci_high}: each number of objective_numbers on one
    seed's models at a time, with a Student t interval over seeds (none with fewer than two seeds)."""
    seeds = sorted(df["seed"].unique())
    if len(seeds) < 2:
        return {}
    per_seed = [objective_numbers(df[df["seed"] == s])[0] for s in seeds]
    out: dict = {"seeds": [int(s) for s in seeds]}
    for key in per_seed[0]:
        values = np.array([float(n.get(key, np.nan)) for n in per_seed])
        ok = values[np.isfinite(values)]
        if len(ok) < 2:
            continue
        mean = float(ok.mean())
        half = float(stats.t.ppf(0.5 + level / 2, len(ok) - 1) * ok.std(ddof=1) / np.sqrt(len(ok)))
        out[key] = {"values": [float(v) for v in values], "mean": mean, "ci_low": mean - half, "ci_high": mean + half}
    return out


def objective_numbers(df: pd.DataFrame) -> tuple[dict, dict[str, tuple[int, int] | None]]:
    """One objective's numbers (every model of `df` pooled), and the model each swap figure draws."""
    numbers: dict = {}
    single = single_heads(df)
    multi = single[single["n_heads"] > 1]
    for method in ("zero", "mean"):
        sel = multi[multi["method"] == method]
        for metric in METRICS:
            numbers[f"mean_head_alone_{metric}_{method}"] = float(sel[metric].mean())
        for metric in ("roc_auc", "label_acc"):
            numbers[f"frac_heads_alone_{metric}_ge_{SOLVED}_{method}"] = float((sel[metric] >= SOLVED).mean())
    aggregation = aggregation_frame(df, single)
    numbers |= aggregation_numbers(aggregation, head_norm_spread(df))
    shown: dict[str, tuple[int, int] | None] = {}
    for experiment, prefix in (("count01_value_swaps", "value_swap"), ("count01_pattern_swaps", "pattern_ov")):
        swaps, shown[prefix] = swap_numbers(df, experiment, prefix)
        numbers |= swaps
    numbers |= token_weight_numbers(token_weight_frame(df, single))
    return numbers, shown


def _single_figure(single: pd.DataFrame, path: Path, note: str) -> None:
    sizes = sorted(single["n_heads"].unique())
    fig, axes = plt.subplots(1, len(sizes), figsize=(max(9, 4 * len(sizes)), 4.6), squeeze=False)
    for ax, h in zip(axes[0], sizes):
        sel = single[(single["n_heads"] == h) & (single["method"] == "zero")].reset_index(drop=True)
        mean = single[(single["n_heads"] == h) & (single["method"] == "mean")].reset_index(drop=True)
        x = np.arange(len(sel))
        for k, (metric, name) in enumerate(zip(METRICS, ("ROC AUC", "label acc", "[EOS] acc"))):
            ax.bar(x + (k - 1) * 0.27, sel[metric], 0.27, label=f"{name} (zero abl.)")
        ax.plot(x - 0.27, mean["roc_auc"], "k_", markersize=10, label="ROC AUC (mean abl.)")
        ax.set_xticks(x, [f"s{s}h{hd}" for s, hd in zip(sel["seed"], sel["head"])], rotation=90, fontsize=7)
        ax.set_title(f"{h} head(s): each head alone")
        ax.set_ylim(0, 1.05)
    axes[0][-1].legend(fontsize=6, loc="lower right")
    footnote(fig, note, 8)
    save(fig, path, dpi=120, tight=False)


# the aggregations compared: column prefix -> (the table's intervention, the role it acts at; None: everywhere)
AGGREGATIONS = {
    "learned": ("none", None),
    "uniform_norm": ("scale_heads", None),  # norms at SEP, every position scaled by them
    "uniform_norm_at_sep": ("scale_heads", "SEP"),  # norms at SEP, scaled there only
    "uniform_norm_at_eos": ("scale_heads", "Y"),  # norms at y (where [EOS] is decided), scaled there only
    "mean_logits": ("mean_head_logits", None),
}


def aggregation_frame(df: pd.DataFrame, single: pd.DataFrame) -> pd.DataFrame:
    """One row per model of 2+ heads: each aggregation's metrics, and the best head alone (by ROC AUC)."""
    agg = []
    rows = df[(df["experiment"] == "count01_aggregation") & (df["n_heads"] > 1) & df["metric"].isin(METRICS)]
    token = rows["token"] if "token" in rows else pd.Series(pd.NA, index=rows.index)
    for (h, s), grp in rows.groupby(["n_heads", "seed"]):
        row: dict = {"n_heads": h, "seed": s}
        for name, (iv, role) in AGGREGATIONS.items():
            at = token[grp.index].isna() if role is None else token[grp.index] == role
            for m in METRICS:
                hit = grp[(grp["intervention"] == iv) & at.fillna(False) & (grp["metric"] == m)]["value"]
                row[f"{name}_{m}"] = float(hit.iloc[0]) if len(hit) else np.nan
        heads = single[(single["n_heads"] == h) & (single["seed"] == s) & (single["method"] == "zero")]
        best = heads.loc[heads["roc_auc"].idxmax()] if len(heads) else None
        row |= {f"best_head_{m}": np.nan if best is None else best[m] for m in METRICS}
        agg.append(row)
    return pd.DataFrame(agg)


def head_norm_spread(df: pd.DataFrame) -> pd.DataFrame:
    """Per model of 2+ heads: the learned heads' largest over smallest mean output norm |z_h W_O^h|, at
    SEP and at y (the uniform sweep's output_norm rows)."""
    rows = df[(df["experiment"] == "count01_aggregation") & (df["method"] == "output_norm") & (df["n_heads"] > 1)]
    spread = rows.groupby(["n_heads", "seed", "metric"])["value"].agg(lambda v: v.max() / max(v.min(), 1e-12))
    return spread.unstack("metric").reset_index() if len(spread) else pd.DataFrame()


def aggregation_numbers(frame: pd.DataFrame, spread: pd.DataFrame) -> dict:
    numbers: dict = {}
    for where, metric in (("sep", "output_norm_SEP"), ("eos", "output_norm_Y")):
        ok = len(spread) and metric in spread
        numbers[f"head_norm_max_over_min_at_{where}"] = float(spread[metric].mean()) if ok else np.nan
    if not len(frame):
        return numbers
    for m in METRICS:
        numbers[f"learned_{m}"] = float(frame[f"learned_{m}"].mean())
        for name in [*list(AGGREGATIONS)[1:], "best_head"]:
            numbers[f"{name}_{m}"] = float(frame[f"{name}_{m}"].mean())
            numbers[f"{name}_{m}_drop"] = float((frame[f"learned_{m}"] - frame[f"{name}_{m}"]).mean())
    return numbers


def _aggregation_figure(frame: pd.DataFrame, path: Path, note: str) -> None:
    """Learned vs the uniform aggregations (equal mean norms at SEP everywhere, at SEP only, at y only; the
    mean of the heads' logits, each alone) vs the best head alone (by ROC AUC)."""
    names = ["learned", *list(AGGREGATIONS)[1:], "best_head"]
    fig, axes = plt.subplots(1, 3, figsize=(max(10, 2.8 * len(frame)), 4.8), sharey=True)
    x = np.arange(len(frame))
    width = 0.8 / len(names)
    for ax, m in zip(axes, METRICS):
        for k, name in enumerate(names):
            ax.bar(x + (k - (len(names) - 1) / 2) * width, frame[f"{name}_{m}"], width, label=name)
        ax.set_xticks(x, [f"{h}h s{s}" for h, s in zip(frame["n_heads"], frame["seed"])])
        ax.set_title(m, fontsize=9)
        ax.set_ylim(0, 1.05)
    axes[0].legend(fontsize=6, loc="lower right")
    footnote(fig, note, 7)
    save(fig, path, dpi=120, tight=False)


def token_weight_frame(df: pd.DataFrame, single: pd.DataFrame) -> pd.DataFrame:
    """Per head: attention from SEP per token occurrence, noise_ratio (per prompt one 2 over one 1),
    the 0/1 imbalance, and the head's metrics alone (zero ablation; 1-head models included)."""
    weights = token_weights(df)
    if not len(weights) or "attn_per_0" not in weights:
        return pd.DataFrame()
    weights = weights.merge(single[single["method"] == "zero"], on=["n_heads", "seed", "head"])
    for col in ("noise_ratio", "noise_ratio_to_0"):  # tables of runs before the ratios: NaN, said as such
        weights[col] = weights[col] if col in weights else np.nan
    w0, w1 = weights["attn_per_0"], weights["attn_per_1"]
    weights["imbalance"] = (w0 - w1).abs() / (w0 + w1).clip(lower=1e-9)
    return weights


def token_weight_numbers(weights: pd.DataFrame) -> dict:
    numbers: dict = {}
    if not len(weights):
        return numbers
    cols = [c for c in ("attn_per_2", "imbalance", "noise_ratio", "noise_ratio_to_0") if c in weights]
    for metric in ("roc_auc", "label_acc"):
        for col in cols:
            numbers[f"r_{metric}_vs_{col}"] = correlation(weights[col], weights[metric])
    for col in ("attn_per_0", "attn_per_1", "attn_per_2", "noise_ratio", "noise_ratio_to_0"):
        if col in weights:
            numbers[f"mean_{col}"] = float(weights[col].mean())
    if "noise_ratio" in weights:
        numbers["median_noise_ratio"] = float(weights["noise_ratio"].median())
        solving = weights["roc_auc"] >= SOLVED
        numbers["mean_noise_ratio_heads_solving"] = float(weights.loc[solving, "noise_ratio"].mean())
        numbers["mean_noise_ratio_heads_not_solving"] = float(weights.loc[~solving, "noise_ratio"].mean())
    return numbers


def _token_weights_figure(weights: pd.DataFrame, path: Path, note: str) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(9, 6.4), sharey=True)
    for ax, col, name in zip(
        axes, ("noise_ratio", "imbalance"), ("noise_ratio: w(one 2) / w(one 1), per prompt", "|w0 - w1| / (w0 + w1)")
    ):
        ax.scatter(weights[col], weights["roc_auc"], c=np.log2(weights["n_heads"]), cmap="plasma", s=18)
        ax.set_xlabel(name)
    axes[0].set_ylabel("ROC AUC of the head alone")
    fig.suptitle("Attention from SEP per token occurrence vs single-head performance", fontsize=9)
    footnote(fig, note, 16)
    save(fig, path, dpi=120, tight=False)


FIGURE_SET = draw
