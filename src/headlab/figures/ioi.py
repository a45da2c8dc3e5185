"""IOI (Wang et al. 2022, arXiv 2211.00593) layer x head heatmaps, drawn from the tidy table alone.

Effects are differences from the clean run (intervention "none", method "none") of the same seed, on the
logit difference IO - S, then averaged over seeds; layer 0 is the top row, as in TransformerLens's demo.
  ioi_ablation_<method>.png          ablate_head (mean | zero | resample): one panel per (site, position)
  ioi_layers.png                     ablate_layer (attention output) and ablate_mlp, per layer
  ioi_patch_activation.png           patch_head, exact activation patching: rows = sites, cols = positions
  ioi_patch_attribution.png          patch_head, attribution patching (first-order estimate), same layout
  ioi_attribution_vs_activation.png  estimate vs exact effect per head, Pearson r in each title
  ioi_path_patching.png              path_patch, one panel per receiver set (and receiver site; and
                                     heads knocked out, against that knockout's own run)
  ioi_head_scores.png                head-class scores (method "score"), one panel per score
  ioi_head_classes.png               the paper's head classes beside the heads the scores put in them
                                     (figures/ioi_classes.py)
  circuit_<method>.png, faithfulness.png   edge circuits (figures/circuit.py), where a run found one
Each figure is drawn only if its rows are in the table. Rows with a prompt_id (per-prompt) are ignored.
A table of several models (a reproduction's) draws each into a folder of its own, <out>/<model>/.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from ..vocabulary import HEAD_SITES  # noqa: E402
from . import circuit, ioi_classes  # noqa: E402
from .canvas import ordered, save

METRICS = {"logit_diff": "logit diff (IO - S)", "io_prob": "P(IO)", "accuracy": "accuracy"}
SCORES = (
    "prev_token_score",
    "duplicate_token_score",
    "induction_score",
    "attn_end_to_io",
    "attn_end_to_s1",
    "attn_end_to_s2",
    "copy_score",
    "negative_copy_score",
)
SITES = HEAD_SITES
WHERE = ("all", "END", "S2", "S1", "IO")
TOP_K = 5


def _f(x) -> float | None:
    """A JSON-safe float: None for NaN or infinity."""
    return float(x) if x is not None and np.isfinite(x) else None


def _pearson(x, y) -> float | None:
    x, y = np.asarray(x, float).ravel(), np.asarray(y, float).ravel()
    ok = np.isfinite(x) & np.isfinite(y)
    if ok.sum() < 3 or np.std(x[ok]) == 0 or np.std(y[ok]) == 0:
        return None
    return float(np.corrcoef(x[ok], y[ok])[0, 1])


def _prepare(table: pd.DataFrame, model: str | None) -> pd.DataFrame:
    df = table.copy()
    if "prompt_id" in df:
        df = df[df["prompt_id"].isna()]
    if model is not None:
        df = df[df["model"] == model]
    for col in ("site", "token", "receivers"):
        df[col] = df[col].astype("string") if col in df else pd.Series(pd.NA, index=df.index, dtype="string")
    pos = "pos " + df["position"].astype("string")
    df["where"] = df["token"].fillna(pos).fillna("all")
    return df


def _effects(df: pd.DataFrame, rows: pd.DataFrame, metric: str) -> pd.DataFrame:
    """rows of `metric` with effect = value - clean value of the same seed (NaN without a clean row)."""
    clean = df[(df["intervention"] == "none") & (df["method"] == "none") & (df["metric"] == metric)]
    rows = rows[rows["metric"] == metric]
    return rows.assign(effect=rows["value"] - rows["seed"].map(clean.groupby("seed")["value"].mean()))


def _knocked_out(df: pd.DataFrame, rows: pd.DataFrame, metric: str) -> pd.DataFrame:
    """rows whose run had heads knocked out (a `group`: study=ioi_classes' backup round) with effect = value -
    that knockout's own value (its row: the same group, no layer), not the clean run's."""
    if "group" not in rows or rows["group"].isna().all():
        return rows
    own = df[(df["metric"] == metric) & df["layer"].isna() & df["group"].notna() & (df["intervention"] != "path_patch")]
    means = own.groupby(["group", "seed"])["value"].mean()
    held = rows["group"].notna()
    keys = pd.MultiIndex.from_arrays([rows.loc[held, "group"], rows.loc[held, "seed"]])
    rows = rows.copy()
    rows.loc[held, "effect"] = rows.loc[held, "value"].to_numpy() - means.reindex(keys).to_numpy()
    return rows


def _metric(rows: pd.DataFrame) -> str | None:
    """The first task metric (logit diff first) that has finite values among rows."""
    for m in METRICS:
        if np.isfinite(rows.loc[rows["metric"] == m, "value"].astype(float)).any():
            return m
    return None


def _grid(rows: pd.DataFrame, col: str, shape: tuple[int, int], index=("layer", "head")) -> np.ndarray:
    m = np.full(shape, np.nan)
    for key, v in rows.dropna(subset=list(index)).groupby(list(index))[col].mean().items():
        m[int(key[0]), int(key[1])] = v
    return m


def _top(m: np.ndarray, by_abs: bool = True) -> list[dict]:
    """The TOP_K heads as {"head": "L.H", "value": v}, largest |v| first (largest v for scores)."""
    key = np.where(np.isfinite(m), np.abs(m) if by_abs else m, -np.inf).ravel()
    order = [i for i in np.argsort(-key, kind="stable") if np.isfinite(key[i])][:TOP_K]
    return [{"head": f"{i // m.shape[1]}.{i % m.shape[1]}", "value": float(m.flat[i])} for i in order]


def _heatmap(
    ax,
    m: np.ndarray,
    title: str,
    effect: bool = True,
    xlabel: str = "head",
    ylabel: str = "layer",
    yticks: list[str] | None = None,
    cbar: str = "",
) -> None:
    """One layer x head heatmap: diverging and centred at 0 for effects, sequential for scores."""
    finite = m[np.isfinite(m)]
    if effect:
        lim = float(np.abs(finite).max()) if finite.size and np.abs(finite).max() > 0 else 1.0
        im = ax.imshow(m, cmap="RdBu", vmin=-lim, vmax=lim, aspect="auto")
    else:
        lo, hi = (float(min(0, finite.min())), float(finite.max())) if finite.size else (0.0, 1.0)
        im = ax.imshow(m, cmap="viridis", vmin=lo, vmax=hi if hi > lo else lo + 1, aspect="auto")
    ax.set_xticks(range(m.shape[1]))
    ax.set_yticks(range(m.shape[0]), yticks if yticks is not None else range(m.shape[0]))
    ax.tick_params(labelsize=7)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=8)
    ax.figure.colorbar(im, ax=ax, label=cbar, shrink=0.85)


def _figure(nrows: int, ncols: int, shape: tuple[int, int]):
    w, h = max(3.2, 1.8 + 0.32 * shape[1]), max(2.4, 1.2 + 0.28 * shape[0])
    return plt.subplots(nrows, ncols, figsize=(w * ncols, h * nrows), squeeze=False)


def _save(fig, out: Path, name: str, numbers: dict) -> None:
    save(fig, out / name, dpi=110)
    numbers["figures"].append(name)


def _head_sweep(df, rows, what: str, name: str, out: Path, shape, numbers: dict) -> dict[str, np.ndarray]:
    """A grid of heatmaps over (site, position) for one kind of per-head sweep; returns label -> grid."""
    rows = rows.dropna(subset=["layer", "head"])
    metric = _metric(rows)
    if metric is None:
        return {}
    rows = _effects(df, rows, metric).assign(site=lambda r: r["site"].fillna("z"))
    if not np.isfinite(rows["effect"].astype(float)).any():
        numbers["skipped"].append(f"{what}: no clean baseline for {metric}")
        return {}
    sites, wheres = ordered(rows["site"], SITES), ordered(rows["where"], WHERE)
    fig, axes = _figure(len(sites), len(wheres), shape)
    grids = {}
    for i, site in enumerate(sites):
        for j, where in enumerate(wheres):
            cell = rows[(rows["site"] == site) & (rows["where"] == where)]
            if cell.empty:
                axes[i][j].axis("off")
                continue
            grids[f"{site}@{where}"] = g = _grid(cell, "effect", shape)
            positions = "all positions" if where == "all" else f"at {where}"
            _heatmap(
                axes[i][j], g, f"{what}: change in {METRICS[metric]}\nsite {site}, {positions}", cbar=f"Δ {metric}"
            )
    _save(fig, out, name, numbers)
    numbers[name.removeprefix("ioi_").removesuffix(".png")] = {k: _top(g) for k, g in grids.items()}
    return grids


def draw(table: pd.DataFrame, out: Path, model: str | None = None) -> dict:
    """Every IOI figure the table has rows for, into `out`; returns headline numbers (JSON-safe).

    A table of several models draws `model`, or without one each model into <out>/<model>/, its numbers
    under "models"."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    models = sorted(table["model"].dropna().unique()) if "model" in table and len(table) else []
    if model is None and len(models) > 1:
        return {"models": {m: draw(table, out / str(m).replace("/", "_"), m) for m in models}}
    model = model if model is not None else (models[0] if models else None)
    df = _prepare(table, model)
    numbers: dict = {"model": model, "figures": [], "skipped": []}
    if df.empty:
        return numbers
    layers, heads = df["layer"].max(), df["head"].max()
    shape = (int(layers) + 1 if pd.notna(layers) else 1, int(heads) + 1 if pd.notna(heads) else 1)
    numbers["n_layers"], numbers["n_heads"] = shape
    clean = df[(df["intervention"] == "none") & (df["method"] == "none")]
    # runs on different prompt counts (a reproduction's) read different prompts: the one on the most speaks
    clean = clean[clean["n"] == clean["n"].max()] if len(clean) else clean
    numbers["clean"] = {
        m: _f(clean.loc[clean["metric"] == m, "value"].mean()) for m in METRICS if (clean["metric"] == m).any()
    }
    numbers["clean_n_prompts"] = int(clean["n"].max()) if len(clean) else None

    kind = df["intervention"]
    for method in ordered(df.loc[kind == "ablate_head", "method"], ("mean", "zero", "resample")):
        rows = df[(kind == "ablate_head") & (df["method"] == method)]
        _head_sweep(df, rows, f"{method} ablation", f"ioi_ablation_{method}.png", out, shape, numbers)

    comp = df[kind.isin(["ablate_layer", "ablate_mlp"])].dropna(subset=["layer"])
    metric = _metric(comp) if len(comp) else None
    if metric is not None:
        comp = _effects(df, comp, metric)
        labels, vectors = [], []
        for method in ordered(comp["method"], ("mean", "zero", "resample")):
            for iv, part in (("ablate_layer", "attn"), ("ablate_mlp", "mlp")):
                sel = comp[(comp["intervention"] == iv) & (comp["method"] == method)]
                if len(sel):
                    labels.append(f"{part} ({method})")
                    vectors.append(_grid(sel.assign(row=0), "effect", (1, shape[0]), ("row", "layer"))[0])
        if np.isfinite(np.asarray(vectors, float)).any():
            fig, ax = plt.subplots(figsize=(max(4.0, 1.8 + 0.45 * shape[0]), 1.4 + 0.35 * len(labels)))
            _heatmap(
                ax,
                np.asarray(vectors),
                f"ablating a layer's attention / MLP output: change in {METRICS[metric]}",
                xlabel="layer",
                ylabel="",
                yticks=labels,
                cbar=f"Δ {metric}",
            )
            _save(fig, out, "ioi_layers.png", numbers)
            numbers["layers"] = {lab: [_f(v) for v in vec] for lab, vec in zip(labels, vectors)}
        else:
            numbers["skipped"].append(f"layer ablation: no clean baseline for {metric}")

    patched = df[kind == "patch_head"]
    exact = _head_sweep(
        df,
        patched[patched["method"] == "activation"],
        "activation patching",
        "ioi_patch_activation.png",
        out,
        shape,
        numbers,
    )
    approx = _head_sweep(
        df,
        patched[patched["method"] == "attribution"],
        "attribution patching (estimate)",
        "ioi_patch_attribution.png",
        out,
        shape,
        numbers,
    )
    both = [k for k in exact if k in approx]
    if both:
        fig, axes = plt.subplots(1, len(both), figsize=(3.6 * len(both), 3.4), squeeze=False)
        numbers["attribution_vs_activation_r"] = {}
        for ax, key in zip(axes[0], both):
            x, y = exact[key].ravel(), approx[key].ravel()
            r = numbers["attribution_vs_activation_r"][key] = _pearson(x, y)
            finite = np.concatenate([x[np.isfinite(x)], y[np.isfinite(y)]])
            lim = (finite.min(), finite.max()) if finite.size else (0, 1)
            ax.plot(lim, lim, color="grey", lw=0.8, ls="--")
            ax.scatter(x, y, s=14)
            ax.set_xlabel("activation patching (exact)")
            ax.set_ylabel("attribution patching (estimate)")
            ax.set_title(
                f"{key.replace('@', ', ')}: Δ logit diff per head, r = {'n/a' if r is None else f'{r:.3f}'}", fontsize=8
            )
        _save(fig, out, "ioi_attribution_vs_activation.png", numbers)

    path = df[kind == "path_patch"].dropna(subset=["layer", "head"])
    metric = _metric(path) if len(path) else None
    if metric is not None:
        path = _knocked_out(df, _effects(df, path, metric), metric)
        site = path["site"].fillna("").map(lambda s: f" ({s})" if s else "")
        knocked = (path["group"] if "group" in path else pd.Series(pd.NA, index=path.index)).astype("string")
        knocked = knocked.fillna("").map(lambda g: f", {g}" if g else "")
        path = path.assign(group=path["receivers"].fillna("logits") + site + knocked)
        groups = ordered(path["group"], ("logits",))
        grids = {g: _grid(path[path["group"] == g], "effect", shape) for g in groups}
        grids = {g: m for g, m in grids.items() if np.isfinite(m).any()}
        if grids:
            fig, axes = _figure(1, len(grids), shape)
            for ax, (g, m) in zip(axes[0], grids.items()):
                _heatmap(ax, m, f"path patching, senders -> {g}:\nchange in {METRICS[metric]}", cbar=f"Δ {metric}")
            _save(fig, out, "ioi_path_patching.png", numbers)
            numbers["path_patching"] = {g: _top(m) for g, m in grids.items()}
        else:
            numbers["skipped"].append(f"path patching: no clean baseline for {metric}")

    scores = df[(kind == "none") & (df["method"] == "score") & df["metric"].isin(SCORES)]
    scores = scores.dropna(subset=["layer", "head"])
    if len(scores):
        names = [s for s in SCORES if (scores["metric"] == s).any()]
        ncols = min(4, len(names))
        fig, axes = _figure(math.ceil(len(names) / ncols), ncols, shape)
        numbers["head_scores"] = {}
        for ax, name in zip(axes.flat, names):
            m = _grid(scores[scores["metric"] == name], "value", shape)
            _heatmap(ax, m, name.replace("_", " "), effect=False, cbar="score")
            numbers["head_scores"][name] = _top(m, by_abs=False)
        for ax in axes.flat[len(names) :]:
            ax.axis("off")
        _save(fig, out, "ioi_head_scores.png", numbers)
        classes = ioi_classes.draw(df, out, shape, model)
        if classes:
            numbers["head_classes"] = classes
            numbers["figures"] += ["ioi_head_classes.png", *([classes["diagram"]] if "diagram" in classes else [])]

    edges = df[kind.isin(["edge", "circuit"])]
    if len(edges):
        numbers["circuit"] = circuit.draw(edges, out)
        numbers["figures"] += sorted(p.name for p in out.glob("*.png") if p.name not in numbers["figures"])
    numbers["headline"] = _headline(numbers)
    return numbers


# Wang et al.'s GPT-2 small numbers (Sec. 2-4: logit difference 3.56; the circuit's 3.09 is 87% of it) and
# MIB's for EAP-IG (inputs) on IOI in GPT-2 small (Mueller et al. 2025): the numbers a reader compares with
PAPER_GPT2_SMALL = {
    "clean_logit_diff": 3.56,
    "circuit_faithfulness": 0.87,
    "mib_eap_ig_cpr": 1.85,
    "mib_eap_ig_cmd": 0.03,
}


def _headline(numbers: dict) -> dict:
    """The numbers a reproduction is read by, beside the paper's GPT-2 small ones."""
    found = numbers.get("head_classes", {}).get("found", {})
    edges = numbers.get("circuit", {})
    return {
        "clean_logit_diff": numbers.get("clean", {}).get("logit_diff"),
        "classes": {cls: heads for cls, heads in found.items()},
        "class_procedure": numbers.get("head_classes", {}).get("procedure"),
        **{
            k: edges[k]
            for k in (
                "cpr_eap_ig",
                "cmd_eap_ig",
                "cpr_ci_eap_ig",
                "cmd_ci_eap_ig",
                "target_edges_eap_ig",
                "target_edges_ungrouped_eap_ig",
                *(f"{m}_eap_ig" for m in (*circuit.GRAPH, *circuit.CONVERGENCE)),
            )
            if k in edges
        },
        "paper_gpt2_small": {**PAPER_GPT2_SMALL, "classes": ioi_classes.PAPER},
    }


FIGURE_SET = draw
