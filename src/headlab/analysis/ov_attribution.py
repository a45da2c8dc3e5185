"""What a head writes: its output at a position split over the source positions it attends to and the upstream
components that wrote their values, its direct effect on the task's answer, and the tokens its OV circuit maps
tokens to from the weights alone (MAPS).

Split (exact in qk_attribution's sense). Head h's output at query i is sum_j A_ij v_j W_O[h], A the clean pattern;
with the input norm's scale at every source j held (and, on Gemma 2 and 3, the output's share of its layer's
post-norm at i: edges/postnorm.py's `shares`), v_j = sum_c V_c(j), the same components as the query and key
sides (qk_attribution.layer_parts gives V_c). So the output is sum over (j, c) of A_ij V_c(j) W_O[h], and its
direct effect on the task's metric is the same sum of A_ij V_c(j) W_O[h] . u, where u carries a change of the
last residual stream at the read position through the final norm held at its clean scale and the unembedding to
the metric: u = s_f centre(g_f * W_U^T grad), grad the metric's gradient in the logits there (IOI: the logit of
IO minus that of S, so grad = e_IO - e_S and the direct effect is exactly the head's share of the logit
difference; a final logit softcap, Gemma 2's, is left out: the logits are read before it).

`removal` checks the split against the model itself: a component taken out of the residual stream the layer's
attention reads at every position, the clean pattern held (only what the values carry changes), the input
norm's scale held (the head's direct effect changes by that component's total) or free.

MAPS (Elhelo & Geva 2024, "Inferring Functionality of Attention Heads from their Parameters", arXiv 2412.11965;
their code, amitelhelo/MAPS src/maps.py, `get_salient_operations`): the embedding through W_VO into the
unembedding, E W_V W_O W_U, read on TransformerLens's weights (the norms' gains folded in, LayerNorm's centring
kept). Its salient tokens are those the head amplifies most, |e W_VO| / |e| over the vocabulary, and for each
the tokens it maps to most. headlab folds each norm's gain as TransformerLens's fold_ln does (the attention's
input norm into W_V, a post-norm's gain after W_O, the final norm's into W_U) and reads the embedding as the
residual stream receives it (Gemma's sqrt(d_model) scaling: the ratio and the order of targets are unchanged by
it). As MAPS's apply_first_mlp (their default), a head after the first layer reads a token as block 0's MLP
writes it (the MLP's output alone, `first_mlp`); `through_first_mlp=False` reads the embedding for every
layer. The vocabulary is read in chunks
(`chunk` rows at a time): nothing of [vocab x vocab] is ever held, and |e W_VO|^2 is y (W_O W_O^T) y^T with
y = e W_V, so each chunk costs d_model x d_head per token and head.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from jaxtyping import Float
from torch import Tensor, nn

from ..edges import postnorm
from ..errors import UsageError
from ..models.hooked import HookedModel
from ..models.norms import held_norm, norm_factors
from ..tasks import Task, TaskData
from ..vocabulary import Site
from .qk_attribution import Components, LayerParts, run_layer

MAPS_CHUNK = 8192  # vocabulary rows per step


def share_factor(comps: Components, layer: int) -> Tensor | None:
    """[B, T, d]: what a post-norm model multiplies a head's z W_O by at each position (g times that run's
    1/rms of the layer's attention output); None on a model with a residual sum."""
    io = comps.attn_norm_io[layer]
    if io is None:
        return None
    norm = postnorm.attn_norm(comps.model, layer)
    return postnorm.shares(norm, io[0], io[1], torch.ones_like(io[0])[None], comps.model.norm_offset)[0]


def final_held(comps: Components, positions: Tensor):
    """The final norm at the residual stream of each prompt's position ([B]), its scale held."""
    rows = torch.arange(comps.batch)
    x = comps.trace.resid_final[rows, positions.to(rows.device)]
    with torch.no_grad():
        out = comps.model.final_norm(x)
    return held_norm(comps.model.final_norm, x, out, comps.model.norm_offset), out


def adjoint(held, w: Tensor) -> Tensor:
    """u with held.linear(r) . w == r . u for every r (the held norm's transpose)."""
    u = (w if held.gain is None else w * held.gain) * held.scale
    return u - u.mean(-1, keepdim=True) if held.centres else u


def answer_direction(comps: Components, task: Task, data: TaskData) -> tuple[Tensor, Tensor]:
    """(u [B, d], read positions [B]): the residual-stream direction of the task's smooth metric at its one read
    position, through the final norm held at its clean scale and the unembedding (logits before any softcap)."""
    if data.positions.shape[1] != 1:
        raise UsageError(f"task {task.name} reads {data.positions.shape[1]} positions: a direct effect needs one")
    if task.smooth_quantity is None:
        raise UsageError(f"task {task.name} has no smooth metric (a logit difference or a loss) to read effects by")
    column = task.quantities.index(task.smooth_quantity)
    positions = data.positions[:, 0].cpu()
    held, out = final_held(comps, positions)
    unembed = comps.model.unembed
    with torch.enable_grad():
        logits = unembed(out).detach().requires_grad_(True)
        quantity = task.per_prompt(logits[:, None, :], data)[:, column]
        (grad,) = torch.autograd.grad(quantity.sum(), logits)
    w = grad.to(out.dtype) @ weight_of(unembed)
    return adjoint(held, w), positions


def ov_terms(
    comps: Components, parts: LayerParts, layer: int, head: int, b: int, query: int, u: Float[Tensor, " d_model"]
) -> Float[Tensor, "n pos"]:
    """[n, T]: the direct effect (along u [d], a direction at the query's residual stream) of what component c
    wrote into the value at source j, as head `head` carries it to `query`: A_qj V_c(j) W_O[h] . u."""
    kv = comps.model.sites.kv_head_of(head)
    factor = share_factor(comps, layer)
    w = u if factor is None else u * factor[b, query]
    carried = comps.model.sites.W_O(layer)[head].detach() @ w  # [d_head]
    weights = comps.pattern[layer][b, head, query]  # [T]
    return parts.v[:, kv] @ carried * weights[None, :]


def ov_vectors(
    comps: Components, parts: LayerParts, layer: int, head: int, b: int, query: int
) -> Float[Tensor, "n d_model"]:
    """[n, d]: each component's part of the head's output at `query` (what it adds to the residual stream),
    summed over the sources."""
    kv = comps.model.sites.kv_head_of(head)
    weights = comps.pattern[layer][b, head, query]
    out = torch.einsum("j,njd->nd", weights, parts.v[:, kv]) @ comps.model.sites.W_O(layer)[head].detach()
    factor = share_factor(comps, layer)
    return out if factor is None else out * factor[b, query]


def head_effect(
    comps: Components, layer: int, head: int, queries: Tensor, u: Tensor, z: Tensor | None = None
) -> Tensor:
    """[B]: the direct effect along u [B, d] of the head's output at each prompt's query, from z [B, T, H, d_head]
    (default: the clean pass's)."""
    rows = torch.arange(comps.batch)
    z = comps.z[layer] if z is None else z
    out = z[rows, queries, head] @ comps.model.sites.W_O(layer)[head].detach()
    factor = share_factor(comps, layer)
    if factor is not None:
        out = out * factor[rows, queries]
    return (out * u).sum(-1)


@dataclass
class OVRemoval:
    change: Tensor  # [B]: the head's direct effect, clean minus with the component removed from its values
    norm_change: Tensor  # [B]: the input norm's scale, edited / clean - 1, averaged over sources by attention


def removal(
    comps: Components, layer: int, head: int, name: str, queries: Tensor, u: Tensor, held: bool = True
) -> OVRemoval:
    """Component `name` taken out of the residual stream layer `layer`'s attention reads at every position, the
    clean pattern held: what that takes off the head's direct effect at each prompt's query."""
    delta = -comps.contribution(layer, name)
    edited = run_layer(comps, layer, delta, held=held, hold_pattern=True, until=Site.z)
    change = head_effect(comps, layer, head, queries, u) - head_effect(comps, layer, head, queries, u, edited["z"])
    if held:  # the scales are the clean ones by construction
        return OVRemoval(change, torch.zeros_like(change))
    norm = comps.model.attn_inputs[layer]
    clean_in, clean_out = comps.clean(layer)["norm"]
    edited_in, edited_out = edited["norm"]
    offset = comps.model.norm_offset
    before = held_norm(norm, clean_in, clean_out, offset).scale
    moved = (held_norm(norm, edited_in, edited_out, offset).scale / before - 1).squeeze(-1).abs()
    rows = torch.arange(comps.batch)
    weights = comps.pattern[layer][rows, head, queries]  # [B, T]
    return OVRemoval(change, (weights * moved).sum(-1))


# --- MAPS: what the head maps tokens to, from the weights -----------------------------------------------


@dataclass
class Mapping:
    source: int  # token id
    amplification: float  # |e W_VO| / |e|
    targets: list[tuple[int, float]]  # (token id, e W_VO W_U there), largest first


def weight_of(module: nn.Module) -> Tensor:
    """A module's `weight`, detached (an embedding's or the unembedding's [vocab, d_model])."""
    weight = module.weight
    assert isinstance(weight, Tensor)
    return weight.detach()


def embedding(model: HookedModel) -> nn.Module:
    """The module that maps token ids to what the first block receives, position embeddings aside."""
    get = getattr(model.module, "get_input_embeddings", None)
    module = get() if get is not None else getattr(model.module, "embed", None)
    if not isinstance(module, nn.Module):
        raise UsageError(f"{model.name}: headlab does not know its token embedding")
    return module


def _folded(module: nn.Module | None, x: Tensor, offset: float) -> Tensor:
    """x through a norm's weights alone (TransformerLens's fold_ln: the gain, and a LayerNorm's centring)."""
    factors = norm_factors(module, offset)
    if factors.centres:
        x = x - x.mean(-1, keepdim=True)
    return x if factors.scale is None else x * factors.scale.to(x)


def _topk_merge(best: tuple[Tensor, Tensor] | None, values: Tensor, ids: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k largest of best and (values, ids) along the last dimension."""
    if best is not None:
        values, ids = torch.cat([best[0], values], -1), torch.cat([best[1], ids], -1)
    top = values.topk(min(k, values.shape[-1]), dim=-1)
    return top.values, ids.gather(-1, top.indices)


def first_mlp(model: HookedModel, e: Tensor) -> Tensor:
    """MAPS's `first_mlp`: block 0's MLP on its norm of e, its output alone (after its post-norm on Gemma)."""
    mlp, norm = model.mlps[0], model.mlp_inputs[0]
    if mlp is None:
        return e
    out = mlp(e if norm is None else norm(e))
    return out if model.residual_sum else postnorm.mlp_norm(model, 0)(out)


def maps(
    model: HookedModel,
    heads: list[tuple[int, int]],
    salient: int = 5,
    targets: int = 5,
    vocab: Tensor | None = None,
    chunk: int = MAPS_CHUNK,
    through_first_mlp: bool = True,
) -> dict[tuple[int, int], list[Mapping]]:
    """Per head, its `salient` most amplified source tokens among `vocab` (default: every token the tokenizer
    has, else every row of the embedding) and each one's `targets` largest mapped tokens over the whole
    unembedding. `through_first_mlp`: as MAPS's apply_first_mlp, a head after the first layer reads a token as
    block 0's MLP writes it (the embedding itself for heads of layer 0)."""
    embed = embedding(model)
    rows = int(weight_of(embed).shape[0])
    if vocab is None:
        tok = model.tokenizer
        vocab = torch.arange(min(rows, len(tok)) if tok is not None else rows)
    vocab = vocab[vocab < rows]
    sites = model.sites
    device = weight_of(embed).device
    by_layer: dict[int, list[int]] = {}
    for layer, head in heads:
        by_layer.setdefault(layer, []).append(head)
    mlp_first = through_first_mlp and model.mlps[0] is not None

    def sources(ids: Tensor, layer: int, e: Tensor | None = None, e1: Tensor | None = None) -> Tensor:
        e = embed(ids) if e is None else e
        if not mlp_first or layer == 0:
            return e
        return first_mlp(model, e) if e1 is None else e1

    weights = {
        layer: (sites.W_QKV(layer)[2].detach(), sites.W_O(layer).detach()) for layer in by_layer
    }  # [KV, d, d_head], [H, d_head, d]
    grams = {(l, h): weights[l][1][h] @ weights[l][1][h].T for l, h in heads}
    best: dict[tuple[int, int], tuple[Tensor, Tensor] | None] = {h: None for h in heads}
    with torch.no_grad():
        for start in range(0, len(vocab), chunk):  # the chunk outside: block 0's MLP runs once per token
            ids = vocab[start : start + chunk].to(device)
            e = embed(ids)
            e1 = first_mlp(model, e) if mlp_first and any(layer for layer in by_layer) else None
            for layer, mine in by_layer.items():
                x = sources(ids, layer, e, e1)
                size = x.norm(dim=-1).clamp_min(1e-30)
                w_v = weights[layer][0]
                folded = _folded(model.attn_inputs[layer], x, model.norm_offset)
                ys = {kv: folded @ w_v[kv] for kv in sorted({sites.kv_head_of(h) for h in mine})}
                for h in mine:
                    y = ys[sites.kv_head_of(h)]
                    amp = ((y @ grams[(layer, h)]) * y).sum(-1).clamp_min(0).sqrt() / size
                    best[(layer, h)] = _topk_merge(best[(layer, h)], amp, ids, salient)
        return _targets(model, best, sources, targets, chunk)  # type: ignore[arg-type]


def _targets(
    model: HookedModel,
    best: dict[tuple[int, int], tuple[Tensor, Tensor]],
    sources: Callable[[Tensor, int], Tensor],
    k: int,
    chunk: int,
) -> dict[tuple[int, int], list[Mapping]]:
    """Each head's salient sources' k largest entries of e W_VO W_U over the whole unembedding: every head's
    rows in one product per chunk of the vocabulary."""
    sites = model.sites
    rows = []
    for (layer, h), (_, ids) in best.items():
        w_v, w_o = sites.W_QKV(layer)[2].detach(), sites.W_O(layer).detach()
        offset = model.norm_offset
        r = _folded(model.attn_inputs[layer], sources(ids, layer), offset) @ w_v[sites.kv_head_of(h)] @ w_o[h]
        if not model.residual_sum:
            r = _folded(postnorm.attn_norm(model, layer), r, offset)
        rows.append(_folded(model.final_norm, r, offset))
    values, index = top_tokens(model, torch.cat(rows), k, chunk)
    out: dict[tuple[int, int], list[Mapping]] = {}
    at = 0
    for head, (amp, ids) in best.items():
        out[head] = [
            Mapping(int(s), float(a), [(int(t), float(v)) for t, v in zip(index[at + i], values[at + i])])
            for i, (s, a) in enumerate(zip(ids, amp))
        ]
        at += len(ids)
    return out


def top_tokens(model: HookedModel, r: Tensor, k: int, chunk: int = MAPS_CHUNK) -> tuple[Tensor, Tensor]:
    """(values, token ids) [rows, k]: the k largest logits r W_U^T of each row of r [rows, d] over the whole
    unembedding, read `chunk` tokens at a time."""
    unembed = weight_of(model.unembed)
    found = None
    for start in range(0, unembed.shape[0], chunk):
        logits = r @ unembed[start : start + chunk].T
        index = torch.arange(start, start + logits.shape[1], device=logits.device).expand_as(logits)
        found = _topk_merge(found, logits, index, k)
    assert found is not None
    return found
