"""`headlab run scores=sinks`: each head's attention sinks over the task's prompts (analysis/sinks.py),
with 95% bootstrap intervals over prompts.

Rows: intervention "none", method "score", per layer and head; metrics sink_rate (queries with more than
`study.epsilon` of their attention on the first token), first_token_attention, and the hidden sinks of
Yu et al. 2024 (tokens after the first receiving more than `study.alpha` / N): hidden_sink_count,
hidden_sink_share and hidden_sink_mass; and Gu et al. 2024's first-token attention over all the queries,
gu_first_token_attention, with its sink-head indicator gu_sink. One model-level row more (layer and head
empty): metric sink_1, Gu et al.'s Sink_1^epsilon in %, with the epsilon in its column `epsilon`; with
`study.seq_len=64` the prompts are their sequences of 64 tokens exactly. meta.json names the top heads
of each kind and the positions and tokens most often hidden sinks. The calibration of a head's sink is an
intervention of the sweep:
`ablate=sink_calibration`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from .. import results
from ..analysis.sinks import SINK_QUANTITIES, exact_length, most_often, sink_1, sink_scores
from ..config import run_info
from ..config_rules import NATURAL, POSITIVE, SHARE, setting
from ..errors import UsageError
from ..tables import head_name
from ..tasks import mean_of
from ..vocabulary import Site, hook_name
from .context import RunContext
from .study import Study, StudyOptions
from .summary import head_table

TOP_HEADS = 5  # named in meta.json


@dataclass
class SinksOptions(StudyOptions):
    name: str = "sinks"
    # a query is a sink query when more than epsilon of its attention is on the first token: Gu et al.
    # 2024's Sink_1^epsilon with their epsilon, 0.3
    epsilon: float = setting(0.3, SHARE)
    # a token after the first is a hidden sink of a head when the attention it receives, averaged over the
    # queries that see it, exceeds alpha / N, N the prompt's length: Yu et al. 2024's alpha, 5
    alpha: float = setting(5.0, POSITIVE)
    # 0: the paper's alpha / N; > 0: a fixed threshold instead, whatever N (ACT's released code uses 0.1)
    hidden_threshold: float = setting(0.0, SHARE)
    # Gu et al.'s sequences of T tokens exactly (their T: 64, with task=text): prompts cut to their first
    # seq_len tokens, those shorter left out (a note says how many). 0: the prompts as the task gives them,
    # since most tasks' prompts (IOI's ~15 tokens) are shorter than 64
    seq_len: int = setting(0, NATURAL)


def run(ctx: RunContext) -> pd.DataFrame:
    cfg = ctx.cfg
    model, data = ctx.get_model(), ctx.get_data()
    opts: SinksOptions = ctx.options
    seq_len = opts.seq_len
    if seq_len:
        given = data.n
        data = exact_length(data, seq_len)
        if data.n == 0:
            raise UsageError(
                f"sinks: no prompt has study.seq_len={seq_len} tokens (the longest task.seq_len allows counts)"
            )
        if data.n < given:
            ctx.note(f"sinks: {given - data.n} of {given} prompts have fewer than {seq_len} tokens, left out")
    with ctx.timed("sinks"):
        scores = sink_scores(model, data, opts.epsilon, opts.alpha, fixed=opts.hidden_threshold)
    labels = [
        {
            "intervention": "none",
            "method": "score",
            "layer": layer,
            "head": head,
            "hook": hook_name(Site.pattern, layer),  # every sink score is read off the head's pattern
        }
        for layer in range(model.n_layers)
        for head in range(model.n_heads)
    ]
    metrics = {name: mean_of(j) for j, name in enumerate(SINK_QUANTITIES)}
    quantities = scores.quantities.numpy().astype(np.float64)
    table = results.tidy(run_info(cfg), labels, quantities, SINK_QUANTITIES, {}, metrics, n_boot=cfg.output.n_boot)
    # the model-level row: one value per prompt, bootstrapped over prompts like the per-head rows
    model_row = [{"intervention": "none", "method": "score", "layer": None, "head": None}]
    shares = sink_1(scores).numpy().astype(np.float64)[None, :, None]
    overall = results.tidy(run_info(cfg), model_row, shares, ("sink_1",), {}, {"sink_1": mean_of(0)}, cfg.output.n_boot)
    table = results.conform(pd.concat([table, overall.assign(epsilon=opts.epsilon)], ignore_index=True))
    mean = scores.quantities.mean(1)  # [heads, quantities]
    for key, name in (("top_sink_heads", "sink_rate"), ("top_hidden_sink_heads", "hidden_sink_mass")):
        column = mean[:, SINK_QUANTITIES.index(name)]
        top = column.argsort(descending=True)[:TOP_HEADS].tolist()
        ctx.meta[key] = [f"{head_name(*divmod(i, model.n_heads))} {column[i].item():.3f}" for i in top]
    positions, tokens = most_often(scores, data.inputs["input_ids"], model.n_layers * model.n_heads)
    ctx.meta["hidden_sink_positions"] = [f"{p}: {share:.3f} ({count})" for p, share, count in positions]
    ctx.meta["hidden_sink_tokens"] = [
        f"{_token(model.tokenizer, t)}: {share:.3f} ({count})" for t, share, count in tokens
    ]
    ctx.meta.update(
        {
            "n_prompts": data.n,
            "epsilon": opts.epsilon,
            "alpha": opts.alpha,
            "hidden_rule": f"> {opts.hidden_threshold:g}" if opts.hidden_threshold else "> alpha / N",
            "seq_len": seq_len or None,
            "model_family": model.family,
        }
    )
    return table


def _token(tokenizer: Any, token_id: int) -> str:
    """`17 ' the'` with a tokenizer, else the id alone."""
    if tokenizer is None:
        return str(token_id)
    return f"{token_id} {tokenizer.decode([token_id])!r}"


STUDY = Study(
    name="sinks",
    description="attention sinks per head: sink rate, first-token attention, hidden sinks (Yu et al. 2024)",
    run=run,
    summary=head_table,
    reads=("train",),
    figures="scores",
    schema=SinksOptions,
)
