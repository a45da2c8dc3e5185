"""The plain sweep: every intervention the config plans (ablations, patching), one tidy table, and its
layer x head heatmaps (figures/heads_<metric>.png).

Optionally with each head's attention per token (study.attention_by_token) and head-class scores
(study.head_scores; study.sequence_scores=false leaves their random-token ones out) in the same table.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from .. import results
from ..analysis.heads import (
    MEAN_HEAD_LOGITS,
    attention_by_token,
    head_output_norms,
    head_output_norms_per_prompt,
    mean_head_logits,
    uniform_scales,
)
from ..config import Config, option, run_info
from ..errors import HeadlabError
from ..interventions import plan
from ..interventions.engine import execute
from ..models.hooked import HookedModel
from ..tasks import Task, TaskData, mean_of, nanmean_of, nanmean_ratio_of
from ..vocabulary import Site, hook_name
from .context import RunContext
from .study import Study, StudyOptions
from .summary import head_table


@dataclass
class SweepOptions(StudyOptions):
    """The sweep's own options; its interventions are the ablate= and patch= groups'."""

    name: str = "sweep"
    attention_by_token: bool = False  # add each head's mean attention, from the first read position, per token
    head_scores: bool = False  # add head-class scores (previous-token, induction, copy, ...; analysis/scores.py)
    sequence_scores: bool = True  # with head_scores, the repeated-random-token ones too; false: the IOI ones alone


def run(ctx: RunContext) -> pd.DataFrame:
    cfg, opts = ctx.cfg, ctx.options
    task, model, data = ctx.get_task(), ctx.get_model(), ctx.get_data()
    scales, scales_at = None, None
    uniform = option(cfg.ablate.sweep) == "uniform"
    if uniform:  # equal norms measured at the first read position (everywhere), and at each read role there
        scales = uniform_scales(head_output_norms(model, data))
        roles = data.token_positions or {}
        scales_at = {r: uniform_scales(head_output_norms(model, data, roles[r])) for r in data.read_roles()}
    if opts.head_scores:
        from ..analysis.scores import has_ioi_roles

        if not has_ioi_roles(data):  # said before the sweep, not discovered after it
            ctx.note(
                f"head_scores: task {task.name} has no IOI roles; the IOI scores (END attention, copy) are left out"
            )
    interventions = (
        plan(cfg, model.n_layers, model.n_heads, scales, scales_at) if ctx.interventions is None else ctx.interventions
    )
    with ctx.timed("sweep"):
        quantities = execute(
            model,
            task,
            data,
            interventions,
            cfg.engine.chunk_mb,
            cfg.engine.naive,
            show_progress=ctx.show_progress,
            seed=cfg.seed,
            mean_over=cfg.ablate.mean_over,
            gpu_memory_share=cfg.engine.gpu_memory_share,
            report=ctx.meta.setdefault("engine", {}),
        )
    rows = [iv.row() for iv in interventions]
    if uniform:  # the second uniform aggregation: the heads' mean logits
        ensemble = [mean_head_logits(model, task, data, layer) for layer in range(model.n_layers)]
        quantities = torch.cat([quantities, torch.stack(ensemble).to(quantities.device)])
        rows += [
            {"intervention": MEAN_HEAD_LOGITS, "method": "zero", "layer": l, "hook": hook_name(Site.z, l)}
            for l in range(model.n_layers)
        ]
    with ctx.timed("tidy"):
        info = run_info(cfg)
        df = results.tidy(
            info,
            rows,
            quantities.cpu().numpy(),
            task.quantities,
            data.answers_np(),
            task.aggregates,
            n_boot=cfg.output.n_boot,
            per_prompt=cfg.output.per_prompt,
        )
        if opts.attention_by_token:
            df = results.conform(pd.concat([df, attention_table(cfg, task, model, data, info)]))
        if uniform:
            df = results.conform(pd.concat([df, norm_table(cfg, model, data, info)]))
    if opts.head_scores:
        from ..analysis.scores import score_table

        with ctx.timed("head_scores"):
            scores = score_table(model, data, info, cfg.output.n_boot, cfg.seed, sequences=opts.sequence_scores)
        df = results.conform(pd.concat([df, scores], ignore_index=True))
    ctx.meta.update({"n_interventions": len(interventions), "n_prompts": data.n, "model_family": model.family})
    return df


def attention_table(cfg: Config, task: Task, model: HookedModel, data: TaskData, info: dict) -> pd.DataFrame:
    """Each head's mean attention, from the first read position, to each token the task names: summed
    over the token's keys (attn_to_*) and on one of them (attn_per_*, over prompts that hold it); and the
    task's attention_ratios (name -> (token a, token b)): per prompt, the weight on one a over the weight
    on one b, averaged over the prompts holding both."""
    tokens = getattr(task, "token_names", None)
    if not tokens:
        raise HeadlabError(f"task {task.name} names no tokens to group attention by")
    quantities, labels = attention_by_token(model, data, tokens)
    metrics = {f"attn_to_{name}": mean_of(j) for j, name in enumerate(tokens.values())}
    metrics |= {f"attn_per_{name}": nanmean_of(len(tokens) + j) for j, name in enumerate(tokens.values())}
    index = {name: len(tokens) + j for j, name in enumerate(tokens.values())}
    for name, (num, den) in getattr(task, "attention_ratios", {}).items():
        metrics[name] = nanmean_ratio_of(index[num], index[den])
    return results.tidy(info, labels, quantities, list(metrics), {}, metrics, n_boot=cfg.output.n_boot)


def norm_table(cfg: Config, model: HookedModel, data: TaskData, info: dict) -> pd.DataFrame:
    """Each head's mean output norm |z_h W_O^h| on the clean prompts (intervention none, method
    output_norm): at the first read position (`output_norm`) and at each read role (`output_norm_<role>`),
    the norms the uniform sweep's factors equalise."""
    roles = data.token_positions or {}
    where = {"output_norm": None} | {f"output_norm_{r}": roles[r] for r in data.read_roles()}
    per_prompt = [head_output_norms_per_prompt(model, data, at) for at in where.values()]
    quantities, labels = [], []
    for layer in per_prompt[0]:
        result = hook_name("result", layer)  # |z_h W_O^h|: the norm of the head's slice of hook_result
        for head in range(model.n_heads):
            quantities.append(torch.stack([p[layer][:, head] for p in per_prompt], dim=-1).cpu().numpy())
            labels.append(
                {"intervention": "none", "method": "output_norm", "layer": layer, "head": head, "hook": result}
            )
    metrics = {name: mean_of(j) for j, name in enumerate(where)}
    return results.tidy(info, labels, np.stack(quantities), list(metrics), {}, metrics, n_boot=cfg.output.n_boot)


STUDY = Study(
    name="sweep",
    description="every intervention ablate= and patch= plan (heads, layers, patching, ...), per metric",
    run=run,
    summary=head_table,
    reads=("train", "ablate", "patch", "engine"),
    sections=("ablate", "patch"),
    schema=SweepOptions,
    figures="heads",  # layer x head heatmaps of every head sweep, per metric
)
