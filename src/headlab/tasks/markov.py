"""Hidden Markov chain classification (Tiberi et al., NeurIPS 2024, arXiv 2405.15926, Sec. 4.1).

A two-state chain of n_steps tokens after a BOS token. Label +1: the chain stays in its state with
probability p_stay_plus (persistent); label -1: with p_stay_minus (alternating). The first state is + or -
with equal odds. Token t shows v(s_t) + noise in n_features dimensions, v+ = sqrt(2)[1, 0] and
v- = sqrt(2)[0, 1] in halves, so |v|^2 = n_features; BOS shows zeros. Noise has its own strength along
(v+ - v-) (the direction that tells the states apart), along (v+ + v-), and in the orthogonal complement
(the paper's "perpendicular" noise). A one-hot position follows the features: a token has
n_features + n_steps + 1 dimensions. The label is only in the statistics of state changes, so a model must
compare neighbouring tokens: an attention head that attends to the previous token when it is in the same
state is the "good" head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..config_rules import COUNT, NON_NEGATIVE, SHARE, setting
from ..errors import UsageError
from .base import Task, TaskConfig


@dataclass
class MarkovConfig(TaskConfig):
    name: str = "markov"
    n_prompts: int = 1000  # test chains
    n_train: int = setting(100, COUNT)
    n_steps: int = setting(30, COUNT)
    n_features: int = setting(200, COUNT)
    p_stay_plus: float = setting(0.7, SHARE)  # label +1: probability of staying in the state
    p_stay_minus: float = setting(0.3, SHARE)  # label -1
    noise_label: float = setting(1.0, NON_NEGATIVE)  # noise strength along v+ - v-
    noise_common: float = setting(1.0, NON_NEGATIVE)  # along v+ + v-
    noise_orthogonal: float = setting(1.0, NON_NEGATIVE)  # in the complement of both (the paper's perpendicular noise)


@dataclass
class MarkovData:
    x: Tensor  # [n, tokens, dims] float64: features then one-hot position; token 0 is BOS
    y: Tensor  # [n] +1 (persistent) / -1 (alternating)
    states: Tensor  # [n, n_steps] +1 / -1, the hidden chain

    @property
    def n(self) -> int:
        return self.y.shape[0]


class MarkovTask(Task):
    name = "markov"
    options = MarkovConfig
    quantities = ()
    aggregates: dict = {}
    cfg: MarkovConfig

    def __init__(self, cfg: MarkovConfig):
        self.cfg = cfg
        if cfg.n_features % 2 or cfg.n_features < 2:
            raise UsageError(f"task.n_features must be even and positive, not {cfg.n_features}")
        for key in ("p_stay_plus", "p_stay_minus"):
            if not 0.0 <= getattr(cfg, key) <= 1.0:
                raise UsageError(f"task.{key} must lie in [0, 1], not {getattr(cfg, key)}")
        self.n_tokens = cfg.n_steps + 1
        self.dims = cfg.n_features + self.n_tokens

    def build(self, n, seed, model=None):
        raise UsageError("task markov runs on model=pathnet (a sequence classifier, not a language model)")

    def state_vectors(self) -> tuple[Tensor, Tensor]:
        half = self.cfg.n_features // 2
        ones, zeros = torch.ones(half, dtype=torch.float64), torch.zeros(half, dtype=torch.float64)
        return 2**0.5 * torch.cat([ones, zeros]), 2**0.5 * torch.cat([zeros, ones])

    def sample(self, n: int, seed: int) -> MarkovData:
        """n chains, the first half persistent (+1), the rest alternating (-1)."""
        cfg, gen = self.cfg, torch.Generator().manual_seed(seed)
        y = torch.cat([torch.ones(n - n // 2), -torch.ones(n // 2)]).double()
        p_stay = torch.where(y > 0, cfg.p_stay_plus, cfg.p_stay_minus).double()
        first = torch.where(torch.rand(n, generator=gen, dtype=torch.float64) < 0.5, 1.0, -1.0).double()
        stays = torch.rand(n, cfg.n_steps - 1, generator=gen, dtype=torch.float64) < p_stay[:, None]
        flips = torch.where(stays, 1.0, -1.0).double()
        states = first[:, None] * torch.cat([torch.ones(n, 1, dtype=torch.float64), flips.cumprod(1)], 1)
        v_plus, v_minus = self.state_vectors()
        features = torch.where(states[..., None] > 0, v_plus, v_minus)  # [n, steps, features]
        features = features + self._noise(torch.randn(features.shape, generator=gen, dtype=torch.float64))
        features = torch.cat([torch.zeros(n, 1, cfg.n_features, dtype=torch.float64), features], 1)
        positions = torch.eye(self.n_tokens, dtype=torch.float64).expand(n, -1, -1)
        return MarkovData(torch.cat([features, positions], -1), y, states)

    def _noise(self, white: Tensor) -> Tensor:
        v_plus, v_minus = self.state_vectors()
        label_dir = (v_plus - v_minus) / (v_plus - v_minus).norm()
        common_dir = (v_plus + v_minus) / (v_plus + v_minus).norm()
        along_label = (white @ label_dir)[..., None] * label_dir
        along_common = (white @ common_dir)[..., None] * common_dir
        orthogonal = white - along_label - along_common
        cfg = self.cfg
        return cfg.noise_label * along_label + cfg.noise_common * along_common + cfg.noise_orthogonal * orthogonal


TASK = MarkovTask  # found by tasks/registry.py
