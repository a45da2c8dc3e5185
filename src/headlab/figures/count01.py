"""Count01 reproduction (arXiv 2502.06923): figures and headline numbers, all from the table.

Models: one-layer attention-only transformers of several head counts and seeds (configs/reproduce/count01.yaml).
  fig_single_heads.png   each head alone (others zero-/mean-ablated): label and [EOS] accuracy
  fig_aggregation.png    learned vs uniform aggregation vs the best single head
  fig_swaps.png          head i alone with head j's pattern / values (label accuracy)
  fig_token_weights.png  attention from SEP to 0, 1 and 2 tokens vs the head's accuracy alone
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402


def _aggregates(table: pd.DataFrame) -> pd.DataFrame:
    df = table[table["n"] > 1].copy()
    df["n_heads"] = df["model"].str.extract(r"-h(\d+)$", expand=False).astype(int)
    return df


def single_heads(df: pd.DataFrame) -> pd.DataFrame:
    """n_heads, seed, head, method -> label_acc, eos_acc, roc_auc of the head alone."""
    rows = df[(df["experiment"] == "count01_heads") & (df["intervention"] == "keep_head")]
    return rows.pivot_table(index=["n_heads", "seed", "head", "method"], columns="metric", values="value").reset_index()


def token_weights(df: pd.DataFrame) -> pd.DataFrame:
    rows = df[(df["experiment"] == "count01_heads") & (df["method"] == "attention")]
    rows = rows.drop_duplicates(["n_heads", "seed", "layer", "head", "metric"])
    return rows.pivot_table(index=["n_heads", "seed", "head"], columns="metric", values="value").reset_index()


def swap_matrix(df: pd.DataFrame, kind: str, n_heads: int, seed: int, metric: str = "label_acc") -> np.ndarray:
    exp = "count01_pattern_swaps" if kind == "pattern_from" else "count01_value_swaps"
    rows = df[(df["experiment"] == exp) & (df["n_heads"] == n_heads) & (df["seed"] == seed) & (df["metric"] == metric)]
    m = np.full((n_heads, n_heads), np.nan)
    for _, r in rows.iterrows():
        if r["intervention"] == "keep_head":
            m[int(r["head"]), int(r["head"])] = r["value"]
        elif r["intervention"] == kind:
            m[int(r["head"]), int(r["other_head"])] = r["value"]
    return m


def _r(x, y) -> float:
    x, y = np.asarray(x, float), np.asarray(y, float)
    ok = np.isfinite(x) & np.isfinite(y)
    if ok.sum() < 3 or np.std(x[ok]) == 0 or np.std(y[ok]) == 0:
        return float("nan")
    return float(np.corrcoef(x[ok], y[ok])[0, 1])


def draw(table: pd.DataFrame, out: Path) -> dict:
    df = _aggregates(table)
    numbers: dict = {}
    single = single_heads(df)
    multi = single[single["n_heads"] > 1]
    for method in ("zero", "mean"):
        sel = multi[multi["method"] == method]
        numbers[f"frac_heads_alone_label_acc_ge_0.9_{method}"] = float((sel["label_acc"] >= 0.9).mean())
        numbers[f"mean_head_alone_label_acc_{method}"] = float(sel["label_acc"].mean())
        numbers[f"mean_head_alone_eos_acc_{method}"] = float(sel["eos_acc"].mean())

    sizes = sorted(single["n_heads"].unique())
    fig, axes = plt.subplots(1, len(sizes), figsize=(4 * len(sizes), 3.2), squeeze=False)
    for ax, h in zip(axes[0], sizes):
        sel = single[(single["n_heads"] == h) & (single["method"] == "zero")].reset_index(drop=True)
        mean = single[(single["n_heads"] == h) & (single["method"] == "mean")].reset_index(drop=True)
        x = np.arange(len(sel))
        ax.bar(x - 0.2, sel["label_acc"], 0.4, label="label (zero abl.)")
        ax.bar(x + 0.2, sel["eos_acc"], 0.4, label="[EOS] (zero abl.)")
        ax.plot(x, mean["label_acc"], "k_", markersize=12, label="label (mean abl.)")
        ax.set_xticks(x, [f"s{s}h{hd}" for s, hd in zip(sel["seed"], sel["head"])], rotation=90, fontsize=7)
        ax.set_title(f"{h} head(s): each head alone")
        ax.set_ylim(0, 1.05)
    axes[0][0].set_ylabel("accuracy")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(out / "fig_single_heads.png", dpi=120)
    plt.close(fig)

    agg = []
    for (h, s), grp in df[(df["experiment"] == "count01_aggregation") & (df["n_heads"] > 1)].groupby(
        ["n_heads", "seed"]
    ):
        val = lambda iv, m, grp=grp: float(grp[(grp["intervention"] == iv) & (grp["metric"] == m)]["value"].iloc[0])
        heads = single[(single["n_heads"] == h) & (single["seed"] == s) & (single["method"] == "zero")]
        best = heads.loc[heads["label_acc"].idxmax()] if len(heads) else None
        agg.append(
            {
                "n_heads": h,
                "seed": s,
                "learned_label": val("none", "label_acc"),
                "learned_eos": val("none", "eos_acc"),
                "uniform_label": val("scale_heads", "label_acc"),
                "uniform_eos": val("scale_heads", "eos_acc"),
                "best_head_label": np.nan if best is None else best["label_acc"],
                "best_head_eos": np.nan if best is None else best["eos_acc"],
            }
        )
    agg = pd.DataFrame(agg)
    if len(agg):
        numbers["uniform_label_drop"] = float((agg["learned_label"] - agg["uniform_label"]).mean())
        numbers["uniform_eos_drop"] = float((agg["learned_eos"] - agg["uniform_eos"]).mean())
        numbers["best_head_label_drop"] = float((agg["learned_label"] - agg["best_head_label"]).mean())
        numbers["best_head_eos_drop"] = float((agg["learned_eos"] - agg["best_head_eos"]).mean())
        fig, ax = plt.subplots(figsize=(max(5, 0.9 * len(agg)), 3.2))
        x = np.arange(len(agg))
        for k, (col, name) in enumerate([("learned", "learned"), ("uniform", "uniform"), ("best_head", "best head")]):
            ax.bar(x + (k - 1) * 0.27, agg[f"{col}_label"], 0.13, label=f"{name}: label")
            ax.bar(x + (k - 1) * 0.27 + 0.13, agg[f"{col}_eos"], 0.13, label=f"{name}: [EOS]", alpha=0.6)
        ax.set_xticks(x, [f"{h}h s{s}" for h, s in zip(agg["n_heads"], agg["seed"])])
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("accuracy")
        ax.set_title("Aggregation of head outputs")
        ax.legend(fontsize=6, ncol=3, loc="lower right")
        fig.tight_layout()
        fig.savefig(out / "fig_aggregation.png", dpi=120)
        plt.close(fig)

    donors: dict[str, tuple[list[float], list[float], list[float]]] = {
        "pattern_from": ([], [], []),
        "values_from": ([], [], []),
    }
    shown = None
    for (h, s), _ in df[df["n_heads"] > 1].groupby(["n_heads", "seed"]):
        for kind, (swapped, own, donor) in donors.items():
            m = swap_matrix(df, kind, h, s)
            alone = np.diag(m)
            for i in range(h):
                for j in range(h):
                    if i != j and np.isfinite(m[i, j]):
                        swapped.append(m[i, j])
                        own.append(alone[i])
                        donor.append(alone[j])
        shown = (h, s) if shown is None or h >= shown[0] and s == 0 else shown
    for kind, (swapped, own, donor) in donors.items():
        numbers[f"{kind}_r_with_donor_alone"] = _r(swapped, donor)
        numbers[f"{kind}_r_with_receiver_alone"] = _r(swapped, own)
        numbers[f"{kind}_mean_abs_diff_to_donor"] = (
            float(np.mean(np.abs(np.subtract(swapped, donor)))) if swapped else float("nan")
        )
        numbers[f"{kind}_mean_abs_diff_to_receiver"] = (
            float(np.mean(np.abs(np.subtract(swapped, own)))) if swapped else float("nan")
        )
    if shown is not None:
        fig, axes = plt.subplots(1, 2, figsize=(8, 3.6))
        for ax, kind, title in zip(axes, ("pattern_from", "values_from"), ("pattern of head j", "values of head j")):
            im = ax.imshow(swap_matrix(df, kind, *shown), vmin=0.5, vmax=1.0, cmap="viridis")
            ax.set_title(f"head i alone with {title}", fontsize=9)
            ax.set_xlabel("j (donor)")
            ax.set_ylabel("i (receiver)")
        fig.colorbar(im, ax=axes, label="label accuracy")
        fig.suptitle(f"{shown[0]} heads, seed {shown[1]} (diagonal: head alone)", fontsize=9)
        fig.savefig(out / "fig_swaps.png", dpi=120)
        plt.close(fig)

    weights = token_weights(df).merge(single[single["method"] == "zero"], on=["n_heads", "seed", "head"])
    if len(weights):
        w0, w1, w2 = weights["attn_to_0"], weights["attn_to_1"], weights["attn_to_2"]
        weights["imbalance"] = (w0 - w1).abs() / (w0 + w1).clip(lower=1e-9)
        numbers["r_label_acc_vs_attn_to_2"] = _r(w2, weights["label_acc"])
        numbers["r_label_acc_vs_imbalance_0_1"] = _r(weights["imbalance"], weights["label_acc"])
        fig, axes = plt.subplots(1, 2, figsize=(8, 3.2), sharey=True)
        for ax, col, name in zip(
            axes, ("attn_to_2", "imbalance"), ("attention on noise token 2", "|w0 - w1| / (w0 + w1)")
        ):
            ax.scatter(weights[col], weights["label_acc"], c=np.log2(weights["n_heads"]), cmap="plasma", s=18)
            ax.set_xlabel(name)
        axes[0].set_ylabel("label accuracy of the head alone")
        fig.suptitle("Token weighting from SEP vs single-head performance", fontsize=9)
        fig.tight_layout()
        fig.savefig(out / "fig_token_weights.png", dpi=120)
        plt.close(fig)
    return numbers
