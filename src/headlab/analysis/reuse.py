"""Circuit reuse (Merullo et al. 2024, "Circuit Component Reuse Across Tasks in Transformer Language
Models"): do two tasks rely on the same heads?

Each side is a finished table: a head sweep (a head's importance is |effect|, its value less the clean
value, mean over seeds; its top k heads are the important ones) or a circuit (the heads that send or
receive an edge in the circuit; with two circuits, the shared edges as well). The two sides must come from
models of the same shape. Chance is the hypergeometric: two random sets of k_a and k_b heads out of N
share k_a k_b / N heads on average; `p_value` is P(shared >= observed) under it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import stats

from ..errors import UsageError
from ..results import conform
from ..tables import effects, panels

SIDES = ("a", "b")
HEAD_NODE = re.compile(r"a(\d+)\.h(\d+)")


@dataclass(frozen=True)
class Side:
    """One task's heads: their importance (NaN for a circuit) and which of them are important."""

    model: str
    task: str
    what: str  # "<panel>, <metric>" of a sweep, or "circuit"
    heads: pd.DataFrame  # layer, head, effect, importance, important
    size: tuple[int, int]  # layers, heads of the model
    edges: frozenset[str] = frozenset()  # a circuit's edges

    @property
    def label(self) -> str:
        return f"{self.model} / {self.task}: {self.what}"


def side_of(table: pd.DataFrame, k: int, metric: str | None = None, panel: str | None = None) -> Side:
    """The heads of a sweep table (top k by |effect| of `metric` in `panel`) or of a circuit table."""
    if "in_circuit" in table and table["in_circuit"].notna().any():
        return _circuit_side(table)
    cells = effects(table)
    if cells.empty:
        raise UsageError("reuse: the table has no head rows (a head sweep) and no circuit edges")
    metric = metric or _only(cells["metric"], "metric", "--metric")
    if metric not in set(cells["metric"]):
        known = ", ".join(dict.fromkeys(cells["metric"].astype(str)))
        raise UsageError(f"reuse: no head rows of metric '{metric}'; metrics: {known}"[:190])
    cells = cells[cells["metric"] == metric]
    titles = dict(panels(cells))
    panel = panel or _only(pd.Series(list(titles)), "panel", "--panel")
    if panel not in titles:
        raise UsageError(f"reuse: no panel '{panel}'; panels: {', '.join(titles)}")
    rows = titles[panel]
    heads = rows[["layer", "head", "effect"]].reset_index(drop=True).assign(importance=lambda d: d["effect"].abs())
    top = heads["importance"].rank(ascending=False, method="first") <= k
    size = (int(cells["layer"].max()) + 1, int(cells["head"].max()) + 1)
    first = rows.iloc[0]
    return Side(str(first["model"]), str(first["task"]), f"{panel}, {metric}", heads.assign(important=top), size)


def _only(values: pd.Series, what: str, flag: str) -> str:
    choices = list(dict.fromkeys(values.astype(str)))
    if len(choices) != 1:
        raise UsageError(f"reuse: the table has several {what}s; choose one with {flag}: {', '.join(choices)[:120]}")
    return choices[0]


def _circuit_side(table: pd.DataFrame) -> Side:
    edge_rows = table[table["edge"].notna()]
    chosen = edge_rows["in_circuit"].astype("boolean").fillna(False).astype(bool)
    every, edges = _heads_of(edge_rows["edge"]), frozenset(edge_rows.loc[chosen, "edge"].astype(str))
    if not every:
        raise UsageError("reuse: the circuit table names no head nodes (a{layer}.h{head})")
    size = (max(l for l, _ in every) + 1, max(h for _, h in every) + 1)
    heads = sorted(_heads_of(pd.Series(sorted(edges))))
    frame = pd.DataFrame(heads, columns=["layer", "head"], dtype=int)
    frame = frame.assign(effect=np.nan, importance=np.nan, important=True)
    first = table.iloc[0]
    return Side(str(first["model"]), str(first["task"]), "circuit", frame, size, edges)


def _heads_of(edges: pd.Series) -> set[tuple[int, int]]:
    """(layer, head) of every head node that sends or receives one of the edges ("a1.h2->a3.h0<q>")."""
    nodes = {n for e in edges.astype(str) for n in re.split(r"->|<\w+>", e) if n}
    return {(int(m[1]), int(m[2])) for m in map(HEAD_NODE.fullmatch, nodes) if m}


def compare(a: Side, b: Side) -> tuple[pd.DataFrame, dict[str, float]]:
    """Per head: each side's effect and whether it is important; and the overlap's numbers."""
    if a.size != b.size:
        raise UsageError(f"reuse: the models differ in shape (layers x heads {a.size} vs {b.size})")
    n_heads_total = a.size[0] * a.size[1]
    per_head = a.heads.merge(b.heads, on=["layer", "head"], how="outer", suffixes=("_a", "_b"))
    for side in SIDES:
        per_head[f"important_{side}"] = per_head[f"important_{side}"].astype("boolean").fillna(False).astype(bool)
    k_a, k_b = int(per_head["important_a"].sum()), int(per_head["important_b"].sum())
    shared = int((per_head["important_a"] & per_head["important_b"]).sum())
    union = int((per_head["important_a"] | per_head["important_b"]).sum())
    numbers: dict[str, float] = {
        "n_heads": n_heads_total,
        "k_a": k_a,
        "k_b": k_b,
        "shared_heads": shared,
        "jaccard": shared / union if union else float("nan"),
        "expected_shared_by_chance": k_a * k_b / n_heads_total,
        "p_value": float(stats.hypergeom.sf(shared - 1, n_heads_total, k_a, k_b)),
    }
    both = per_head[["importance_a", "importance_b"]].dropna()
    if len(both) > 2:
        numbers["spearman_importance"] = float(stats.spearmanr(both["importance_a"], both["importance_b"]).statistic)
        effect = per_head.loc[both.index]
        numbers["pearson_effect"] = float(np.corrcoef(effect["effect_a"], effect["effect_b"])[0, 1])
    if a.edges and b.edges:
        numbers["shared_edges"] = len(a.edges & b.edges)
        numbers["edge_jaccard"] = len(a.edges & b.edges) / len(a.edges | b.edges)
    return per_head.sort_values(["layer", "head"]).reset_index(drop=True), numbers


def reuse_table(a: Side, b: Side) -> pd.DataFrame:
    """The tidy table of a comparison: per side and head its effect (method "effect"; `important`,
    `side` and `label` columns), then one row per number of the overlap (intervention "reuse")."""
    per_head, numbers = compare(a, b)
    frames = []
    for name, side in zip(SIDES, (a, b)):
        heads = per_head[per_head["layer"].notna()]
        frames.append(
            pd.DataFrame(
                {
                    "experiment": "reuse",
                    "model": side.model,
                    "task": side.task,
                    "seed": 0,  # reuse draws nothing; a side's effects are means over its seeds
                    "intervention": "none",
                    "method": "effect",
                    "layer": heads["layer"].astype(int),
                    "head": heads["head"].astype(int),
                    "metric": side.what,
                    "value": heads[f"effect_{name}"],
                    "n": 1,
                    "side": name,
                    "label": side.label,
                    "important": heads[f"important_{name}"],
                }
            )
        )
    summary = pd.DataFrame(
        {
            "experiment": "reuse",
            "model": f"{a.model} | {b.model}",
            "task": f"{a.task} | {b.task}",
            "seed": 0,
            "intervention": "reuse",
            "method": "overlap",
            "metric": list(numbers),
            "value": [float(v) for v in numbers.values()],
            "n": a.size[0] * a.size[1],
            "label": f"{a.label} | {b.label}",
        }
    )
    return conform(pd.concat([*frames, summary], ignore_index=True))
