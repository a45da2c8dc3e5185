"""What the studies' summaries share: the console they print on and the per-head table most of them show."""

from __future__ import annotations

import sys

import pandas as pd
from rich.console import Console
from rich.table import Table

# rich finds sys.stdout when it prints, so a caller's redirect is honoured
console = Console(width=None if sys.stdout.isatty() else 120)


def aggregated(df: pd.DataFrame) -> pd.DataFrame:
    """The aggregate rows: per-prompt rows (output.per_prompt) are for files, not for eyes."""
    return df[df["n"] > 1] if "prompt_id" in df else df


def head_table(df: pd.DataFrame, max_rows: int) -> None:
    """One row per intervention (clean first), one column per metric; past max_rows, the interventions
    that change the first metric most."""
    agg = aggregated(df)
    if agg.empty:
        return
    keys = ["intervention", "method", "layer", "head"]
    if "token" in agg and agg["token"].notna().any():  # rows told apart by the role they act at
        keys.append("token")
    wide = agg.pivot_table(index=keys, columns="metric", values="value", dropna=False, sort=False)
    wide = wide.dropna(how="all").reset_index()
    metrics = [m for m in agg["metric"].unique()]
    clean = wide[wide["intervention"] == "none"]
    rest = wide[wide["intervention"] != "none"]
    if len(rest) > max_rows and len(clean):
        key = metrics[0]
        rest = rest.assign(_drop=(clean[key].iloc[0] - rest[key]).abs()).nlargest(max_rows, "_drop")
    shown = pd.concat([clean, rest])
    title = f"{agg['model'].iloc[0]} on {agg['task'].iloc[0]} ({int(agg['n'].iloc[0])} prompts)"
    if len(wide) - len(clean) > len(rest):
        title += f": {len(rest)} of {len(wide) - len(clean)} interventions, largest change in {metrics[0]}"
    table = Table(title=title)
    for col in keys + metrics:
        table.add_column(col, justify="right" if col not in ("intervention", "method") else "left")
    fmt = lambda v: "" if pd.isna(v) else (f"{v:.3f}" if isinstance(v, float) else str(v))  # noqa: E731
    for _, r in shown.iterrows():
        table.add_row(*[fmt(r[c]) for c in keys + metrics])
    console.print(table)
