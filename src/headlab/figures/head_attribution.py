"""head_attribution: the numbers of `headlab reproduce head_attribution` (no picture: the split is a table).

Per model, head and edge: the score and the attention, each side's largest components (their side totals
of the score with 95% intervals over the prompts) and the worst sum error. Per model: how far the norms move
when one of a side's largest components is removed with them free (the input norm's and QK-norm's scale
changes, median and largest of |edited / clean - 1|) and how far the score's change then is from the held
one (median and largest of |free - held| / |held|).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

TOP = 4  # components per side


def draw(table: pd.DataFrame, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    return {"cases": cases(table), "free_norms": free_norms(table)}


def cases(table: pd.DataFrame) -> list[dict]:
    qk = table[table["method"] == "qk_attribution"]
    found = []
    for (model, layer, head, edge), rows in qk.groupby(["model", "layer", "head", "edge"], sort=False):
        score = rows[rows["metric"] == "qk_score"].iloc[0]
        case = {
            "model": model,
            "head": f"L{int(layer)}H{int(head)}",
            "edge": edge,
            "n": int(score["n"]),
            "score": round(float(score["value"]), 4),
            "attention": round(float(rows.loc[rows["metric"] == "attention", "value"].iloc[0]), 4),
        }
        for side in ("query", "key"):
            totals = rows[rows["metric"] == f"qk_{side}_total"].sort_values("rank").head(TOP)
            case[side] = [
                [r[f"{side}_component"], *(round(float(r[c]), 4) for c in ("value", "ci_low", "ci_high"))]
                for _, r in totals.iterrows()
            ]
        found.append(case)
    return found


def free_norms(table: pd.DataFrame) -> dict[str, dict]:
    out: dict[str, dict] = {}
    keys = ["layer", "head", "edge", "query_component", "key_component"]
    for model, rows in table.groupby("model", sort=False):
        removal = rows[rows["metric"] == "qk_removal"].fillna({"query_component": "", "key_component": ""})
        if removal.empty:
            continue
        held = removal[removal["method"] == "held"].set_index(keys)["value"]
        free = removal[removal["method"] == "free"].set_index(keys)["value"]
        apart = ((free - held).abs() / held.abs().clip(lower=1e-30)).dropna().to_numpy()
        entry = {"removals": int(len(apart)), **_spread("score_change_vs_held", apart)}
        for metric in ("norm_scale_change", "qk_norm_scale_change"):
            moved = rows.loc[rows["metric"] == metric, "value"].abs().to_numpy()
            entry.update(_spread(metric, moved))
        out[str(model)] = entry
    return out


def _spread(name: str, values: np.ndarray) -> dict:
    if not len(values):
        return {}
    return {f"{name}_median": round(float(np.median(values)), 4), f"{name}_max": round(float(values.max()), 4)}


FIGURE_SET = draw
