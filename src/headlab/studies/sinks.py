"""`headlab run scores=sinks`: each head's sink rate and first-token attention over the task's prompts
(analysis/sinks.py), with 95% bootstrap intervals over prompts.

Rows: intervention "none", method "score", per layer and head; metrics sink_rate (queries with more than
`scores.epsilon` of their attention on the first token) and first_token_attention.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from .. import results
from ..analysis.sinks import SINK_QUANTITIES, sink_scores
from ..config import Config, option, run_info
from ..figures.heads import head_name
from ..tasks import mean_of
from .context import RunContext

NAME = "sinks"
DEFAULT_FIGURES = "scores"
TOP_HEADS = 5  # named in meta.json


def serves(cfg: Config) -> bool:
    return option(cfg.scores.kind) == "sinks"


def run(ctx: RunContext) -> pd.DataFrame:
    cfg = ctx.cfg
    model, data = ctx.get_model(), ctx.get_data()
    with ctx.timed("sinks"):
        scores = sink_scores(model, data, cfg.scores.epsilon)
    labels = [
        {"intervention": "none", "method": "score", "layer": layer, "head": head}
        for layer in range(model.n_layers)
        for head in range(model.n_heads)
    ]
    metrics = {name: mean_of(j) for j, name in enumerate(SINK_QUANTITIES)}
    quantities = scores.numpy().astype(np.float64)
    table = results.tidy(run_info(cfg), labels, quantities, SINK_QUANTITIES, {}, metrics, n_boot=cfg.output.n_boot)
    rate = scores[..., 0].mean(1)
    top = rate.argsort(descending=True)[:TOP_HEADS].tolist()
    ctx.meta["top_sink_heads"] = [f"{head_name(*divmod(i, model.n_heads))} {rate[i].item():.3f}" for i in top]
    ctx.meta.update({"n_prompts": data.n, "epsilon": cfg.scores.epsilon, "model_family": model.family})
    return table
