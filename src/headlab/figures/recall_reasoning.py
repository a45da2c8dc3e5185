"""Recall vs reasoning (arXiv 2510.03366): figures and headline numbers from a circuits run's table.

fig_component_effects.png  recall drop vs reasoning drop per head, attention layer, MLP and neuron group
                           ablated; beside it, per head patched from the paired prompt of the other kind
fig_knockouts.png          recall and reasoning accuracy with the top-k recall / reasoning components
                           ablated together, against k random components (min-max band over draws)
fig_layer_profile.png      recall and reasoning drop per layer, attention vs MLP
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

from .canvas import save

CLASS_COLOR = {"recall": "tab:blue", "reasoning": "tab:red", "shared": "tab:purple", "none": "lightgray"}
KIND_MARKER = {"ablate_head": "o", "ablate_layer": "s", "ablate_mlp": "^", "ablate_neurons": "x"}
PAPER_MAX_DROP_PP = 15.0  # arXiv 2510.03366: ablating a circuit lowers its kind's accuracy "up to 15%"
KNOCKOUT_STYLE = {
    "recall_top": ("tab:blue", "top recall components"),
    "reasoning_top": ("tab:red", "top reasoning components"),
    "random": ("gray", "random components"),
}


def component_drops(table: pd.DataFrame) -> pd.DataFrame:
    """One row per component: drop_recall, drop_reasoning, selectivity, class."""
    rows = table[table["metric"].isin(["drop_recall", "drop_reasoning", "selectivity"])]
    keys = ["component", "intervention"]
    wide = rows.pivot_table(index=keys, columns="metric", values="value", aggfunc="first")
    return wide.join(rows.groupby(keys)["class"].first()).reset_index()


def knockout_table(table: pd.DataFrame) -> pd.DataFrame:
    rows = table[table["intervention"] == "knockout"]
    return rows.pivot_table(index=["method", "k"], columns="metric", values="value").reset_index()


def draw(table: pd.DataFrame, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    comps = component_drops(table)
    fig, axes = plt.subplots(1, 2, figsize=(11, 5), sharex=True, sharey=True)
    panels = [
        (axes[0], KIND_MARKER, "ablated"),
        (axes[1], {"patch_head": "o"}, "head z at the answer from the other kind's prompt"),
    ]
    for ax, markers, title in panels:
        for kind, marker in markers.items():
            c = comps[comps["intervention"] == kind]
            ax.scatter(
                100 * c["drop_recall"], 100 * c["drop_reasoning"], marker=marker, c=[CLASS_COLOR[k] for k in c["class"]]
            )
        ax.axhline(0, color="k", lw=0.5)
        ax.axvline(0, color="k", lw=0.5)
        for line in (ax.axvline, ax.axhline):
            line(PAPER_MAX_DROP_PP, color="gray", ls=":", lw=0.8)  # the paper's largest drop, for scale
        ax.set(xlabel="recall accuracy drop (pp)", ylabel="reasoning accuracy drop (pp)", title=title)
        # shape = component kind, colour = class: one legend entry per meaning, not per (kind, class)
        shapes = [
            Line2D([], [], ls="", marker=m, color="k", label=k.replace("ablate_", "").replace("_", " "))
            for k, m in markers.items()
        ]
        colours = [Line2D([], [], ls="", marker="o", color=c, label=k) for k, c in CLASS_COLOR.items()]
        ax.legend(handles=shapes + colours, fontsize=7)
    save(fig, out / "fig_component_effects.png", dpi=120)

    ko = knockout_table(table)
    bands = table[(table["intervention"] == "knockout") & (table["method"] == "random")]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, metric in zip(axes, ("recall_acc", "reasoning_acc")):
        for method, (color, label) in KNOCKOUT_STYLE.items():
            r = ko[ko["method"] == method].sort_values("k")
            ax.plot(r["k"], r[metric], marker="o", color=color, label=label)
        b = bands[bands["metric"] == metric].sort_values("k")
        ax.fill_between(b["k"].astype(float), b["ci_low"], b["ci_high"], color="gray", alpha=0.2)
        ax.set(xlabel="components ablated together (k)", ylabel=metric, title=metric.replace("_", " "))
    axes[0].legend(fontsize=7)
    save(fig, out / "fig_knockouts.png", dpi=120)

    layered = comps[comps["intervention"].isin(["ablate_layer", "ablate_mlp"])].copy()
    layered["layer"] = layered["component"].str.extract(r"L(\d+)", expand=False).astype(int)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.2
    for j, (kind, metric) in enumerate(
        [(k, m) for k in ("ablate_layer", "ablate_mlp") for m in ("drop_recall", "drop_reasoning")]
    ):
        r = layered[layered["intervention"] == kind].sort_values("layer")
        ax.bar(
            r["layer"] + (j - 1.5) * width,
            100 * r[metric],
            width,
            label=f"{'attention' if kind == 'ablate_layer' else 'MLP'}: {metric.replace('drop_', '')}",
        )
    ax.axhline(PAPER_MAX_DROP_PP, color="gray", ls=":", lw=0.8, label="paper: up to 15 pp")
    ax.set(xlabel="layer", ylabel="accuracy drop (pp)", title="layer profile")
    ax.legend(fontsize=7)
    save(fig, out / "fig_layer_profile.png", dpi=120)
    return numbers(table, comps, ko)


def pp(fraction: float) -> float:
    """An accuracy difference (fractions of 1) in percentage points."""
    return round(100 * float(fraction), 2)


def random_matches_recall_top(out: dict, k: int) -> dict | None:
    """Recall drops at k of the top-k recall components and of k random ones: the targeted circuit is only
    specific where it cuts recall more than a random set of the same size does."""
    top, rnd = out.get("knockout_recall_top", {}).get(k), out.get("knockout_random", {}).get(k)
    if top is None or rnd is None:
        return None
    return {
        "k": k,
        "recall_top_recall_drop_pp": top["recall_drop_pp"],
        "random_recall_drop_pp": rnd["recall_drop_pp"],
        "random_cuts_recall_as_much": rnd["recall_drop_pp"] >= top["recall_drop_pp"],
    }


def numbers(table: pd.DataFrame, comps: pd.DataFrame, ko: pd.DataFrame) -> dict:
    clean = table[(table["intervention"] == "none") & table["metric"].isin(["recall_acc", "reasoning_acc"])]
    base = ko[ko["method"] == "clean"].iloc[0] if (ko["method"] == "clean").any() else None
    ablated = comps[comps["intervention"] != "patch_head"]
    n = int(clean["n"].iloc[0]) if len(clean) and "n" in clean else 0
    out: dict = {
        "model": str(table["model"].iloc[0]) if "model" in table and len(table) else None,
        "clean": {m: round(float(v), 4) for m, v in zip(clean["metric"], clean["value"])},
        # a table without intervals (output.n_boot=0) has none to give
        "clean_ci": {
            m: [round(float(lo), 4), round(float(hi), 4)]
            for m, lo, hi in clean.reindex(columns=["metric", "ci_low", "ci_high"]).values
            if pd.notna(lo)
        },
        # half the prompts are recall, half reasoning (the i-th of each about one subject): the questions answered
        "n_prompts": n,
        "answered": {m.removesuffix("_acc"): round(float(v) * n / 2) for m, v in zip(clean["metric"], clean["value"])},
        # the paper reports accuracy drops of "up to 15%" of a 0-100 accuracy: percentage points, as ours
        "paper_max_drop_pp": PAPER_MAX_DROP_PP,
        "classes": {k: int(v) for k, v in ablated["class"].value_counts().items()},
    }
    if base is not None:
        for method in ("recall_top", "reasoning_top", "random"):
            r = ko[ko["method"] == method].set_index("k")
            out[f"knockout_{method}"] = {
                int(k): {
                    "recall_drop_pp": pp(base["recall_acc"] - row["recall_acc"]),
                    "reasoning_drop_pp": pp(base["reasoning_acc"] - row["reasoning_acc"]),
                }
                for k, row in r.iterrows()
            }
        out["random_vs_recall_top_at_k3"] = random_matches_recall_top(out, 3)
    for kind, name in (
        ("ablate_head", "heads"),
        ("ablate_neurons", "neuron_groups"),
        ("ablate_mlp", "mlps"),
        ("patch_head", "heads_patched_from_other_kind"),
    ):
        c = comps[comps["intervention"] == kind]
        if len(c):
            drops = c[["drop_recall", "drop_reasoning"]].to_numpy()
            out[name] = {
                "max_recall_drop_pp": pp(c["drop_recall"].max()),
                "max_reasoning_drop_pp": pp(c["drop_reasoning"].max()),
                "mean_abs_drop_pp": pp(np.abs(drops).mean()),
            }
    patched = comps[comps["intervention"] == "patch_head"].set_index("component")
    if len(patched):
        out["heads_patched_from_other_kind"]["classes"] = {
            k: int(v) for k, v in patched["class"].value_counts().items()
        }
        heads = comps[comps["intervention"] == "ablate_head"].set_index("component").loc[patched.index]
        # do the heads that matter when ablated also matter when they carry the other kind's activation?
        out["heads_patched_from_other_kind"]["pearson_r_with_head_ablation"] = {
            kind: round(float(np.corrcoef(heads[f"drop_{kind}"], patched[f"drop_{kind}"])[0, 1]), 4)
            for kind in ("recall", "reasoning")
        }
    return out


FIGURE_SET = draw
