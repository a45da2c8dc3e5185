"""`headlab train`: train the configured model (or reuse it); its training curve is the run's table."""

from __future__ import annotations

import pandas as pd

from .. import results
from ..config import option
from ..errors import UsageError
from .context import RunContext

NAME = "train"


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
