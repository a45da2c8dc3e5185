"""Tiberi et al. (arXiv 2405.15926) hidden Markov chain reproduction: figures and numbers from tables.

fig_accuracy.png        (a) test accuracy vs width: theory, posterior samples, gradient descent, GP lines
                            for all paths / the good path / good + denoising paths (Fig. 2c top)
fig_order_parameter.png (b) U over path pairs for several widths, theory above samples (Fig. 2c bottom)
fig_alignment.png       (c) |cos| of the kernel's principal components with the labels, finite N vs GP (2d)
fig_two_paths.png       (d) the noisier two-path variant: accuracy vs width (Fig. 2e)
fig_pruning.png         (e) head score and accuracy drop per pruned head; accuracy vs heads pruned in
                            score order and in random order, on two layers of four heads (experiment
                            markov_pruning): a pruning study on the Markov task, not the paper's
                            Omniglot experiment (Fig. 3e-f), whose idea it borrows
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from .canvas import save

MAIN, TWO, PRUNE = "markov_paths", "markov_two_paths", "markov_pruning"
METHOD_STYLE = {
    "theory": dict(color="tab:blue", marker="x", label="theory (finite N)"),
    "sample": dict(color="black", marker="o", label="posterior samples (HMC)"),
    "gd": dict(color="tab:green", marker="s", label="gradient descent"),
}
GP_STYLE = {
    "gp": ("-", "GP, all paths"),
    "gp_good": ("--", "GP, good path"),
    "gp_good_denoising": (":", "GP, good + denoising paths"),
}


def _accuracy(table: pd.DataFrame, experiment: str) -> pd.DataFrame:
    rows = table[
        (table["experiment"] == experiment) & (table["intervention"] == "none") & (table["metric"] == "test_acc")
    ]
    return rows[["width", "method", "value", "ci_low", "ci_high"]].sort_values("width")


def _plot_accuracy(ax, acc: pd.DataFrame, title: str) -> None:
    for method, style in METHOD_STYLE.items():
        rows = acc[acc["method"] == method]
        if rows.empty:
            continue
        err = np.stack([rows["value"] - rows["ci_low"], rows["ci_high"] - rows["value"]])
        ax.errorbar(rows["width"], rows["value"], yerr=np.nan_to_num(err), capsize=2, ls="none", **style)
    for method, (ls, label) in GP_STYLE.items():
        rows = acc[acc["method"] == method]
        if not rows.empty:
            ax.axhline(rows["value"].iloc[0], color="tab:red", ls=ls, label=label)
    ax.set(xscale="log", xlabel="width N", ylabel="test accuracy", title=title)
    ax.legend(fontsize=7)


def _orders(table: pd.DataFrame, experiment: str) -> pd.DataFrame:
    return table[(table["experiment"] == experiment) & (table["metric"] == "order_parameter")]


def _matrix(rows: pd.DataFrame) -> tuple[np.ndarray, list[str]]:
    labels = list(dict.fromkeys(rows["path"]))
    m = rows.pivot_table(index="path", columns="path_b", values="value").loc[labels, labels]
    return m.to_numpy(), labels


def _plot_orders(table: pd.DataFrame, out: Path) -> None:
    orders = _orders(table, MAIN)
    widths = sorted(orders["width"].unique())
    shown = [w for w in widths if w in (widths[0], 100, widths[-1])] or widths
    methods = [m for m in ("theory", "sample") if m in set(orders["method"])]
    fig, axes = plt.subplots(len(methods), len(shown), figsize=(3.2 * len(shown), 3 * len(methods)), squeeze=False)
    for i, method in enumerate(methods):
        for j, width in enumerate(shown):
            m, labels = _matrix(orders[(orders["method"] == method) & (orders["width"] == width)])
            lim = np.abs(m).max()
            im = axes[i, j].imshow(m, cmap="RdBu_r", vmin=-lim, vmax=lim)
            axes[i, j].set(title=f"{method}, N={width}", xticks=range(len(labels)), yticks=range(len(labels)))
            axes[i, j].set_xticklabels(labels, rotation=90, fontsize=6)
            axes[i, j].set_yticklabels(labels, fontsize=6)
            fig.colorbar(im, ax=axes[i, j], shrink=0.7)
    save(fig, out / "fig_order_parameter.png", dpi=120)


def _plot_alignment(table: pd.DataFrame, out: Path) -> dict:
    rows = table[(table["experiment"] == MAIN) & (table["metric"] == "label_alignment")]
    width = rows["width"].min()
    rows = rows[rows["width"] == width]
    fig, ax = plt.subplots(figsize=(6, 3))
    numbers = {}
    for shift, (method, label) in zip((-0.2, 0.2), (("gp", "GP"), ("theory", f"finite N={width}"))):
        r = rows[rows["method"] == method].sort_values("rank")
        ax.bar(r["rank"] + shift, r["value"], width=0.4, label=label)
        numbers[method] = {"top1": float(r["value"].iloc[0]), "top5_sum_sq": float((r["value"].iloc[:5] ** 2).sum())}
    ax.set(xlabel="principal component (by eigenvalue)", ylabel="|cos| with labels", title="kernel-task alignment")
    ax.legend()
    save(fig, out / "fig_alignment.png", dpi=120)
    return {"width": int(width), **numbers}


def _pruning(table: pd.DataFrame, experiment: str, width: int) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    rows = table[(table["experiment"] == experiment) & (table["width"] == width)]
    acc = rows[rows["metric"] == "test_acc"]
    base = acc[acc["intervention"] == "none"].set_index("method")["value"]
    single = acc[acc["intervention"] == "prune"].drop(columns=["head_kind"], errors="ignore")
    single["drop"] = single["method"].map(base) - single["value"]
    scores = rows[rows["metric"] == "head_score"]
    single = single.merge(
        scores[["method", "layer", "head", "value", "head_kind"]].rename(columns={"value": "score"}),
        on=["method", "layer", "head"],
    )
    ordered = acc[acc["intervention"] == "prune_by_score"][["method", "n_pruned", "value"]]
    random = acc[acc["intervention"] == "prune_random"].groupby(["method", "n_pruned"])["value"].mean().reset_index()
    return single, ordered, random


def _plot_pruning(table: pd.DataFrame, out: Path) -> dict:
    experiment = PRUNE if (table["experiment"] == PRUNE).any() else MAIN
    width = int(table[table["experiment"] == experiment]["width"].min())
    single, ordered, random = _pruning(table, experiment, width)
    methods = [m for m in ("theory", "sample", "gd") if m in set(single["method"])]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for method in methods:
        s = single[single["method"] == method]
        axes[0].scatter(
            s["score"], s["drop"], label=method, **{k: METHOD_STYLE[method][k] for k in ("color", "marker")}
        )
        for _, r in s.iterrows():
            axes[0].annotate(f"L{r['layer']}H{r['head']} {r['head_kind']}", (r["score"], r["drop"]), fontsize=6)
        o = ordered[ordered["method"] == method]
        rnd = random[random["method"] == method]
        axes[1].plot(
            o["n_pruned"], o["value"], color=METHOD_STYLE[method]["color"], marker="o", label=f"{method}: by score"
        )
        axes[1].plot(
            rnd["n_pruned"], rnd["value"], color=METHOD_STYLE[method]["color"], ls="--", label=f"{method}: random"
        )
    axes[0].set(
        xlabel="head score (from U)",
        ylabel="accuracy drop when pruned",
        title=f"Markov task (not Omniglot): single heads, N={width}",
    )
    axes[1].set(xlabel="heads pruned", ylabel="test accuracy", title="Markov task: pruning by score vs random order")
    for ax in axes:
        ax.legend(fontsize=7)
    save(fig, out / "fig_pruning.png", dpi=120)
    numbers = {"experiment": experiment, "width": int(width)}
    for method in methods:
        o = ordered[ordered["method"] == method].set_index("n_pruned")["value"]
        r = random[random["method"] == method].set_index("n_pruned")["value"]
        s = single[single["method"] == method]
        numbers[method] = {
            "acc_by_score": {int(k): round(float(v), 4) for k, v in o.items()},
            "acc_random_mean": {int(k): round(float(v), 4) for k, v in r.items()},
            "score_vs_drop_spearman": float(s["score"].corr(s["drop"], method="spearman")) if len(s) > 2 else None,
        }
    return numbers


def draw(table: pd.DataFrame, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    numbers: dict = {}
    panels = (
        (MAIN, "four paths (Fig. 2c)", "fig_accuracy.png"),
        (TWO, "two paths, noisier data (Fig. 2e)", "fig_two_paths.png"),
    )
    for experiment, title, filename in panels:
        acc = _accuracy(table, experiment)
        if acc.empty:
            continue
        fig, ax = plt.subplots(figsize=(5.5, 4))
        _plot_accuracy(ax, acc, title)
        save(fig, out / filename, dpi=120)
        numbers[experiment] = {
            method: {int(w): round(float(v), 4) for w, v in zip(rows["width"], rows["value"])}
            for method, rows in acc.groupby("method")
        }
        for method in GP_STYLE:
            if method in numbers[experiment]:
                numbers[experiment][method] = next(iter(numbers[experiment][method].values()))
        errors = table[(table["experiment"] == experiment) & (table["metric"] == "u_rel_error_vs_theory")]
        numbers[experiment]["u_rel_error_sample_vs_theory"] = {
            int(w): round(float(v), 4) for w, v in zip(errors["width"], errors["value"])
        }
    _plot_orders(table, out)
    numbers["alignment"] = _plot_alignment(table, out)
    numbers["pruning"] = _plot_pruning(table, out)
    return numbers


FIGURE_SET = draw
