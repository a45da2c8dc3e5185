"""study=audit's figures, from its table alone: audit_overlap.png (the Jaccard index of every pair of the
found circuit, its variants and its rivals), audit_faithfulness.png (each one's faithfulness on the
held-out prompts) and audit_tests.png (the hypothesis tests' p-values against the level)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd

from ..edges.hypothesis import ALPHA
from .canvas import pyplot, save

KIND_COLOURS = {"found": "black", "resample": "tab:blue", "seed": "tab:cyan", "templates": "tab:green",
                "method": "tab:orange", "steps": "tab:purple", "rival": "tab:red"}  # fmt: skip


def draw(table: pd.DataFrame, out: Path) -> dict:
    """The three figures per audited circuit (one set where the table holds one audit), and the numbers:
    per model, per circuit (`audited`), its size, faithfulness, stability, best rival and tests."""
    out = Path(out)
    numbers: dict = {}
    if "intervention" not in table or "audited" not in table:
        return numbers
    audits = table[["model", "task", "audited"]].drop_duplicates()
    for (model, task, audited), rows in table.groupby(["model", "task", "audited"], sort=False):
        suffix = "" if len(audits) == 1 else "_" + re.sub(r"[^A-Za-z0-9.]+", "_", f"{model}_{audited}")
        title = f"{model} on {task}, {audited}"
        overlap = rows[rows["intervention"] == "overlap"]
        if len(overlap):
            _overlap(overlap, title, out / f"audit_overlap{suffix}.png")
        audit = rows[rows["intervention"] == "audit"]
        faith = audit[audit["metric"] == "faithfulness"]
        if len(faith):
            _faithfulness(faith, title, out / f"audit_faithfulness{suffix}.png")
        tests = audit[audit["metric"].str.endswith("_p")]
        if len(tests):
            _tests(tests, title, out / f"audit_tests{suffix}.png")
        numbers.setdefault(str(model), {})[str(audited)] = summary_numbers(audit)
    return numbers


def finite(x: object) -> float | None:
    """A number for numbers.json: None where there is none (an interval over one variant)."""
    value = float(x)  # type: ignore[arg-type]
    return value if np.isfinite(value) else None


def summary_numbers(audit: pd.DataFrame) -> dict:
    """One audit's headline numbers, by the table's metric names."""

    def one(metric: str, variant: str | None = None) -> pd.Series | None:
        rows = audit[audit["metric"] == metric]
        rows = rows if variant is None else rows[rows["variant"] == variant]
        return rows.iloc[0] if len(rows) else None

    def value(metric: str, variant: str | None = None) -> float | None:
        r = one(metric, variant)
        return None if r is None else float(r["value"])

    found: dict = {
        "size": int(value("size") or 0),
        "units": int(value("units") or 0),
        "n_held_out": int(audit["n"].iloc[0]),
        "faithfulness": value("faithfulness", "found"),
    }
    for _, r in audit[audit["metric"].isin(["jaccard_mean", "jaccard_at_target_mean"])].iterrows():
        at = "_at_target" if r["metric"] == "jaccard_at_target_mean" else ""
        found[f"jaccard{at}_{r['kind']}"] = [finite(r["value"]), finite(r["ci_low"]), finite(r["ci_high"])]
    rivals = audit[(audit["metric"] == "faithfulness") & (audit["kind"] == "rival")]
    if len(rivals):
        best = rivals.loc[rivals["value"].idxmax()]
        found["best_rival_faithfulness"] = float(best["value"])
        # tables from before the rival search scored again hold no such column: their rivals were cut
        found["rival_scores"] = str(best["rival_scores"]) if "rival_scores" in rivals else "cut"
    margin = one("margin")
    if margin is not None:
        found["margin"] = [finite(margin["value"]), finite(margin["ci_low"]), finite(margin["ci_high"])]
        found["unique"] = bool(margin["ci_low"] > 0)
    for test in ("equivalence", "independence", "minimality"):
        r = one(f"{test}_p")
        if r is not None:
            found[test] = {"p_value": float(r["value"]), "rejected": bool(r["rejected"])}
    return found


def _overlap(rows: pd.DataFrame, title: str, path: Path) -> None:
    names = list(dict.fromkeys(rows["variant"]))
    matrix = rows.pivot_table(index="variant", columns="other", values="value").reindex(index=names, columns=names)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(1.0 + 0.42 * len(names), 0.8 + 0.4 * len(names)))
    image = ax.imshow(matrix.to_numpy(float), vmin=0, vmax=1, cmap="viridis")
    ax.set_xticks(range(len(names)), names, rotation=90, fontsize=7)
    ax.set_yticks(range(len(names)), names, fontsize=7)
    fig.colorbar(image, ax=ax, label="Jaccard index of the units")
    ax.set_title(f"{title}: overlap of circuits of one size", fontsize=9)
    save(fig, path)


def _faithfulness(rows: pd.DataFrame, title: str, path: Path) -> None:
    kinds = rows["kind"].fillna("found") if "kind" in rows else pd.Series("found", index=rows.index)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(4.0, 0.35 * len(rows) + 1.5), 3.2))
    x = np.arange(len(rows))
    bars = ax.bar(x, rows["value"].to_numpy(float), color=[KIND_COLOURS.get(k, "grey") for k in kinds])
    ax.bar_label(bars, fmt="%.2f", fontsize=6)
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_xticks(x, rows["variant"].tolist(), rotation=90, fontsize=7)
    ax.set_ylabel("faithfulness (held-out prompts)")
    ax.set_title(f"{title}: the found circuit, its variants and its disjoint rivals", fontsize=9)
    save(fig, path)


def _tests(rows: pd.DataFrame, title: str, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(4.5, 2.6))
    p = rows["value"].to_numpy(float).clip(1e-6, 1)
    names = [m[:-2] for m in rows["metric"]]
    ax.barh(names, p, color=["tab:red" if r else "tab:green" for r in rows["rejected"].fillna(False)])
    ax.axvline(ALPHA, color="black", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set_xlabel(f"p-value (red: rejected at {ALPHA})")
    ax.set_title(f"{title}: Shi et al.'s circuit hypothesis tests", fontsize=9)
    save(fig, path)


FIGURE_SET = draw
