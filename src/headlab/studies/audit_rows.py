"""study=audit's tidy rows and its terminal summary (the run itself: studies/audit.py)."""

from __future__ import annotations

import numpy as np
import pandas as pd
from torch import Tensor

from ..edges.audit import Rival, Units, Variant, interval, jaccard, margin
from ..edges.faithfulness import Evaluator
from ..edges.hypothesis import Minimality, Outcome
from .summary import console


def variant_rows(info: dict, variants: list[Variant]) -> list[dict]:
    rows = []
    for v in variants:
        base = {**info, "variant": v.name, "kind": v.kind}
        rows += [
            {**base, "metric": "jaccard", "value": v.jaccard},
            {**base, "metric": "jaccard_heads", "value": v.jaccard_heads},
            {**base, "metric": "faithfulness", "value": v.faithfulness},
        ]
        if v.at_target is not None:
            rows += [
                {**base, "metric": "size_at_target", "value": int(v.at_target.sum())},
                {**base, "metric": "jaccard_at_target", "value": v.jaccard_at_target},
                {**base, "metric": "faithfulness_at_target", "value": v.faithfulness_at_target},
            ]
    for kind in dict.fromkeys(v.kind for v in variants):
        of_kind = [v for v in variants if v.kind == kind]
        for metric, values in (
            ("jaccard_mean", [v.jaccard for v in of_kind]),
            ("jaccard_at_target_mean", [v.jaccard_at_target for v in of_kind if v.at_target is not None]),
        ):
            if values:
                low, high = interval(values)
                row = {"kind": kind, "metric": metric, "value": float(np.mean(values)), "ci_low": low, "ci_high": high}
                rows.append({**info, **row})
    return rows


def rival_rows(
    info: dict, rivals: list[Rival], found_metric: np.ndarray, ev: Evaluator, n_boot: int, seed: int
) -> list[dict]:
    rows = []
    for r in rivals:
        base = {**info, "variant": f"rival_{r.round}", "kind": "rival", "rival_scores": r.scores}
        rows += [
            {**base, "metric": "faithfulness", "value": r.faithfulness},
            {**base, "metric": "shared_units", "value": r.shared_units},
            {**base, "metric": "jaccard_heads", "value": r.jaccard_heads},
            {**base, "metric": "rival_size", "value": int(r.chosen.sum())},
        ]
    if rivals:
        best = max(rivals, key=lambda r: r.faithfulness)
        value, low, high = margin(found_metric, best.per_prompt, ev, n_boot, seed)
        base = {**info, "variant": f"rival_{best.round}", "kind": "rival", "rival_scores": best.scores}
        rows.append({**base, "metric": "margin", "value": value, "ci_low": low, "ci_high": high})
    return rows


def unique(rows: list[dict]) -> bool:
    """Is the found circuit more faithful than its best disjoint rival (the margin's interval above 0)?"""
    margins = [r for r in rows if r.get("metric") == "margin"]
    if not margins:
        return True  # no rival of that size exists
    (row,) = margins
    return bool(row["ci_low"] > 0) if np.isfinite(row["ci_low"]) else bool(row["value"] > 0)


def test_rows(info: dict, tests: list[Outcome], mini: Minimality, units: Units, tested: list[int]) -> list[dict]:
    rows = [
        {**info, "metric": f"{t.test}_p", "value": t.p_value, "statistic": t.statistic, "rejected": t.rejected}
        for t in tests
    ]
    base = {**info, "intervention": "minimality", "metric": "knockout_effect"}
    rows += [
        {**base, "unit": units.names[u], "value": e, "p_value": p}
        for u, e, p in zip(tested, mini.effects.tolist(), mini.p_values.tolist())
    ]
    return rows


def keep_share_rows(info: dict, units: Units, found: Tensor, shares: Tensor) -> list[dict]:
    """Each unit of the found circuit or of a resampled or redrawn one: the share of those that keep it."""
    base = {**info, "intervention": "keep_share", "metric": "keep_share"}
    kept = (shares > 0) | found
    return [
        {**base, "unit": units.names[u], "value": float(shares[u]), "in_circuit": bool(found[u])}
        for u in kept.nonzero().flatten().tolist()
    ]


def overlap_rows(info: dict, named: list[tuple[str, Tensor]]) -> list[dict]:
    """Pairwise Jaccard of the named circuits' units (the report's matrix)."""
    base = {**info, "intervention": "overlap", "metric": "jaccard"}
    return [{**base, "variant": a, "other": b, "value": jaccard(x, y)} for a, x in named for b, y in named]


def bracket(row: pd.Series) -> str:
    return f"[{row['ci_low']:.3f}, {row['ci_high']:.3f}]"


def summary(df: pd.DataFrame, max_rows: int) -> None:
    for audited, rows in df.groupby("audited", sort=False) if "audited" in df else [("", df)]:
        audit = rows[rows["intervention"] == "audit"]
        values = dict(zip(audit["metric"], audit["value"]))
        found = audit[(audit["metric"] == "faithfulness") & (audit["variant"] == "found")]["value"].iloc[0]
        lines = [
            f"{rows['model'].iloc[0]} on {rows['task'].iloc[0]}, {audited}: {int(values['size'])} of "
            f"{int(values['units'])} units, faithfulness {found:.3f} on {int(rows['n'].iloc[0])} held-out prompts"
        ]
        for _, r in audit[audit["metric"].isin(["jaccard_mean", "jaccard_at_target_mean"])].iterrows():
            at = " (circuits at the target)" if r["metric"] == "jaccard_at_target_mean" else ""
            lines.append(
                f"  overlap over {r['kind']}{at}: Jaccard {r['value']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}]"
            )
        for _, m in audit[audit["metric"] == "margin"].iterrows():
            lines.append(f"  best disjoint rival ({m['variant']}): margin {m['value']:.3f} {bracket(m)}")
        for _, r in audit[audit["metric"].str.endswith("_p")].iterrows():
            lines.append(
                f"  {r['metric'][:-2]}: p = {r['value']:.3g} ({'rejected' if r['rejected'] else 'not rejected'})"
            )
        for line in lines:
            console.print(line, highlight=False, markup=False)
