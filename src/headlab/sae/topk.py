"""TopK SAE (Gao et al. 2024): the k largest pre-activations of each token survive (through a ReLU,
as SAELens's TopK), every other latent is zero; the loss is the squared error alone.

Decoding touches only the k active rows of W_dec (an embedding bag), so a step costs one dense
encoder product, not two: the source of the fitter's speed on TopK. SAELens loads it as "topk".
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

from .base import SparseAutoencoder


class TopKSAE(SparseAutoencoder):
    architecture = "topk"
    saelens_architecture = "topk"

    def __init__(self, d_in: int, d_sae: int, seed: int = 0, k: int = 8):
        super().__init__(d_in, d_sae, seed)
        if not 0 < k <= d_sae:
            raise ValueError(f"topk SAE: k must be in 1..d_sae ({d_sae}), not {k}")
        self.k = k

    def top(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(values [..., k] after ReLU, latent indices [..., k])."""
        values, indices = self.pre_activation(x).topk(self.k, dim=-1, sorted=False)
        return torch.relu(values), indices

    def encode(self, x: Tensor) -> Tensor:
        values, indices = self.top(x)
        return torch.zeros(*x.shape[:-1], self.d_sae, dtype=values.dtype, device=x.device).scatter(-1, indices, values)

    def decode_sparse(self, values: Tensor, indices: Tensor) -> Tensor:
        flat_v, flat_i = values.reshape(-1, self.k), indices.reshape(-1, self.k)
        out = F.embedding_bag(flat_i, self.W_dec, per_sample_weights=flat_v, mode="sum")
        return out.reshape(*values.shape[:-1], self.d_in) + self.b_dec

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        values, indices = self.top(x)
        f = torch.zeros(*x.shape[:-1], self.d_sae, dtype=values.dtype, device=x.device).scatter(-1, indices, values)
        return self.decode_sparse(values, indices), f

    def loss(self, x: Tensor, step: int) -> tuple[Tensor, dict[str, Tensor], Tensor]:
        values, indices = self.top(x)
        recon = self.decode_sparse(values, indices)
        mse = (recon - x).pow(2).sum(-1).mean()
        fires = torch.bincount(indices[values > 0], minlength=self.d_sae)
        return mse, {"mse": mse}, fires

    def saelens_fields(self) -> dict:
        return {"k": self.k, "rescale_acts_by_decoder_norm": False}
