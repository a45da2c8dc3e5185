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
    scored = clean[clean["layer"].notna()]  # a score per head, measured on the clean run
    clean = clean[clean["layer"].isna()]
    rest = wide[wide["intervention"] != "none"]
    title = f"{agg['model'].iloc[0]} on {agg['task'].iloc[0]} ({int(agg['n'].iloc[0])} prompts)"
    notes = []
    if len(scored) > max_rows:  # the heads that score highest
        metric = next(m for m in metrics if scored[m].notna().any())
        notes.append(f"the {max_rows} of {len(scored)} heads with the largest {metric}")
        scored = scored.nlargest(max_rows, metric)
    if len(rest) > max_rows and len(clean):
        key = next((m for m in metrics if clean[m].notna().any() and rest[m].notna().any()), metrics[0])
        notes.append(f"{max_rows} of {len(rest)} interventions, largest change in {key}")
        rest = rest.assign(_drop=(clean[key].iloc[0] - rest[key]).abs()).nlargest(max_rows, "_drop")
    title += ": " + "; ".join(notes) if notes else ""
    shown = pd.concat([clean, scored, rest])
    table = Table(title=title)
    for col in keys + metrics:
        table.add_column(col, justify="left" if col in ("intervention", "method") else "right", overflow="fold")
    fmt = lambda v: "" if pd.isna(v) else (f"{v:.3f}" if isinstance(v, float) else str(v))  # noqa: E731
    for _, r in shown.iterrows():
        table.add_row(*[fmt(r[c]) for c in keys + metrics])
    console.print(table)
