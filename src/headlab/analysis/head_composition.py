"""Composition of attention heads (Elhage et al. 2021, "A Mathematical Framework for Transformer
Circuits"), from the weights alone, and the low-rank channels between two heads ("Talking Heads",
Merullo et al. 2024).

A writer head w (layer l1) composes with a reader head r (layer l2 > l1) through
    Q:  W_OV(w) @ W_QK(r)      its output enters r's queries      (W_QK = W_Q W_K^T)
    K:  W_OV(w) @ W_QK(r)^T    ... r's keys
    V:  W_OV(w) @ W_OV(r)      ... r's values                     (W_OV = W_V W_O)
and the score is ||left @ right||_F / (||left||_F ||right||_F), as TransformerLens's
`all_composition_scores` computes it. By default on the raw weights (the norms before attention, biases and
rotary stay out); with fold_norms, on the weights TransformerLens's from_pretrained gives by default
(fold_ln, center_writing_weights): each reader's W_Q, W_K, W_V scaled row by row by its attention norm's
scale (1 + weight for Gemma's RMSNorm) and, behind a LayerNorm, centred over d_model, and every W_O centred
over d_model where every attention reads through a LayerNorm; beyond TransformerLens, which leaves them as
modules, the per-head q and k norms' scales (Qwen3, Gemma 3) folded into W_Q and W_K and the attention's
output norm's scale (Gemma 2 and 3) into W_O (TransformerLens centres LayerNorm models only;
an RMSNorm does not remove the mean, so centring would change what the reader sees). Biases never enter the
scores, so folding the LayerNorm bias changes nothing here. Under grouped-query attention a reader's W_K and
W_V are those of its key/value head.

Every matrix is d_model x d_model of rank d_head, so the products are never formed: with left = A B and
right = C D (A, C: [d_model, d_head]; B, D: [d_head, d_model]) and A = Q_A R_A, D^T = Q_D R_D (QR), the
product has the Frobenius norm and the singular values of the d_head x d_head core R_A B C R_D^T. `channels`
are those singular values over ||left|| ||right|| (the squares of all of them sum to the score's square);
channels=0 leaves them out, and with them the SVDs, most of the cost.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..edges.postnorm import attn_out_norm
from ..models.hooked import HookedModel
from ..models.norms import norm_factors

MODES = ("q", "k", "v")


@dataclass
class Composition:
    """Per mode, scores [L, H, L, H] (writer layer, head, reader layer, head; NaN unless writer layer <
    reader layer) and channels [L, H, L, H, c], the largest c normalised singular values."""

    scores: dict[str, Tensor]
    channels: dict[str, Tensor]


def _head_factors(model: HookedModel, layer: int, fold_norms: bool, centre_writes: bool) -> dict[str, Tensor]:
    """The layer's W_Q, W_K, W_V [head, d_model, d_head] (kv weights repeated per query head) and W_O
    [head, d_head, d_model], in float64 (products of four matrices lose digits in float32); with fold_norms,
    processed as the module docstring says."""
    sites = model.sites
    w_q, w_k, w_v = (w.detach().double() for w in sites.W_QKV(layer))
    w_o = sites.W_O(layer).detach().double()
    if fold_norms:
        norm = norm_factors(model.attn_inputs[layer], model.norm_offset)
        if norm.scale is not None:
            scale = norm.scale.double().to(w_q.device)[None, :, None]
            w_q, w_k, w_v = w_q * scale, w_k * scale, w_v * scale
        if norm.centres:
            w_q, w_k, w_v = (w - w.mean(1, keepdim=True) for w in (w_q, w_k, w_v))
        if centre_writes:
            w_o = w_o - w_o.mean(-1, keepdim=True)
        # Gemma 3 and Qwen3 norm each head's q and k, Gemma 2 and 3 each attention's output: their scales
        # (the 1/rms that moves with the input stays out, as the input norm's does)
        for i, module in enumerate((model.q_norms[layer], model.k_norms[layer])):
            qk = norm_factors(module, model.norm_offset).scale
            if qk is not None:
                scaled = (w_q, w_k)[i] * qk.double().to(w_q.device)
                w_q, w_k = (scaled, w_k) if i == 0 else (w_q, scaled)
        out = norm_factors(attn_out_norm(model, layer), model.norm_offset).scale
        if out is not None:
            w_o = w_o * out.double().to(w_o.device)
    group = sites.n_heads // sites.n_kv_heads
    w_k, w_v = w_k.repeat_interleave(group, 0), w_v.repeat_interleave(group, 0)
    return {"q": w_q, "k": w_k, "v": w_v, "o": w_o}


def centres_writes(model: HookedModel) -> bool:
    """Whether fold_norms centres W_O: every attention reads through a norm that removes the mean."""
    return all(norm_factors(module, model.norm_offset).centres for module in model.attn_inputs)


def _r(m: Tensor) -> Tensor:
    return torch.linalg.qr(m, mode="reduced").R


def composition(model: HookedModel, channels: int = 4, fold_norms: bool = False) -> Composition:
    """Q-, K- and V-composition scores and `channels` channels (0: none) of every pair of heads in different
    layers; fold_norms: on TransformerLens's default processing of the weights (the module docstring), else
    on the raw ones."""
    n_layers, n_heads = model.n_layers, model.n_heads
    centre = fold_norms and centres_writes(model)
    factors = [_head_factors(model, layer, fold_norms, centre) for layer in range(n_layers)]
    # left = A B = W_V(w) W_O(w): R of A, and ||left|| = ||R_A B||
    r_v = [_r(f["v"]) for f in factors]
    left_b = [torch.einsum("hij,hjm->him", r, f["o"]) for r, f in zip(r_v, factors)]
    # right = C D per mode: (C, D^T) = Q: (W_Q, W_K), K: (W_K, W_Q), V: (W_V, W_O^T)
    right_cd = {"q": ("q", "k"), "k": ("k", "q"), "v": ("v", "o")}
    shape = (n_layers, n_heads, n_layers, n_heads)
    c = min(channels, model.sites.d_head)
    scores = {m: torch.full(shape, float("nan"), dtype=torch.float64) for m in MODES}
    chans = {m: torch.full((*shape, c), float("nan"), dtype=torch.float64) for m in MODES}
    for mode, (c_name, d_name) in right_cd.items():
        for l2 in range(1, n_layers):
            f = factors[l2]
            d_t = f[d_name] if d_name != "o" else f["o"].transpose(1, 2)  # [head, d_model, d_head]
            r_d = _r(d_t)
            right_c = torch.einsum("hmi,hji->hmj", f[c_name], r_d)  # C R_D^T: [head, d_model, d_head]
            right_norm = torch.linalg.matrix_norm(right_c)  # [reader]
            for l1 in range(l2):
                left_norm = torch.linalg.matrix_norm(left_b[l1])  # [writer]
                core = torch.einsum("wim,rmj->wrij", left_b[l1], right_c)  # [writer, reader, d_head, d_head]
                norms = left_norm[:, None] * right_norm[None, :]  # [writer, reader]
                scores[mode][l1, :, l2, :] = torch.linalg.matrix_norm(core) / norms
                if c:  # the SVDs are most of the cost: only where channels are asked for
                    chans[mode][l1, :, l2, :] = torch.linalg.svdvals(core)[..., :c] / norms[..., None]
    return Composition(scores, chans)
