"""The SAE architectures by name (sae.architecture), and building one from the SAE config."""

from __future__ import annotations

from ..config import SaeConfig, option
from .base import SparseAutoencoder
from .relu_l1 import ReluL1SAE
from .topk import TopKSAE

ARCHITECTURES: dict[str, type[SparseAutoencoder]] = {"relu_l1": ReluL1SAE, "topk": TopKSAE}


def build_sae(sc: SaeConfig, d_in: int, seed: int = 0) -> SparseAutoencoder:
    arch = option(sc.architecture)
    d_sae = sc.expansion * d_in
    if arch == "relu_l1":
        return ReluL1SAE(d_in, d_sae, seed, l1_coeff=sc.l1_coeff, l1_warmup_steps=sc.l1_warmup_steps)
    return TopKSAE(d_in, d_sae, seed, k=sc.k)
