"""What the studies' summaries share: the console they print on and the per-head table most of them show."""

from __future__ import annotations

import sys

import pandas as pd
from rich.console import Console
from rich.table import Table

# rich finds sys.stdout when it prints, so a caller's redirect is honoured; off a terminal, 100 columns
console = Console(width=None if sys.stdout.isatty() else 100)


def aggregated(df: pd.DataFrame) -> pd.DataFrame:
    """The aggregate rows: per-prompt rows (output.per_prompt) are for files, not for eyes."""
    return df[df["n"] > 1] if "prompt_id" in df else df


def head_table(df: pd.DataFrame, max_rows: int) -> None:
    """One row per intervention (clean first), one column per metric; past max_rows, the interventions
    that change the first metric most. A table of scores alone (every row a head's score, no intervention)
    shows the max_rows heads of the largest first metric. Column names fold onto more lines, never cut."""
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
    title = f"{agg['model'].iloc[0]} on {agg['task'].iloc[0]} ({int(agg['n'].iloc[0])} prompts)"
    if rest.empty and len(clean) > max_rows:  # scores per head: the heads that score highest
        title += f": the {max_rows} of {len(clean)} heads with the largest {metrics[0]}"
        clean = clean.nlargest(max_rows, metrics[0])
    elif len(rest) > max_rows and len(clean):
        key = metrics[0]
        title += f": {max_rows} of {len(rest)} interventions, largest change in {key}"
        rest = rest.assign(_drop=(clean[key].iloc[0] - rest[key]).abs()).nlargest(max_rows, "_drop")
    shown = pd.concat([clean, rest])
    table = Table(title=title)
    for col in keys + metrics:
        table.add_column(col, justify="left" if col in ("intervention", "method") else "right", overflow="fold")
    fmt = lambda v: "" if pd.isna(v) else (f"{v:.3f}" if isinstance(v, float) else str(v))  # noqa: E731
    for _, r in shown.iterrows():
        table.add_row(*[fmt(r[c]) for c in keys + metrics])
    console.print(table)
