"""`headlab run scores=composition`: Q-, K- and V-composition of every pair of heads in different layers,
from the weights (analysis/head_composition.py), and each pair's low-rank channels.

Rows (intervention "none", method "score", n 1: weights, no prompts, so no interval): layer / head are
the reader, writer_layer / writer_head the writer; metric q_composition, k_composition, v_composition;
and, per pair, `study.channels` rows q_channel, k_channel, v_channel with `channel` 1, 2, ...: the
product's singular values over the norms of its two factors (their squares sum to the score's square;
`study.channels=0`: none).
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import torch

from .. import results
from ..analysis.head_composition import MODES, centres_writes, composition
from ..config import run_info
from ..config_rules import NATURAL, setting
from ..errors import UsageError
from ..models.hooked import HookedModel
from ..tables import head_name
from .context import RunContext
from .study import Study, StudyOptions
from .summary import head_table

TOP_PAIRS = 5  # named in meta.json per mode


@dataclass
class CompositionOptions(StudyOptions):
    name: str = "composition"
    # singular values (low-rank channels) kept per writer/reader pair (Merullo et al. 2024); 0: none (no SVDs)
    channels: int = setting(4, NATURAL)
    # on TransformerLens's default weights (from_pretrained's fold_ln and center_writing_weights), on which
    # Elhage et al.'s scores are usually read; false: the raw weights
    fold_norms: bool = True


def run(ctx: RunContext) -> pd.DataFrame:
    model = ctx.get_model(runs_task=False)  # weights only: any model, whatever the task
    if model.n_layers < 2:
        raise UsageError(f"study=composition: {model.name} has one layer; composition needs heads in two")
    opts: CompositionOptions = ctx.options
    fold = bool(opts.fold_norms)
    with ctx.timed("composition"):
        found = composition(model, opts.channels, fold)
    frames = []
    for mode in MODES:
        frames.append(_rows(found.scores[mode], f"{mode}_composition"))
        frames.append(_rows(found.channels[mode], f"{mode}_channel"))
        ctx.meta[f"top_{mode}_composition"] = _top(found.scores[mode])
    table = pd.concat(frames, ignore_index=True)
    for key, value in run_info(ctx.cfg).items():
        table[key] = value
    ctx.meta.update({"model_family": model.family, "n_pairs": int(found.scores["q"].isfinite().sum())})
    ctx.meta["weight_processing"] = _processing(model, fold)  # "weights" is the model's provenance
    # no hook: the scores are read off the weights, not off an activation TransformerLens hooks
    return results.conform(table.assign(intervention="none", method="score", n=1))


def _processing(model: HookedModel, fold: bool) -> str:
    """Which weights the scores were computed on, for meta.json: a number is only comparable with another
    computed on the same processing."""
    if not fold:
        return "raw (norms not folded, nothing centred)"
    if centres_writes(model):
        return "norms folded into W_Q/W_K/W_V, reading weights and W_O centred (TransformerLens's default)"
    return "norm scales folded into W_Q/W_K/W_V, nothing centred (TransformerLens's default for RMSNorm)"


def _rows(values: torch.Tensor, metric: str) -> pd.DataFrame:
    """[L, H, L, H] or [L, H, L, H, c] -> one row per finite entry (a writer before its reader)."""
    per_channel = values.dim() == 5
    index = values.isfinite().nonzero()
    out = {
        "writer_layer": index[:, 0].numpy(),
        "writer_head": index[:, 1].numpy(),
        "layer": index[:, 2].numpy(),
        "head": index[:, 3].numpy(),
        "metric": metric,
        "value": values[values.isfinite()].numpy(),
    }
    if per_channel:
        out["channel"] = index[:, 4].numpy() + 1
    return pd.DataFrame(out).astype({"writer_layer": "Int64", "writer_head": "Int64"})


def _top(scores: torch.Tensor) -> list[str]:
    flat = torch.nan_to_num(scores, nan=-1.0).flatten()
    best = flat.topk(min(TOP_PAIRS, int(scores.isfinite().sum()))).indices
    named = []
    for i in best.tolist():
        l1, h1, l2, h2 = (int(x) for x in torch.unravel_index(torch.tensor(i), scores.shape))
        named.append(f"{head_name(l1, h1)}->{head_name(l2, h2)} {scores[l1, h1, l2, h2].item():.3f}")
    return named


STUDY = Study(
    name="composition",
    description="Q-, K- and V-composition of head pairs from the weights, and their low-rank channels",
    run=run,
    summary=head_table,
    reads=("train",),
    figures="scores",
    schema=CompositionOptions,
)
