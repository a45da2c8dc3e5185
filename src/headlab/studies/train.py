"""`headlab train`: train the configured model (or reuse it); its training curve is the run's table."""

from __future__ import annotations

import pandas as pd
from rich.table import Table

from .. import results
from ..config import option
from ..errors import UsageError
from .context import RunContext
from .study import Study
from .summary import aggregated, console


def run(ctx: RunContext) -> pd.DataFrame:
    from ..train import train_toy
    from ..train.obtain import checkpoint_dir

    cfg = ctx.cfg
    if option(cfg.model.kind) == "pathnet":
        raise UsageError("model=pathnet is learned inside `headlab run` (theory, posterior samples, gradient descent)")
    directory = checkpoint_dir(cfg)
    with ctx.timed("train"):
        _, curve = train_toy(cfg.model, ctx.get_task(), cfg.train, cfg.seed, directory, ctx.show_progress)
    df = pd.DataFrame(curve if curve else [], columns=["step", "metric", "value"])
    df = df.assign(
        experiment=cfg.name,
        model=cfg.model.name,
        task=cfg.task.name,
        seed=cfg.seed,
        intervention="none",
        method="train",
        n=cfg.train.eval_prompts,
    )
    ctx.meta["checkpoint"] = str(directory)
    return results.conform(df)


def summary(df: pd.DataFrame, max_rows: int) -> None:
    """The metrics at the last step of the training curve."""
    df = aggregated(df)
    if df.empty:
        return
    last = df[df["step"] == df["step"].max()]
    table = Table(title=f"{df['model'].iloc[0]} on {df['task'].iloc[0]}: step {int(last['step'].iloc[0])}")
    for col in ("metric", "value"):
        table.add_column(col)
    for _, r in last.head(max_rows).iterrows():
        table.add_row(str(r["metric"]), f"{r['value']:.4f}")
    console.print(table)


STUDY = Study(
    name="train",
    description="`headlab train`: train the configured model from scratch (or reuse it); its training curve",
    run=run,
    summary=summary,
    reads=("model", "task", "train"),
    sections=("train", "model"),
)
