"""The atlas's head classes: a label is given only where the head's score passes the class's stated rule.

Each rule reads one atlas score of one head; each score's rules sit in its record (atlas_probes.py). Where
the rule says "interval", the whole 95% bootstrap interval must pass, not only the mean, so a head is
labelled only where its prompts agree. Where the literature states a threshold the rule uses it and names
the paper; where it ranks heads without a cut, the threshold is headlab's and the source says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd


@dataclass(frozen=True)
class Rule:
    label: str
    code: str  # the label's short code on the atlas grid
    metric: str
    op: str  # ">" or "<"
    threshold: float
    on: str  # "value" (the mean) or "interval" (the whole 95% interval, ci_low or ci_high)
    relative: bool  # threshold times the clean value of the probe (ablation effects)
    source: str

    def text(self, clean: float | None = None) -> str:
        where = "its whole 95% interval" if self.on == "interval" else "its value"
        bound = f"{self.threshold:g}"
        if self.relative:
            bound = f"{self.threshold:g} x the clean value"
            if clean is not None:
                bound += f" ({clean:.3g}): {self.threshold * clean:.3g}"
        return f"{self.metric}: {where} {self.op} {bound} ({self.source})"

    def passes(self, row: pd.Series) -> bool:
        limit = self.threshold
        if self.relative:
            clean = float(row.get("clean", float("nan")))
            if not clean > 0:
                return False  # a share of a clean value the model does not reach (IOI: logit difference <= 0)
            limit = self.threshold * clean
        if self.on == "interval":
            edge = row["ci_low"] if self.op == ">" else row["ci_high"]
            if pd.isna(edge):
                return False
        else:
            edge = row["value"]
        return bool(edge > limit) if self.op == ">" else bool(edge < limit)


OURS = "headlab's threshold: the paper ranks heads by this score and states no cut"


def labelled(rows: pd.DataFrame, rules: Sequence[Rule]) -> pd.DataFrame:
    """The atlas rows with `label` (the class whose rule the row's score passes, else empty) and
    `rule` (that rule, in words, with the clean value where the threshold is relative to it)."""
    rows = rows.reset_index(drop=True)  # one row per index label, whatever the frames it was built from
    rows["label"], rows["rule"] = "", ""
    for rule in rules:
        mine = rows["metric"] == rule.metric
        for i in rows.index[mine]:
            row = rows.loc[i]
            if rule.passes(row):
                clean = row.get("clean")
                said = rule.text(None if clean is None or pd.isna(clean) else float(clean))
                rows.loc[i, "label"] = ", ".join(x for x in (rows.loc[i, "label"], rule.label) if x)
                rows.loc[i, "rule"] = "; ".join(x for x in (rows.loc[i, "rule"], said) if x)
    return rows


def rule_texts(rules: Sequence[Rule]) -> dict[str, str]:
    """label -> its rule in words (relative thresholds without their clean value)."""
    return {rule.label: rule.text() for rule in rules}
