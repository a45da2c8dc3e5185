"""The deep multi-head attention network with linear values of Tiberi et al. (arXiv 2405.15926, Sec. 2).

    z0      = V0 x / sqrt(D)                                        V0: [N, D]
    z_l     = sum_h V_l^h z_{l-1} A_l^h / sqrt(H_l N)               V_l^h: [N, N], l = 1..L
    f(x)    = a . z_L[query = last token] / sqrt(N)                 a: [N]

No residual, no nonlinearity. Every attention A_l^h = softmax over keys of beta * x_s^T W_l^h x_t is
computed from the raw input x with a fixed template W (full attention, BOS is a key), so the network is
linear in each weight block and the input reaches the output only along attention paths
pi = (h_1, ..., h_L): f = sum_pi e_pi . V0 x_pi / sqrt(N D H), with x_pi = x mixed by A_1^{h1} ... A_L^{hL}
(the path's effective input), e_pi = a V_L^{hL} ... V_1^{h1} / N^{L/2} (the path's effective weights)
and H = prod_l H_l paths. Paths are numbered with h_1 as the major index.

Head templates (D = features + positions, q = (v+ - v-) / n_features):
- same_token: features q q^T, positions 1 from the previous token to its successor, 1.5 from BOS to every
  query: a query attends to the previous token when both are in the same hidden state, else to BOS.
- uniform: every score equal: attention spread evenly over all tokens.
- random: Gaussian features (std 1/n_features), positions (std 1) and feature-position cross terms
  (std 1/sqrt(n_features)), each times random_strength: a sharp head with no relation to the task.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..config_rules import COUNT, HEAD_KINDS, NATURAL, NON_NEGATIVE, POSITIVE, Each, OneOf, setting
from ..errors import UsageError
from .loading import ModelConfig, ModelKind


@dataclass
class PathNetConfig(ModelConfig):
    """The attention network of Tiberi et al. (models/pathnet.py), learned by Bayes and by gradient descent."""

    name: str = "pathnet"
    kind: ModelKind = ModelKind.pathnet
    width: int = setting(100, COUNT)  # N, every layer's and the readout's
    heads: list[list[str]] = setting(
        factory=lambda: [["same_token", "random"], ["uniform", "random"]], rule=Each(OneOf(HEAD_KINDS))
    )
    beta: float = setting(10.0, POSITIVE)  # inverse softmax temperature of every head template
    head_seed: int = 7  # random heads' templates
    random_strength: float = setting(1.0, NON_NEGATIVE)
    # prior variances: input, each layer, readout (default all 1)
    variances: list[float] | None = setting(None, Each(POSITIVE))
    temperature: float = setting(0.01, POSITIVE)  # the likelihood's variance
    # named path subsets ("h1-h2", head index per layer) whose GP-limit predictor is reported too
    reference_paths: dict[str, list[str]] = field(default_factory=dict)
    theory_tol: float = setting(1e-7, POSITIVE)  # stop when every |dS/dU| is below
    theory_steps: int = setting(5_000, COUNT)  # L-BFGS iterations at most
    samples: int = setting(100, NATURAL)  # HMC draws kept (0: no sampling)
    collapse_input: bool = True  # integrate V0 out exactly (f is linear in it) and sample the rest
    warmup: int = setting(100, NATURAL)  # HMC draws that tune the step size, discarded
    # HMC trajectory length; pi/2 turns a prior-dominated direction a quarter period
    trajectory: float = setting(1.5, POSITIVE)
    max_leapfrog: int = setting(512, COUNT)
    # all-weights sampling (collapse_input=false); collapsed runs in float64
    sample_dtype: str = setting("float32", OneOf(("float32", "float64")))
    alignment_top: int = setting(30, COUNT)  # principal components of the kernel compared with the labels


BOS_SCORE = 1.5  # between a same-state (2) and a different-state (0) previous token


def options() -> list[tuple[str, str, type]]:
    return [("model", "pathnet", PathNetConfig)]


def head_template(kind: str, n_features: int, n_tokens: int, gen: torch.Generator, random_strength: float) -> Tensor:
    """W [D, D] of one head; scores are x_key^T W x_query."""
    dims = n_features + n_tokens
    w = torch.zeros(dims, dims, dtype=torch.float64)
    features, positions = slice(0, n_features), slice(n_features, dims)
    if kind == "same_token":
        half = n_features // 2
        q = torch.cat([torch.ones(half), -torch.ones(half)]).double() * 2**0.5 / n_features
        w[features, features] = torch.outer(q, q)
        pos = torch.zeros(n_tokens, n_tokens, dtype=torch.float64)
        pos[torch.arange(1, n_tokens - 1), torch.arange(2, n_tokens)] = 1.0
        pos[0, 1:] = BOS_SCORE
        w[positions, positions] = pos
    elif kind == "uniform":
        w[positions, positions] = 1.0
    elif kind == "random":
        s = random_strength
        w[features, features] = s * torch.randn(n_features, n_features, generator=gen, dtype=torch.float64) / n_features
        w[positions, positions] = s * torch.randn(n_tokens, n_tokens, generator=gen, dtype=torch.float64)
        cross = s * torch.randn(dims, dims, generator=gen, dtype=torch.float64) / n_features**0.5
        w[features, positions] += cross[features, positions]
        w[positions, features] += cross[positions, features]
    else:
        raise UsageError(f"unknown pathnet head '{kind}'; choose from: {', '.join(HEAD_KINDS)}")
    return w


def path_tuples(heads_per_layer: list[int]) -> list[tuple[int, ...]]:
    """(h_1, ..., h_L) per path index, h_1 major."""
    return list(itertools.product(*(range(h) for h in heads_per_layer)))


@dataclass
class PathNet:
    """Structure (heads, templates) of the network; weights live apart, in a dict (see init_weights)."""

    heads: list[list[str]]  # head kinds per layer
    templates: list[Tensor]  # per layer [H_l, D, D], beta included
    width: int
    variances: list[float]  # sigma_0^2, sigma_1^2 .. sigma_L^2, sigma_a^2

    @classmethod
    def build(
        cls,
        heads,
        n_features: int,
        n_tokens: int,
        width: int,
        beta: float,
        variances,
        head_seed: int = 0,
        random_strength: float = 1.0,
    ) -> PathNet:
        heads = [list(layer) for layer in heads]
        if not heads or any(not layer for layer in heads):
            raise UsageError("model.heads needs at least one layer with at least one head")
        if len(variances) != len(heads) + 2:
            raise UsageError(
                f"model.variances needs {len(heads) + 2} values (input, each layer, readout), not {len(variances)}"
            )
        gen = torch.Generator().manual_seed(head_seed)
        templates = [
            beta * torch.stack([head_template(k, n_features, n_tokens, gen, random_strength) for k in layer])
            for layer in heads
        ]
        return cls(heads, templates, width, [float(v) for v in variances])

    @property
    def n_layers(self) -> int:
        return len(self.heads)

    @property
    def heads_per_layer(self) -> list[int]:
        return [len(layer) for layer in self.heads]

    @property
    def n_paths(self) -> int:
        return int(torch.tensor(self.heads_per_layer).prod())

    def paths(self) -> list[tuple[int, ...]]:
        return path_tuples(self.heads_per_layer)

    def path_label(self, path: tuple[int, ...]) -> str:
        return ">".join(f"{self.heads[l][h]}{h}" for l, h in enumerate(path))

    def attention(self, x: Tensor) -> list[Tensor]:
        """Per layer [n, H_l, query, key]; the last layer keeps only the last query: [n, H_L, 1, key]."""
        out = []
        for l, w in enumerate(self.templates):
            queries = x[:, -1:] if l == self.n_layers - 1 else x
            scores = torch.einsum("nsi,hij,ntj->nhts", x, w, queries)
            out.append(scores.softmax(-1))
        return out

    def path_inputs(self, x: Tensor) -> Tensor:
        """x_pi [n, paths, D]: each path's mix of tokens, read at the last query of the last layer."""
        attn = self.attention(x)
        mix = attn[-1][:, :, 0]  # [n, H_L, key]
        for a in reversed(attn[:-1]):  # prepend h_l as the major index
            mix = torch.einsum("nrt,nhts->nhrs", mix, a).flatten(1, 2)
        return torch.einsum("nps,nsd->npd", mix, x)

    # ------------------------------------------------------------------ weights

    def init_weights(self, gen: torch.Generator, dtype=torch.float64) -> dict[str, Tensor]:
        """A draw from the Gaussian prior."""
        n, dims = self.width, self.templates[0].shape[-1]
        std = [v**0.5 for v in self.variances]
        weights = {"V0": std[0] * torch.randn(n, dims, generator=gen, dtype=dtype)}
        for l, h in enumerate(self.heads_per_layer, 1):
            weights[f"V{l}"] = std[l] * torch.randn(h, n, n, generator=gen, dtype=dtype)
        weights["a"] = std[-1] * torch.randn(n, generator=gen, dtype=dtype)
        return weights

    def prior_variance(self, name: str) -> float:
        return self.variances[-1] if name == "a" else self.variances[int(name[1:])]

    def effective_weights(self, weights: dict[str, Tensor]) -> Tensor:
        """e_pi [paths, N] = a V_L^{hL} ... V_1^{h1} / N^{L/2}."""
        e = weights["a"][None]  # the readout's own 1/sqrt(N) goes with V0 (see forward_paths)
        for l in range(self.n_layers, 0, -1):
            e = torch.einsum("ri,hij->hrj", e, weights[f"V{l}"]).flatten(0, 1) / self.width**0.5
        return e

    def path_outputs(self, weights: dict[str, Tensor], x_paths: Tensor) -> Tensor:
        """Each path's term of f [n, paths], from path inputs [n, paths, D]."""
        w = self.effective_weights(weights) @ weights["V0"]  # [paths, D]
        dims = x_paths.shape[-1]
        return torch.einsum("npd,pd->np", x_paths.to(w.dtype), w) / (self.width * dims * self.n_paths) ** 0.5

    def forward_paths(self, weights: dict[str, Tensor], x_paths: Tensor) -> Tensor:
        """f [n] along paths: the same function as forward."""
        return self.path_outputs(weights, x_paths).sum(-1)

    def forward(self, weights: dict[str, Tensor], x: Tensor) -> Tensor:
        """f [n], layer by layer as the network is written (the reference for forward_paths)."""
        attn = self.attention(x)
        n, dims = self.width, x.shape[-1]
        z = x.to(weights["V0"].dtype) @ weights["V0"].T / dims**0.5  # [n, tokens, N]
        for l, a in enumerate(attn, 1):
            v = weights[f"V{l}"]
            z = torch.einsum("nhts,nsj,hij->nti", a.to(z.dtype), z, v) / (v.shape[0] * n) ** 0.5
        return z[:, -1] @ weights["a"] / n**0.5
