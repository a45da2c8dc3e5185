"""Per-head readings: output norms (at the first read position or any per-prompt position), attention
weights by token from the first read position, and the mean of the heads' logits (each head alone)."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ..interventions import Intervention
from ..interventions.edits import Sources, edit_hooks
from ..interventions.readout import CHUNK_MB, prompts_per_readout
from ..models.hooked import HookedModel
from ..tasks import Task, TaskData
from ..vocabulary import Kind, Method, Site, Source, hook_name

MEAN_HEAD_LOGITS = "mean_head_logits"  # the table's intervention name for mean_head_logits' rows


def head_output_norms_per_prompt(model: HookedModel, data: TaskData, at: Tensor | None = None) -> dict[int, Tensor]:
    """layer -> [n, head]: the norm of each head's term z_h W_O^h, per prompt, at the positions `at` [n]
    (default the first read position)."""
    rows = torch.arange(data.n)
    where = data.positions[:, 0] if at is None else at
    out = {}
    with torch.inference_mode():
        for layer, z in model.record(data.inputs, "z").items():
            z_read = z[rows, where.to(z.device)]  # [n, head, d_head]
            out[layer] = torch.einsum("nhd,hdm->nhm", z_read, model.sites.W_O(layer)).norm(dim=-1)
    return out


def head_output_norms(model: HookedModel, data: TaskData, at: Tensor | None = None) -> dict[int, Tensor]:
    """layer -> [head]: mean norm of each head's term z_h W_O^h over the prompts, at the positions `at`
    [n] (default the first read position)."""
    return {layer: n.mean(0) for layer, n in head_output_norms_per_prompt(model, data, at).items()}


def uniform_scales(norms: dict[int, Tensor]) -> dict[int, list[float]]:
    """Factors that give every head of a layer the layer's mean output norm (norms as head_output_norms
    gives them: means over prompts, so each head's norm is equal on average, not on every prompt)."""
    return {layer: (n.mean() / n.clamp_min(1e-12)).tolist() for layer, n in norms.items()}


def mean_head_logits(model: HookedModel, task: Task, data: TaskData, layer: int, chunk_mb: float = CHUNK_MB) -> Tensor:
    """Task quantities [n, Q] of the mean of the logits of each head of `layer` alone (the layer's other
    heads zero-ablated): the heads as an ensemble of equals. With a final LayerNorm this is not the model
    with every head's output scaled by 1/heads, and unlike uniform_scales it keeps each head's own norm.

    Each head's run keeps its last hidden states at the read positions (d_model a position); their logits
    are read out and averaged a slice of prompts at a time, at most `chunk_mb` of them for all heads together
    (one prompt at least), not heads x prompts x positions x vocabulary at once."""
    sources = Sources(model, data, [(Source.zero, Site.z)])
    rows = torch.arange(data.n).unsqueeze(1)
    hidden = []
    with torch.inference_mode():
        for head in range(model.n_heads):
            alone = Intervention(Kind.keep_head, Method.zero, layer, head)
            with model.hooks(layer, **edit_hooks([alone], sources, data.n, model.n_heads)):
                h = model.forward_blocks(data.inputs)
            hidden.append(h[rows.to(h.device), data.positions.to(h.device)])  # [n, P, d_model]
        read = torch.arange(data.positions.shape[1]).expand(data.n, -1)
        step = prompts_per_readout(model, read.shape[1], hidden[0], chunk_mb / model.n_heads)  # every head's
        parts = []
        for first in range(0, data.n, step):
            part = slice(first, first + step)
            logits = torch.stack([model.readout(h[part], read[part]) for h in hidden]).mean(0)
            parts.append(task.per_prompt(logits, data.take(part)))
            del logits
    return torch.cat(parts)


def attention_by_token(model: HookedModel, data: TaskData, tokens: dict[int, str]) -> tuple[np.ndarray, list[dict]]:
    """Per head, attention from the first read position to the keys holding each token: summed over those
    keys, then per occurrence (the sum over the number of such keys at or before the read position; NaN
    where there is none). A sum over the 1s of a string grows with their count, which is Count01's label
    itself; the weight on one 1 is what says how a head weighs the kinds of token.

    Returns per-prompt quantities [layers*heads, n, 2 * len(tokens)] (sums, then per occurrence) and the
    row labels."""
    rows = torch.arange(data.n)
    ids = data.inputs["input_ids"]
    read = data.positions[:, 0]
    masks = torch.stack([(ids == t).float() for t in tokens], dim=-1)  # [n, key, token]
    seen = (torch.arange(ids.shape[1])[None, :] <= read[:, None]).float()  # keys the read position can attend
    counts = torch.einsum("nkt,nk->nt", masks, seen)
    quantities, labels = [], []
    with torch.inference_mode():
        recorded = model.record(data.inputs, "pattern")
    for layer, pattern in recorded.items():
        from_read = pattern[rows, :, read]  # [n, head, key]
        per_token = torch.einsum("nhk,nkt->hnt", from_read, masks[:, : from_read.shape[-1]])
        per_one = per_token / counts.where(counts > 0, torch.nan)
        for head in range(per_token.shape[0]):
            quantities.append(torch.cat([per_token[head], per_one[head]], dim=-1).numpy())
            labels.append(
                {
                    "intervention": "none",
                    "method": "attention",
                    "layer": layer,
                    "head": head,
                    "hook": hook_name(Site.pattern, layer),
                }
            )
    return np.stack(quantities), labels
