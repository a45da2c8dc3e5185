"""Attention-output SAEs (Kissane et al., arXiv 2406.17759) on toy-rr, the four-layer model trained here on
recall and two-hop reasoning (experiment=attn_sae).

`headlab reproduce attn_sae` fits a relu_l1 and a topk SAE on z of each of its layers, then draws:
  fig_layers.png            L0, explained variance and CE loss recovered per layer and architecture
  fig_head_attribution.png  feature-by-head decoder-norm shares (live features, grouped by their
                            dominant head), per layer, relu_l1
  fig_top_features.png      for features each dominated by one head, their top-activating contexts
numbers.json per architecture and layer: the summary metrics, among them polysemantic_head_fraction (heads
two of whose top sae.head_features features by decoder share have unrelated roles, read from where their
attention comes from: sae/source_roles.py, Kissane et al.'s reading, sae/head_attribution.py's head_roles),
its null rate, the same rule on the text's classes (context_class_*), the old rules beside them,
polysemantic_dominated_head_fraction (two such features among those a head dominates) and
multi_feature_head_fraction (heads dominating an effective two features or more); and per head the source
roles of its top features (head_roles_<arch>_L<layer>).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from ..sae.head_attribution import UNRELATED_OVERLAP  # noqa: E402
from ..sae.source_roles import role_column  # noqa: E402
from .canvas import save

SUMMARY = (
    "l0",
    "explained_variance",
    "ce_clean",
    "ce_zero_ablation",
    "ce_loss_recovered",
    "dead_fraction",
    "polysemantic_head_fraction",
    "polysemantic_random_fraction",
    "context_class_polysemantic_head_fraction",
    "context_class_polysemantic_random_fraction",
    "polysemantic_dominated_head_fraction",
    "multi_feature_head_fraction",
)
ARCH_COLOR = {"relu_l1": "tab:blue", "topk": "tab:orange"}
FEATURES_PER_HEAD = 2
CONTEXTS_SHOWN = 3


def summary(table: pd.DataFrame) -> pd.DataFrame:
    rows = table[
        (table["intervention"] == "sae")
        & (table["method"] != "fit")
        & table["head"].isna()
        & table["metric"].isin(SUMMARY)
    ]
    return rows.pivot_table(index=["method", "layer"], columns="metric", values="value").reset_index()


def shares(table: pd.DataFrame, method: str, layer: int) -> pd.DataFrame:
    rows = table[(table["metric"] == "decoder_share") & (table["method"] == method) & (table["layer"] == layer)]
    return rows.pivot_table(index="feature", columns="head", values="value")


def draw(table: pd.DataFrame, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    summ = summary(table)
    layers = sorted(summ["layer"].unique())
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    width = 0.8 / max(1, summ["method"].nunique())
    for ax, metric in zip(axes, ("l0", "explained_variance", "ce_loss_recovered")):
        for i, (method, rows) in enumerate(summ.groupby("method")):
            x = np.array([layers.index(v) for v in rows["layer"]]) + i * width
            ax.bar(x, rows[metric], width, color=ARCH_COLOR.get(str(method), "gray"), label=method)
        ax.set(
            xticks=np.arange(len(layers)) + width * (summ["method"].nunique() - 1) / 2,
            xticklabels=[f"L{int(v)}" for v in layers],
            title=metric.replace("_", " "),
        )
    axes[0].legend(fontsize=8)
    save(fig, out / "fig_layers.png", dpi=120)

    method = "relu_l1" if (summ["method"] == "relu_l1").any() else summ["method"].iloc[0]
    fig, axes = plt.subplots(1, len(layers), figsize=(3.2 * len(layers), 4.5), squeeze=False)
    for ax, layer in zip(axes[0], layers):
        m = shares(table, method, layer)
        order = np.lexsort((-m.max(axis=1).to_numpy(), m.to_numpy().argmax(1)))
        image = ax.imshow(m.to_numpy()[order], aspect="auto", cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
        ax.set(xlabel="head", title=f"L{int(layer)} {method}: {len(m)} live", xticks=range(m.shape[1]))
    axes[0][0].set_ylabel("live features, grouped by dominant head")
    fig.colorbar(image, ax=axes[0].tolist(), label="share of decoder norm")
    save(fig, out / "fig_head_attribution.png", dpi=120, tight=False, bbox_inches="tight")

    features = head_features(table, method, layers[-1])
    lines = [f"top-activating contexts, L{int(layers[-1])} {method} ([[token]] = where it fires)", ""]
    for f in features:
        lines.append(f"feature {f['feature']} (head {f['head']}, share {f['share']:.2f})")
        lines += [f"    {c}" for c in f["contexts"]]
    fig = plt.figure(figsize=(11, 0.22 * len(lines) + 0.6))
    fig.text(
        0.01,
        0.99,
        "\n".join(lines if features else [*lines, "no live features"]),
        family="monospace",
        fontsize=7,
        va="top",
    )
    save(fig, out / "fig_top_features.png", dpi=120, tight=False, bbox_inches="tight")

    numbers: dict[str, dict[str, Any]] = {
        f"{r['method']}_L{int(r['layer'])}": {m: float(r[m]) for m in SUMMARY if m in r and pd.notna(r[m])}
        for _, r in summ.iterrows()
    }
    numbers["polysemantic_criterion"] = {
        "polysemantic_head_fraction": "share of heads two of whose top features by decoder share (Kissane et "
        "al. read 10) have unrelated roles: the distributions of their top contexts' source roles (where the "
        "feature's direct attribution comes from: first, current or previous token, induction, same token, "
        f"local context, long range; sae/source_roles.py) overlap < {UNRELATED_OVERLAP}",
        "polysemantic_random_fraction": "the same rule on top-feature sets drawn at random (its null rate)",
        "context_class_polysemantic_head_fraction": "the same rule on the classes of the text at the features' "
        "top contexts (punctuation, dialogue, sentence start, narration; else the task's roles or token "
        "types): what the text is, not what the attention does",
        "polysemantic_dominated_head_fraction": "old rule: the text classes among the features a head dominates",
        "multi_feature_head_fraction": "old criterion: share of heads dominating an effective >= 2 features",
        "unrelated_overlap": UNRELATED_OVERLAP,
    }
    numbers.update(head_roles(table))
    numbers[f"features_L{int(layers[-1])}_{method}"] = {
        f"f{f['feature']}": {
            "head": f["head"],
            "share": round(f["share"], 4),
            "top_context": (f["contexts"] or [""])[0],
        }
        for f in features
    }
    return numbers


def head_features(table: pd.DataFrame, method: str, layer: int) -> list[dict]:
    """The FEATURES_PER_HEAD features most concentrated on each head, with their top contexts."""
    m = shares(table, method, layer)
    ctx = table[(table["metric"] == "top_context") & (table["method"] == method) & (table["layer"] == layer)]
    picked = []
    for head in m.columns:
        mine = m[m.to_numpy().argmax(1) == list(m.columns).index(head)][head].sort_values(ascending=False)
        for feature, share in mine.head(FEATURES_PER_HEAD).items():
            rows = ctx[ctx["feature"] == feature].sort_values("rank").head(CONTEXTS_SHOWN)
            picked.append(
                {
                    "feature": int(feature),
                    "head": int(head),
                    "share": float(share),
                    "contexts": [f"{v:.2f}  {c}" for v, c in zip(rows["value"], rows["context"])],
                }
            )
    return picked


def head_roles(table: pd.DataFrame) -> dict[str, dict[str, dict[str, int]]]:
    """head_roles_<arch>_L<layer> -> head -> role -> how many of its top features have it (roles it has)."""
    rows = table[(table["metric"] == "top_features_in_role") & (table["value"] > 0)]
    out: dict[str, dict[str, dict[str, int]]] = {}
    for (method, layer, head), group in rows.groupby(["method", "layer", "head"]):
        roles = out.setdefault(f"head_roles_{method}_L{int(layer)}", {})
        roles[str(int(head))] = {str(c): int(v) for c, v in zip(group[role_column(group)], group["value"])}
    return out


FIGURE_SET = draw
