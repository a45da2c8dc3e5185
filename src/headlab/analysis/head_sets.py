"""Sets of heads that a study masks or ablates together: the top heads by a per-head score, and random
draws of as many heads from outside the top ones (the baseline of Wu et al. 2024's retrieval-head masking
and of the induction study's ablations)."""

from __future__ import annotations

import numpy as np
from torch import Tensor


def top_heads(scores: Tensor, n_heads: int, k: int) -> list[tuple[int, int]]:
    """The k (layer, head) of highest score (layer-major scores; ties to the lower index; NaN last)."""
    order = sorted(range(len(scores)), key=lambda i: (-_finite(float(scores[i])), i))
    return [divmod(i, n_heads) for i in order[:k]]


def _finite(value: float) -> float:
    return value if value == value else float("-inf")  # NaN (a head never scored) ranks last


def random_heads(
    n_layers: int, n_heads: int, avoid: list[tuple[int, int]], k: int, draws: int, seed: int
) -> tuple[list[list[tuple[int, int]]], bool]:
    """`draws` sets of k distinct heads, each drawn (seeded) from the heads not in `avoid` (Wu et al.'s
    code draws random heads outside its top 100 retrieval heads), or from every head when fewer than k
    remain; the flag says whether the avoided heads stayed out."""
    every = [(layer, head) for layer in range(n_layers) for head in range(n_heads)]
    pool = [h for h in every if h not in avoid]
    apart = len(pool) >= k
    pool = pool if apart else every
    rng = np.random.default_rng(seed)
    return [[pool[i] for i in sorted(rng.choice(len(pool), size=k, replace=False))] for _ in range(draws)], apart


def avoided_heads(scores: Tensor, n_heads: int, top_k: int, outside: int) -> list[tuple[int, int]]:
    """The heads random draws stay out of: the top `outside` by score (Wu et al.'s code: 100), as many
    as leave top_k others to draw from on a smaller model, and never fewer than the top_k themselves."""
    return top_heads(scores, n_heads, max(top_k, min(outside, scores.numel() - top_k)))
