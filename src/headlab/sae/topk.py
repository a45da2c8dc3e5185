"""TopK SAE (Gao et al. 2024): the k largest pre-activations of each token survive (through a ReLU,
as SAELens's TopK), every other latent is zero; the loss is the squared error alone.

Only k of d_sae latents per token carry a gradient, so neither pass needs to be dense beyond the
encoder's forward product. Autograd through the dense pre-activation would spend two more products of
that size (the grads of W_enc and of x - b_dec), most of it multiplying zeros; TopKEncode's backward
sums over the k survivors alone, and decoding touches only the k active rows of W_dec (an embedding
bag, TopKDecode). Both backwards sort the n k (token, latent) pairs by latent once, in one thread:
torch's own sparse paths (the embedding bag's backward, dense @ sparse) sort them with a parallel
radix sort that stalls for whole time slices whenever another process holds a core, 0.2 s a call on
a shared 2-core machine against 2 ms. SAELens loads it as "topk".
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F

from ..config_rules import COUNT, setting
from .base import SaeConfig, SparseAutoencoder


@contextmanager
def _sparse_csr_beta() -> Iterator[None]:
    with warnings.catch_warnings():  # "sparse CSR support is in beta": the products used here are stable
        warnings.simplefilter("ignore", UserWarning)
        yield


def _sparse_csr(crow: Tensor, col: Tensor, values: Tensor, shape: tuple[int, int]) -> Tensor:
    with _sparse_csr_beta():
        return torch.sparse_csr_tensor(crow, col, values, shape)


class _Pairs:
    """The n k (token, latent) pairs of a top-k selection [n, k], as sparse [n, d_sae] (token-major) and
    [d_sae, n] (latent-major) matrices with any per-pair weights [n, k]."""

    def __init__(self, indices: Tensor, d_sae: int):
        n, k = indices.shape
        self.n, self.k, self.d_sae = n, k, d_sae
        self.flat = indices.reshape(-1)
        # sorting a [1, n k] view keeps torch on its one-thread sort (see the module docstring)
        self.order = self.flat.view(1, -1).sort(dim=1, stable=True).indices.view(-1)
        self.crow_latent = torch.zeros(d_sae + 1, dtype=torch.long, device=indices.device)
        torch.cumsum(torch.bincount(self.flat, minlength=d_sae), 0, out=self.crow_latent[1:])

    def by_token(self, weights: Tensor) -> Tensor:
        crow = torch.arange(0, self.n * self.k + 1, self.k, device=weights.device)
        return _sparse_csr(crow, self.flat, weights.reshape(-1), (self.n, self.d_sae))

    def by_latent(self, weights: Tensor) -> Tensor:
        col = torch.div(self.order, self.k, rounding_mode="floor")
        # index_select, not weights[order]: advanced indexing takes a multi-threaded path that costs ~15 ms
        # here on a shared 2-core machine, index_select 0.02 ms
        in_order = weights.reshape(-1).index_select(0, self.order)
        return _sparse_csr(self.crow_latent, col, in_order, (self.d_sae, self.n))

    def sum_per_latent(self, weights: Tensor, rows: Tensor, transposed: bool = False) -> Tensor:
        """[d_sae, d] (transposed: [d, d_sae]): for each latent, the sum of rows[token] x weights[token, j]
        over the pairs (token, j) that select it. Written by addmm straight into a fresh buffer (beta 0: the
        buffer is never read), in the layout asked for: a plain product would zero its result first and
        a transposed copy would cost twice the product."""
        sparse = self.by_latent(weights)
        if transposed:
            buffer = rows.new_empty(rows.shape[1], self.d_sae)
            torch.addmm(buffer.t(), sparse, rows, beta=0, out=buffer.t())
        else:
            buffer = rows.new_empty(self.d_sae, rows.shape[1])
            torch.addmm(buffer, sparse, rows, beta=0, out=buffer)
        return buffer


class TopKEncode(torch.autograd.Function):
    """(x - b_dec) W_enc + b_enc, its top k per row, through a ReLU -> (values, indices), with a backward
    that visits the k survivors only. It equals autograd through the dense path (tests/test_sae.py):
    the gradient reaching the pre-activation is zero outside the top k and where a top value is <= 0."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, W_enc: Tensor, b_enc: Tensor, b_dec: Tensor, k: int) -> tuple[Tensor, Tensor]:
        centred = x.reshape(-1, x.shape[-1]) - b_dec
        pre = centred @ W_enc
        pre += b_enc  # in place: the same sum as pre_activation's, without another [n, d_sae] tensor
        values, indices = pre.topk(k, dim=-1, sorted=False)
        del pre
        values = torch.relu(values)
        ctx.save_for_backward(centred, W_enc, values, indices)
        ctx.mark_non_differentiable(indices)
        shape = (*x.shape[:-1], k)
        return values.reshape(shape), indices.reshape(shape)

    @staticmethod
    def backward(ctx: Any, grad_values: Tensor, _grad_indices: Any) -> tuple[Tensor | None, ...]:
        centred, W_enc, values, indices = ctx.saved_tensors
        need_x, need_w, need_b_enc, need_b_dec, _ = ctx.needs_input_grad
        grad = grad_values.reshape(values.shape) * (values > 0)  # the ReLU's gradient
        pairs = _Pairs(indices, W_enc.shape[1])
        grad_x = grad_w = grad_b_enc = grad_b_dec = None
        if need_w:  # [d_in, d_sae] from n k rows of x - b_dec, not from an n x d_sae matrix mostly zero
            # in W_enc's own layout, which autograd then keeps as the .grad without a copy
            row_major = W_enc.stride(1) == 1
            grad_w = pairs.sum_per_latent(grad, centred, transposed=row_major)
            grad_w = grad_w if row_major else grad_w.t()
        if need_b_enc or need_b_dec:
            per_latent = torch.zeros(W_enc.shape[1], dtype=grad.dtype, device=grad.device)
            per_latent.index_add_(0, pairs.flat, grad.reshape(-1))
            grad_b_enc = per_latent if need_b_enc else None
            grad_b_dec = -(W_enc @ per_latent) if need_b_dec else None  # the sum over tokens of -grad_x
        if need_x:
            grad_x = (pairs.by_token(grad) @ W_enc.t()).reshape(*grad_values.shape[:-1], W_enc.shape[0])
        return grad_x, grad_w, grad_b_enc, grad_b_dec, None


def _decode_backward(
    values: Tensor, indices: Tensor, W_dec: Tensor, grad_out: Tensor, need_values: bool, need_w: bool, tangent: bool
) -> tuple[Tensor | None, Tensor | None]:
    """(grad of values, grad of W_dec) of sum_j values[t, j] W_dec[indices[t, j]] given grad_out [n, d_in]."""
    pairs = _Pairs(indices, W_dec.shape[0])
    dots = grad_w = None
    if need_values or (need_w and tangent):  # grad_out[t] . W_dec[indices[t, j]] for the n k pairs only
        pattern = pairs.by_token(torch.ones_like(values))
        with _sparse_csr_beta():
            sampled = torch.sparse.sampled_addmm(pattern, grad_out, W_dec.t(), beta=0.0)
        dots = sampled.values().view(values.shape)
    if need_w:
        grad_w = pairs.sum_per_latent(values, grad_out)
        if tangent and dots is not None:
            along = torch.zeros(W_dec.shape[0], dtype=grad_w.dtype, device=grad_w.device)
            along.index_add_(0, pairs.flat, (values * dots).reshape(-1))
            grad_w.addcmul_(along.unsqueeze(1), W_dec, value=-1)
    return (dots if need_values else None), grad_w


class TopKDecode(torch.autograd.Function):
    """sum_j values[.., j] W_dec[indices[.., j]] -> [n, d_in] (no b_dec), the embedding bag with a
    backward that sorts in one thread (module docstring)."""

    @staticmethod
    def forward(ctx: Any, values: Tensor, indices: Tensor, W_dec: Tensor) -> Tensor:
        ctx.save_for_backward(values, indices, W_dec)
        return F.embedding_bag(indices, W_dec, per_sample_weights=values, mode="sum")

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        values, indices, W_dec = ctx.saved_tensors
        need_values, _, need_w = ctx.needs_input_grad
        grad_values, grad_w = _decode_backward(values, indices, W_dec, grad_out, need_values, need_w, tangent=False)
        return grad_values, None, grad_w


class TopKSquaredError(torch.autograd.Function):
    """The TopK loss from the encoder's output: sum over tokens and dimensions of
    (sum_j values[t, j] W_dec[indices[t, j]] + b_dec - x[t])^2, / tokens. One custom op for decoding, the
    residual and its sum of squares (forward and backward): on a shared machine every multi-threaded op
    can wait out another process's time slice, and autograd's chain (add b_dec, sub x, pow, sum, mean and
    their backwards) is a dozen of them.

    tangent=True: W_dec's gradient comes back without its part along each row, g_l - (g_l . w_l) w_l, what
    SparseAutoencoder.remove_parallel_grad takes off afterwards, for less: g_l . w_l is the sum, over the
    pairs (t, j) that select latent l, of values[t, j] (grad_out[t] . w_l), and those dot products are
    values' gradient, computed anyway. One pass over [d_sae, d_in] instead of three."""

    @staticmethod
    def forward(
        ctx: Any, values: Tensor, indices: Tensor, W_dec: Tensor, b_dec: Tensor, x: Tensor, tangent: bool
    ) -> Tensor:
        residual = F.embedding_bag(indices, W_dec, per_sample_weights=values, mode="sum")
        residual.sub_(x).add_(b_dec)
        ctx.save_for_backward(values, indices, W_dec, residual)
        ctx.tangent = tangent
        return torch.linalg.vector_norm(residual).square() / residual.shape[0]

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Tensor | None, ...]:
        values, indices, W_dec, residual = ctx.saved_tensors
        need_values, _, need_w, need_b_dec, need_x, _ = ctx.needs_input_grad
        grad_out = residual * (grad_loss * (2.0 / residual.shape[0]))
        grad_values, grad_w = _decode_backward(values, indices, W_dec, grad_out, need_values, need_w, ctx.tangent)
        grad_b_dec = grad_out.sum(0) if need_b_dec else None
        grad_x = -grad_out if need_x else None
        return grad_values, None, grad_w, grad_b_dec, grad_x, None


@dataclass
class TopKConfig(SaeConfig):
    architecture: str = "topk"
    k: int = setting(8, COUNT)  # latents active per token


class TopKSAE(SparseAutoencoder):
    architecture = "topk"
    saelens_architecture = "topk"
    options = TopKConfig

    @classmethod
    def build(cls, d_in: int, options: SaeConfig, seed: int = 0) -> SparseAutoencoder:
        assert isinstance(options, TopKConfig)
        return cls(d_in, options.expansion * d_in, seed, k=options.k)

    fit_loss_grad_tangent = True  # TopKSquaredError(tangent=True)

    def __init__(self, d_in: int, d_sae: int, seed: int = 0, k: int = 8):
        super().__init__(d_in, d_sae, seed)
        if not 0 < k <= d_sae:
            raise ValueError(f"topk SAE: k must be in 1..d_sae ({d_sae}), not {k}")
        self.k = k

    def top(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(values [..., k] after ReLU, latent indices [..., k])."""
        values, indices = TopKEncode.apply(x, self.W_enc, self.b_enc, self.b_dec, self.k)
        return values, indices

    def encode(self, x: Tensor) -> Tensor:
        values, indices = self.top(x)
        return torch.zeros(*x.shape[:-1], self.d_sae, dtype=values.dtype, device=x.device).scatter(-1, indices, values)

    def decode_sparse(self, values: Tensor, indices: Tensor) -> Tensor:
        out = TopKDecode.apply(values.reshape(-1, self.k), indices.reshape(-1, self.k), self.W_dec)
        return out.reshape(*values.shape[:-1], self.d_in) + self.b_dec

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        values, indices = self.top(x)
        f = torch.zeros(*x.shape[:-1], self.d_sae, dtype=values.dtype, device=x.device).scatter(-1, indices, values)
        return self.decode_sparse(values, indices), f

    def loss(self, x: Tensor, step: int) -> tuple[Tensor, dict[str, Tensor], Tensor]:
        return self._loss(x, tangent=False)

    def fit_loss(self, x: Tensor, step: int) -> tuple[Tensor, dict[str, Tensor], Tensor]:
        return self._loss(x, tangent=True)

    def _loss(self, x: Tensor, tangent: bool) -> tuple[Tensor, dict[str, Tensor], Tensor]:
        """(squared error summed over dimensions, mean over tokens; its parts; fires)."""
        x = x.reshape(-1, self.d_in)
        values, indices = self.top(x)
        mse = TopKSquaredError.apply(values, indices, self.W_dec, self.b_dec, x, tangent)
        # a top value <= 0 did not fire: counted in a spare bin rather than picked out by a boolean mask
        # (a multi-threaded compaction)
        silent = indices.masked_fill(values.detach() <= 0, self.d_sae)
        fires = torch.bincount(silent.reshape(-1), minlength=self.d_sae + 1)[: self.d_sae]
        return mse, {"mse": mse}, fires

    def saelens_fields(self) -> dict:
        return {"k": self.k, "rescale_acts_by_decoder_norm": False}


SAE = TopKSAE
