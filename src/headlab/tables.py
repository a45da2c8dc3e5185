"""Head effects from the tidy table: the helpers that the figures, the HTML report and the reuse and score
studies share, so that none of them reads another's module.

Head rows have layer and head set and no prompt_id, other_head, edge or feature (per-prompt rows, head
swaps, edges and SAE features are not one head's effect). `effects` turns them into one row per head and
panel (its value less the clean value, mean over seeds); `panels` and `grid` lay those out as layer x
head matrices.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np
import pandas as pd

SECTION = ("experiment", "model", "task")  # one model on one task: heads comparable across seeds
# after intervention and method, the columns that tell panels apart, each shown as its word and value
PANEL = (("site", "site "), ("position", "pos "), ("token", "at "), ("receivers", "to "), ("group", ""))
NOT_ONE_HEAD = ("prompt_id", "other_head", "edge", "feature")


def head_rows(table: pd.DataFrame) -> pd.DataFrame:
    """Rows of one head's intervention: layer and head set, not the clean run, nothing of NOT_ONE_HEAD."""
    keep = table["layer"].notna() & table["head"].notna() & (table["intervention"] != "none").fillna(False)
    for col in NOT_ONE_HEAD:
        if col in table:
            keep &= table[col].isna()
    return table[keep]


def panel_label(rows: pd.DataFrame) -> pd.Series:
    """'ablate_head zero', 'patch_head activation, site q, at END', 'path_patch path, to logits', ..."""
    label = rows["intervention"].astype(str) + " " + rows["method"].astype("string").fillna("")
    for col, word in PANEL:
        if col in rows:
            part = rows[col].astype("string")
            label = label + (", " + word + part).fillna("")
    return label.str.strip()


def effects(table: pd.DataFrame, by: Sequence[str] = ()) -> pd.DataFrame:
    """One row per head and (experiment, model, task, *by, panel, metric), in the table's order:

    effect             mean over seeds of value - clean (clean: the same run's and seed's "none" row)
    ci_low, ci_high    mean over seeds of the bootstrap interval over prompts, less clean
    seed_low/high      the smallest and largest effect of one seed; n_seeds: seeds with an effect
    value, clean       mean over seeds of the head's value and of the clean value
    Seeds of one section and panel are averaged; `by` names further columns that keep runs apart."""
    section = [c for c in (*SECTION, *by) if c in table]
    df = table[table["prompt_id"].isna()] if "prompt_id" in table else table
    run = section + [c for c in ("run_dir",) if c in df] + ["seed", "metric"]
    baseline = df[(df["intervention"] == "none").fillna(False) & df["layer"].isna() & df["head"].isna()]
    clean = baseline.groupby(run, dropna=False, sort=False)["value"].mean().rename("clean").reset_index()
    rows = head_rows(df).merge(clean, on=run, how="left")
    rows = rows.assign(
        panel=panel_label(rows),
        effect=rows["value"] - rows["clean"],
        low=rows["ci_low"] - rows["clean"],
        high=rows["ci_high"] - rows["clean"],
    )
    cell = [*section, "panel", "metric", "layer", "head"]
    measured = ["effect", "low", "high", "value", "clean"]
    per_seed = rows.groupby([*cell, "seed"], dropna=False, sort=False)[measured].mean()
    out = per_seed.groupby(level=cell, dropna=False, sort=False).agg(
        effect=("effect", "mean"),
        ci_low=("low", "mean"),
        ci_high=("high", "mean"),
        seed_low=("effect", "min"),
        seed_high=("effect", "max"),
        n_seeds=("effect", "count"),
        value=("value", "mean"),
        clean=("clean", "mean"),
    )
    out = out.reset_index()
    return out[out["n_seeds"] > 0].astype({"layer": int, "head": int}).reset_index(drop=True)


def shape(cells: pd.DataFrame) -> tuple[int, int]:
    """(layers, heads) that the cells span, counting from layer 0 and head 0."""
    return int(cells["layer"].max()) + 1, int(cells["head"].max()) + 1


def grid(cells: pd.DataFrame, column: str = "effect", size: tuple[int, int] | None = None) -> pd.DataFrame:
    """Layer x head matrix of one panel's cells (rows of `effects`); NaN where a head has no value."""
    layers, heads = size or shape(cells)
    m = cells.pivot_table(index="layer", columns="head", values=column, aggfunc="mean")
    return m.reindex(index=range(layers), columns=range(heads))


def score_grids(table: pd.DataFrame, size: tuple[int, int]) -> dict[str, np.ndarray]:
    """score name -> [layer, head] mean over seeds, from the head scores' rows (method "score")."""
    rows = table[table["method"] == "score"].dropna(subset=["layer", "head"])
    if "prompt_id" in rows:
        rows = rows[rows["prompt_id"].isna()]
    grids = {}
    for name, part in rows.groupby("metric"):
        m = np.full(size, np.nan)
        for (layer, head), v in part.groupby(["layer", "head"])["value"].mean().items():
            m[int(layer), int(head)] = v
        grids[str(name)] = m
    return grids


def head_name(layer: int, head: int) -> str:
    return f"L{int(layer)}H{int(head)}"


HEAD_NAME = re.compile(r"L(\d+)H(\d+)")


def head_of(name: str) -> tuple[int, int]:
    """(layer, head) of a name as head_name spells it ("L5H1")."""
    found = HEAD_NAME.fullmatch(name)
    if found is None:
        raise ValueError(f"not a head name: {name!r}")
    return int(found[1]), int(found[2])


def strongest(cells: pd.DataFrame, k: int) -> pd.DataFrame:
    """The k cells of largest |effect|, strongest first."""
    return cells.loc[cells["effect"].abs().sort_values(ascending=False, kind="stable").index[:k]]


def section_columns(cells: pd.DataFrame) -> list[str]:
    """The columns of `effects` rows that name a section: experiment, model, task and the `by` columns."""
    return list(cells.columns[: cells.columns.get_loc("panel")])


def panels(cells: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """(title, cells) per section and panel of `effects` rows, in order; titles name the section where
    the rows hold several."""
    keys = section_columns(cells)
    several = len(cells[keys].drop_duplicates()) > 1 if keys else False
    out = []
    for key, rows in cells.groupby([*keys, "panel"], dropna=False, sort=False):
        *section, panel = key
        out.append(((" / ".join(map(str, section)) + "\n" if several else "") + str(panel), rows))
    return out
