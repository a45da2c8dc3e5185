"""Attention sinks per head: how much of a head's attention the first token of the prompt draws.

For each prompt, layer and head, over the prompt's real query positions after the first (the first
token can attend to nothing else, so it would count as a sink query in every head):
  sink_rate               share of queries putting more than epsilon of their attention on the first token
  first_token_attention   mean attention on the first token
Prompts are right-padded (tasks/base.py): the first token is position 0, and real positions are those
the `attention_mask` marks (every position where the task gives none).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..models.hooked import HookedModel
from ..tasks import TaskData

SINK_QUANTITIES = ("sink_rate", "first_token_attention")


def sink_quantities(pattern: Tensor, real: Tensor, epsilon: float) -> Tensor:
    """pattern [batch, head, query, key], real [batch, pos] bool -> [batch, head, 2]: SINK_QUANTITIES."""
    on_first = pattern[..., 1:, 0]  # [batch, head, query >= 1]
    counted = real[:, None, 1:].to(pattern.dtype)
    n = counted.sum(-1).clamp(min=1)
    rate = ((on_first > epsilon).to(pattern.dtype) * counted).sum(-1) / n
    mean = (on_first * counted).sum(-1) / n
    return torch.stack([rate, mean], dim=-1)


@torch.no_grad()
def sink_scores(model: HookedModel, data: TaskData, epsilon: float = 0.3, batch_size: int = 16) -> Tensor:
    """[layers * heads, prompts, 2]: SINK_QUANTITIES per head (layer-major) and prompt."""
    ids = data.inputs["input_ids"]
    mask = data.inputs.get("attention_mask")
    real = (mask if mask is not None else torch.ones_like(ids)).bool()
    parts = []
    for start in range(0, ids.shape[0], batch_size):
        batch = {k: v[start : start + batch_size] for k, v in data.inputs.items()}
        with model.sites.record(sites=("pattern",)) as seen:
            model.forward(batch)
        rows = real[start : start + batch_size]
        per_layer = [sink_quantities(seen[("pattern", l)].float(), rows, epsilon) for l in range(model.n_layers)]
        parts.append(torch.stack(per_layer, 1))  # [batch, layer, head, 2]
    scores = torch.cat(parts).flatten(1, 2)  # [prompts, layers * heads, 2]
    return scores.transpose(0, 1).cpu()
