"""Per-head scores of the `scores=<kind>` studies, from the tidy table alone:

  score_<metric>.png        layer x head heatmap of each per-head score (method "score": sink rate,
                            first-token attention, ...), mean over seeds
  composition_<metric>.png  writer head x reader head matrix of each composition score (rows that name
                            a writer_layer / writer_head), reader heads in later layers only
  retrieval_masking.png     needle recall clean, with the top-k retrieval heads masked and with each
                            draw of as many random heads masked (rows intervention "mask_heads"), with
                            95% intervals
Numbers: per score the top head and its value, per composition mode the top pair, for the retrieval
score the share of heads above 0.1 (Wu et al.'s retrieval heads), and the needle recall clean / top-k
masked / random heads masked (mean of the draws). A table of several models (a reproduction's runs) gets
its figures and numbers per model, in a folder and under a key of each model's name.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from ..tables import head_name
from .canvas import pyplot, save
from .heads import FILE_UNSAFE

PAIR = ("writer_layer", "writer_head")


def _score_rows(table: pd.DataFrame) -> pd.DataFrame:
    rows = table[(table["method"] == "score") & table["layer"].notna() & table["head"].notna()]
    if "prompt_id" in rows:
        rows = rows[rows["prompt_id"].isna()]
    return rows


RETRIEVAL_HEAD = 0.1  # Wu et al.: a head whose retrieval score exceeds this is a retrieval head


def draw(table: pd.DataFrame, out: Path) -> dict:
    models: list = list(table["model"].dropna().unique()) if "model" in table else []
    if len(models) < 2:
        return _draw_one(table, Path(out))
    return {str(m): _draw_one(table[table["model"] == m], Path(out) / FILE_UNSAFE.sub("_", str(m))) for m in models}


def _draw_one(table: pd.DataFrame, out: Path) -> dict:
    numbers: dict = {}
    rows = _score_rows(table)
    paired = rows[PAIR[0]].notna() if PAIR[0] in rows else pd.Series(False, index=rows.index)
    if "channel" in rows:
        paired &= rows["channel"].isna()
    out = Path(out)
    for metric, cells in rows[~paired].groupby("metric", sort=False):
        if "channel" in cells and cells["channel"].notna().any():
            continue
        mean = cells.groupby(["layer", "head"])["value"].mean()
        top = mean.idxmax()
        numbers[f"top_head_{metric}"] = head_name(*top)
        numbers[f"top_value_{metric}"] = float(mean.max())
        if metric == "retrieval_score":
            numbers["share_above_0.1_retrieval_score"] = float((mean > RETRIEVAL_HEAD).mean())
            numbers["heads_above_0.1_retrieval_score"] = int((mean > RETRIEVAL_HEAD).sum())
            numbers["n_heads"] = len(mean)
        _heatmap(mean, str(metric), out / f"score_{FILE_UNSAFE.sub('_', str(metric))}.png")
    for metric, cells in rows[paired].groupby("metric", sort=False):
        mean = cells.groupby([*PAIR, "layer", "head"])["value"].mean()
        top = mean.idxmax()
        numbers[f"top_pair_{metric}"] = f"{head_name(top[0], top[1])}->{head_name(top[2], top[3])}"
        numbers[f"top_value_{metric}"] = float(mean.max())
        _pair_matrix(mean, str(metric), out / f"composition_{FILE_UNSAFE.sub('_', str(metric))}.png")
    numbers.update(_masking(table, out / "retrieval_masking.png"))
    return numbers


def _masking(table: pd.DataFrame, path: Path) -> dict:
    """The recall bars of a retrieval study's masking rows; nothing where the table has none."""
    recall = table[(table["metric"] == "needle_recall") & table["intervention"].isin(["none", "mask_heads"])]
    if "prompt_id" in recall:
        recall = recall[recall["prompt_id"].isna()]
    if not (recall["intervention"] == "mask_heads").any():
        return {}
    group = recall["group"].fillna("clean") if "group" in recall else pd.Series("clean", index=recall.index)
    bars = recall.assign(group=group).groupby("group", sort=False)[["value", "ci_low", "ci_high"]].mean()
    random = bars[bars.index.str.startswith("random")]
    top = bars[bars.index.str.startswith("top")]
    numbers = {"recall_clean": float(bars.loc["clean", "value"]) if "clean" in bars.index else None}
    numbers["recall_top_masked"] = float(top["value"].iloc[0]) if len(top) else None
    numbers["recall_random_masked_mean"] = float(random["value"].mean()) if len(random) else None
    numbers["random_draws"] = len(random)
    k = top.index[0][len("top") :] if len(top) else ""
    numbers["heads_masked"] = int(k) if k.isdigit() else None  # the group "top{k}": k heads masked together
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(3.5, 0.5 * len(bars) + 1.5), 3.0))
    colours = ["grey" if g == "clean" else "tab:red" if g.startswith("top") else "tab:blue" for g in bars.index]
    errors = np.vstack([bars["value"] - bars["ci_low"], bars["ci_high"] - bars["value"]]).clip(min=0)
    ax.bar(range(len(bars)), bars["value"], yerr=errors, color=colours, capsize=2)
    ax.set_xticks(range(len(bars)), bars.index, rotation=45, ha="right", fontsize=7)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("needle recall")
    ax.set_title("needle recall with heads masked", fontsize=9)
    save(fig, path, dpi=100)
    return numbers


def _heatmap(mean: pd.Series, metric: str, path: Path) -> None:
    plt = pyplot()
    layers, heads = int(mean.index.get_level_values(0).max()) + 1, int(mean.index.get_level_values(1).max()) + 1
    m = mean.unstack("head").reindex(index=range(layers), columns=range(heads)).to_numpy(float)
    fig, ax = plt.subplots(figsize=(max(3.5, 0.35 * heads + 1.8), max(2.0, 0.3 * layers + 1.2)))
    im = ax.imshow(m, cmap="viridis", aspect="auto")
    if m.size <= 100:
        for (i, j), v in np.ndenumerate(m):
            if np.isfinite(v):
                ax.text(
                    j, i, f"{v:.2g}", ha="center", va="center", fontsize=7, color="w" if v < np.nanmax(m) / 2 else "k"
                )
    ax.set_xticks(range(heads))
    ax.set_yticks(range(layers))
    ax.tick_params(labelsize=7)
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(f"{metric} per head", fontsize=9)
    fig.colorbar(im, ax=ax)
    save(fig, path, dpi=100)


def _pair_matrix(mean: pd.Series, metric: str, path: Path) -> None:
    plt = pyplot()
    frame = mean.rename("value").reset_index()
    writers = sorted({(int(l), int(h)) for l, h in zip(frame[PAIR[0]], frame[PAIR[1]])})
    readers = sorted({(int(l), int(h)) for l, h in zip(frame["layer"], frame["head"])})
    m = np.full((len(writers), len(readers)), np.nan)
    w_index = {w: i for i, w in enumerate(writers)}
    r_index = {r: j for j, r in enumerate(readers)}
    for row in frame.itertuples(index=False):
        m[w_index[(int(row[0]), int(row[1]))], r_index[(int(row[2]), int(row[3]))]] = row[4]
    size = max(3.5, 0.22 * len(readers) + 2)
    fig, ax = plt.subplots(figsize=(size, max(3.0, 0.22 * len(writers) + 1.5)))
    im = ax.imshow(m, cmap="magma", aspect="auto")
    step_r, step_w = max(1, len(readers) // 24), max(1, len(writers) // 24)
    ax.set_xticks(range(0, len(readers), step_r), [head_name(*r) for r in readers[::step_r]], rotation=90, fontsize=6)
    ax.set_yticks(range(0, len(writers), step_w), [head_name(*w) for w in writers[::step_w]], fontsize=6)
    ax.set_xlabel("reader head")
    ax.set_ylabel("writer head")
    ax.set_title(f"{metric}: writer -> reader", fontsize=9)
    fig.colorbar(im, ax=ax)
    save(fig, path, dpi=100)


FIGURE_SET = draw
