"""SAE metrics on held-out tokens: L0, MSE, explained variance, dead latents, and the cross-entropy loss
recovered when the reconstruction replaces z in the model's forward pass (through HeadSites):

  ce_loss_recovered = (CE_zero_ablation - CE_with_SAE) / (CE_zero_ablation - CE_clean)

CE is the model's own loss: the mean cross-entropy at the corpus's target positions (for a task, the
positions and targets the model trained on; for text, every next token). 1.0: the reconstruction
serves the model as well as z itself; 0.0: no better than zeroing the layer's z.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.nn import functional as F

from ..models.hooked import HookedModel
from .activations import Corpus
from .base import SparseAutoencoder

Replace = Callable[[Tensor], Tensor]  # z flattened over heads [..., d_in] -> same


@torch.no_grad()
def reconstruction_metrics(sae: SparseAutoencoder, x: Tensor, batch: int = 4096) -> dict[str, float]:
    """x [tokens, d_in]: l0 (mean active latents per token), mse (mean over tokens and dimensions),
    explained_variance (1 - residual / total sum of squares about the mean), dead_fraction (latents
    that fire on none of these tokens)."""
    residual, active, fired = 0.0, 0.0, torch.zeros(sae.d_sae, dtype=torch.bool)
    for start in range(0, x.shape[0], batch):
        chunk = x[start : start + batch]
        recon, f = sae(chunk)
        residual += float((recon - chunk).double().pow(2).sum())
        active += float((f > 0).sum())
        fired |= (f > 0).any(0)
    total = float((x.double() - x.double().mean(0)).pow(2).sum())
    n = x.shape[0]
    return {
        "l0": active / n,
        "mse": residual / (n * x.shape[1]),
        "explained_variance": 1 - residual / total,
        "dead_fraction": 1 - float(fired.float().mean()),
    }


@torch.no_grad()
def cross_entropy(
    model: HookedModel, layer: int, corpus: Corpus, replace: Replace | None, model_batch: int = 64
) -> float:
    """Mean CE at the corpus's targets, with layer's z replaced by replace(z) (None: clean)."""
    total, count = 0.0, 0
    for start in range(0, corpus.ids.shape[0], model_batch):
        ids = corpus.ids[start : start + model_batch]
        targets = corpus.targets[start : start + model_batch]
        hooks = {} if replace is None else {"z": _splice(replace)}
        with model.hooks(layer, **hooks):
            logits = model.forward({"input_ids": ids})
        mask = targets != -100
        total += float(F.cross_entropy(logits[mask].float(), targets[mask], reduction="sum"))
        count += int(mask.sum())
    return total / max(count, 1)


def _splice(replace: Replace) -> Callable[[Tensor], Tensor]:
    def hook(z: Tensor) -> Tensor:  # [batch, pos, head, d_head]
        flat = z.reshape(*z.shape[:2], -1)
        return replace(flat).reshape(z.shape).to(z.dtype)

    return hook


def ce_recovered(
    model: HookedModel, layer: int, corpus: Corpus, replace: Replace, model_batch: int = 64, clean: float | None = None
) -> dict[str, float]:
    """clean: the clean CE of this corpus where the caller has it (one clean pass serves every layer)."""
    if clean is None:
        clean = cross_entropy(model, layer, corpus, None, model_batch)
    zero = cross_entropy(model, layer, corpus, torch.zeros_like, model_batch)
    spliced = cross_entropy(model, layer, corpus, replace, model_batch)
    gap = zero - clean
    return {
        "ce_clean": clean,
        "ce_zero_ablation": zero,
        "ce_with_sae": spliced,
        "ce_loss_recovered": (zero - spliced) / gap if abs(gap) > 1e-12 else float("nan"),
    }
