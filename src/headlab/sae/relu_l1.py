"""ReLU SAE with an L1 penalty (Kissane et al. 2024, after Anthropic's "Towards Monosemanticity").

f = ReLU((x - b_dec) W_enc + b_enc), x_hat = f W_dec + b_dec, decoder rows at unit norm;
loss = ||x - x_hat||^2 (summed over dimensions, mean over tokens) + l1_coeff * sum_i |f_i|.
With unit-norm rows the L1 term cannot be dodged by shrinking f and growing W_dec.
SAELens loads it as architecture "standard".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..config_rules import NATURAL, NON_NEGATIVE, setting
from .base import SaeConfig, SparseAutoencoder


@dataclass
class ReluL1Config(SaeConfig):
    architecture: str = "relu_l1"
    l1_coeff: float = setting(1.0, NON_NEGATIVE)  # weight of sum |f| against the squared error (summed over dimensions)
    l1_warmup_steps: int = setting(0, NATURAL)  # the L1 weight ramps up linearly over these steps
    resample_every: int = setting(500, NATURAL)  # re-initialise dead latents every N steps (0: never), not near the end


class ReluL1SAE(SparseAutoencoder):
    architecture = "relu_l1"
    saelens_architecture = "standard"
    options = ReluL1Config

    @classmethod
    def build(cls, d_in: int, options: SaeConfig, seed: int = 0) -> SparseAutoencoder:
        assert isinstance(options, ReluL1Config)
        return cls(d_in, options.expansion * d_in, seed, options.l1_coeff, options.l1_warmup_steps)

    def __init__(self, d_in: int, d_sae: int, seed: int = 0, l1_coeff: float = 1.0, l1_warmup_steps: int = 0):
        super().__init__(d_in, d_sae, seed)
        self.l1_coeff, self.l1_warmup_steps = l1_coeff, l1_warmup_steps
        # With W_enc = W_dec^T and random unit rows, about half the latents fire on any input and their
        # reconstruction along x sums to (d_sae / 2d_in)|x|: 8x the input at expansion 16. Scaled by
        # 2d_in / d_sae it starts at about x instead, so the first steps fit rather than undo an overshoot
        # (on z of norm ~70, unscaled: EV -0.10 after 100 steps; scaled: 0.95).
        with torch.no_grad():
            self.W_enc.mul_(min(1.0, 2 * d_in / d_sae))

    def encode(self, x: Tensor) -> Tensor:
        return torch.relu(self.pre_activation(x))

    def l1_weight(self, step: int) -> float:
        if self.l1_warmup_steps <= 0:
            return self.l1_coeff
        return self.l1_coeff * min(1.0, (step + 1) / self.l1_warmup_steps)

    def loss(self, x: Tensor, step: int) -> tuple[Tensor, dict[str, Tensor], Tensor]:
        recon, f = self(x)
        mse = (recon - x).pow(2).sum(-1).mean()
        l1 = f.abs().sum(-1).mean()
        return mse + self.l1_weight(step) * l1, {"mse": mse, "l1": l1}, (f > 0).sum(0)


SAE = ReluL1SAE
