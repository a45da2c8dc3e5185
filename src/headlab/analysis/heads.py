"""Per-head readings: output norms and attention weights by token, from the first read position."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ..models.hooked import HookedModel
from ..tasks import TaskData


def head_output_norms(model: HookedModel, data: TaskData) -> dict[int, Tensor]:
    """layer -> [head]: mean norm of each head's term z_h W_O^h at the first read position."""
    rows = torch.arange(data.n)
    out = {}
    with torch.inference_mode():
        for layer, z in model.record(data.inputs, "z").items():
            z_read = z[rows, data.positions[:, 0]]  # [n, head, d_head]
            out[layer] = torch.einsum("nhd,hdm->nhm", z_read, model.sites.W_O(layer)).norm(dim=-1).mean(0)
    return out


def uniform_scales(norms: dict[int, Tensor]) -> dict[int, list[float]]:
    """Factors that give every head of a layer the layer's mean output norm."""
    return {layer: (n.mean() / n.clamp_min(1e-12)).tolist() for layer, n in norms.items()}


def attention_by_token(model: HookedModel, data: TaskData, tokens: dict[int, str]) -> tuple[np.ndarray, list[dict]]:
    """Per head, attention from the first read position summed over keys holding each token.

    Returns per-prompt quantities [layers*heads, n, len(tokens)] and the row labels."""
    rows = torch.arange(data.n)
    ids = data.inputs["input_ids"]
    masks = torch.stack([(ids == t).float() for t in tokens], dim=-1)  # [n, key, token]
    quantities, labels = [], []
    with torch.inference_mode():
        recorded = model.record(data.inputs, "pattern")
    for layer, pattern in recorded.items():
        from_read = pattern[rows, :, data.positions[:, 0]]  # [n, head, key]
        per_token = torch.einsum("nhk,nkt->hnt", from_read, masks[:, : from_read.shape[-1]])
        for head in range(per_token.shape[0]):
            quantities.append(per_token[head].numpy())
            labels.append({"intervention": "none", "method": "attention", "layer": layer, "head": head})
    return np.stack(quantities), labels
