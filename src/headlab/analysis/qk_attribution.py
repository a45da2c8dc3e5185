"""Why a head attends where it does: its pre-softmax score split exactly over pairs of upstream components.

For head h of layer l and a query-key pair (i, j) the score is

    s_ij = scale * < R_i n_q(W_Q N(x)_i + b_Q),  R_j n_k(W_K N(x)_j + b_K) >

x the residual stream the attention reads, N its input norm, n_q / n_k the per-head QK-norm (Qwen3, Gemma 3),
R_i the rotary rotation at position i (none on GPT-2) and scale the attention's own (1/sqrt(d_head); Gemma's
query_pre_attn_scalar**-0.5). Hold the norms' scales (1/rms, or 1/std after a LayerNorm's centring, which is
linear; QK-norm's 1/rms per head and position) at their clean values and everything between x and the rotated
q and k is linear. x is a sum of components: the embedding (token and learned position embeddings, Gemma's
sqrt(d_model) scaling included), each earlier head's output z_h W_O[h] (on a model that norms each component's
output, Gemma 2 and 3: its share of its layer's normed output at that run's scale, edges/postnorm.py's rule
`shares`), each earlier MLP's output (after its post-norm there) and the attention output biases. So

    s_ij = sum over (c, c') of scale * < Q_c(i), K_c'(j) >

over query-side components c and key-side components c', exactly: the terms add up to the score, to rounding.
The component "bias" holds every constant: the earlier layers' b_O in x, the input LayerNorm's bias (GPT-2) and
b_Q / b_K (GPT-2, Qwen2). On Gemma 2 the score is split before its softcap (tanh(s / cap) * cap is not a sum);
the score reported is the one inside the tanh.

How it is computed (`layer_parts`): the layer's own block runs once per prompt on a batch whose rows are each
component's contribution to x, put through the input norm at the clean scale, and, last, the clean normed input;
a forward hook hands that batch to the attention in place of the norm's output, the projections' biases are taken
off every component row (the "bias" row and the clean row keep them), QK-norm is held at the clean row's scale,
and the head sites record q, k and v after the model's own rotary code: so every family's projection layout,
partial rotary and grouped-query sharing are the model's own. The clean row is the model's clean q, k and v; the
rows before it add up to it. `removal` checks a term against an intervention on the model itself: the
component taken out of the residual stream the attention reads at one position, the norms' scales held (the
change in the score equals that component's side total) or free (how far the scales move).

Component contributions come from one clean pass (`record`): z, the pattern, each MLP's output and, on a
post-norm model, each layer's attention output before and after its norm.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import cached_property

import torch
from jaxtyping import Float
from torch import Tensor, nn

from ..edges import postnorm
from ..errors import UsageError
from ..models.hooked import HookedModel, Inputs, Trace
from ..models.norms import held_norm, norm_factors
from ..tables import head_name
from ..vocabulary import Site

EMBED = "embed"
BIAS = "bias"
SIDES = ("query", "key")


def mlp_name(layer: int) -> str:
    return f"MLP{int(layer)}"


class _Stop(Exception):
    """Raised by a hook to end a pass once what it needs is recorded."""


# --- the norms' scales, held (models/norms.held_norm) ---------------------------------------------------


def qk_norms(model: HookedModel, layer: int) -> tuple[nn.Module | None, nn.Module | None]:
    """The attention's per-head query and key norms (Qwen3, Gemma 3), else None."""
    return model.q_norms[layer], model.k_norms[layer]


def norms_move(model: HookedModel) -> bool:
    """Does the model hold norms whose scales a removed component moves far beyond the input norm's (QK-norm,
    or post-norms on its components' outputs)? There the split, exact at the clean run's scales, can sit far
    from what removing a component does with the scales free."""
    return not model.residual_sum or any(any(m is not None for m in qk_norms(model, l)) for l in range(model.n_layers))


def attention_scale(model: HookedModel, layer: int) -> float:
    """What the layer's attention multiplies q.k by: the module's own `scaling` (Gemma: query_pre_attn_scalar**-0.5,
    GPT-2: with its per-layer factor), else 1/sqrt(d_head) (the toy models)."""
    return model.attn_scales[layer]


def check_model(model: HookedModel) -> None:
    """Refused in one line where the split is not defined."""
    if any(module is None for module in model.attn_inputs):
        raise UsageError(f"{model.name}: its attention reads the residual stream through no norm headlab can hold")
    if not model.residual_sum:
        postnorm.check_rule(model, "shares")  # Gemma 2 and 3; OLMo 2 and unknown post-norm families refused
    for layer in range(model.n_layers):
        q_norm, _ = qk_norms(model, layer)
        scale = norm_factors(q_norm, model.norm_offset).scale
        if scale is not None and scale.shape[-1] != model.sites.d_head:
            width = scale.shape[-1]
            raise UsageError(f"{model.name}: its q/k norms span every head ({width} wide), not one head's d_head")


# --- the clean pass's components ---------------------------------------------------------------------


@dataclass
class Components:
    """One clean pass over `inputs`, enough to give each component's contribution to every layer's input."""

    model: HookedModel
    inputs: Inputs
    trace: Trace
    z: list[Tensor]  # per layer [B, T, H, d_head]
    pattern: list[Tensor]  # per layer [B, H, T, T]
    mlp: list[Tensor | None]  # per layer [B, T, d]: what the MLP adds to the residual stream
    attn_norm_io: list[tuple[Tensor, Tensor] | None]  # post-norm models: per layer (A, post_attn(A))
    error: float = 0.0  # the largest |sum of components - residual stream| over every layer's input, relative
    _clean: dict[int, dict] = field(default_factory=dict)
    _stacked: tuple[int, int, Tensor] | None = None  # (prompt, layer, its components without the bias row)

    @property
    def batch(self) -> int:
        return self.trace.batch

    @cached_property
    def out_biases(self) -> list[Tensor | None]:
        """Per layer the attention output projection's bias (GPT-2's b_O), else None."""
        found: list[Tensor | None] = []
        projs: list[nn.Module | None] = list(self.model.sites.out_projs or [])
        projs += [None] * (self.model.n_layers - len(projs))
        for proj in projs:
            bias = getattr(proj, "bias", None)
            found.append(bias.detach() if isinstance(bias, Tensor) else None)
        return found

    def names(self, layer: int) -> list[str]:
        """The components of layer `layer`'s input, in the order of `stack`'s rows: the embedding, each earlier
        layer's heads and MLP, then "bias"."""
        out = [EMBED]
        for l in range(layer):
            out += [head_name(l, h) for h in range(self.model.n_heads)]
            if self.mlp[l] is not None:
                out.append(mlp_name(l))
        return [*out, BIAS]

    def heads(self, layer: int, rows: slice | int = slice(None)) -> Tensor:
        """[H, b, T, d]: what each head of `layer` adds to the residual stream on prompts `rows`."""
        single = isinstance(rows, int)
        pick = slice(rows, rows + 1) if isinstance(rows, int) else rows
        w_o = self.model.sites.W_O(layer).detach()
        r = torch.einsum("bthe,hed->hbtd", self.z[layer][pick], w_o)
        io = self.attn_norm_io[layer]
        if io is not None:
            norm = postnorm.attn_norm(self.model, layer)
            before, after = io[0][pick], io[1][pick]
            r = postnorm.shares(norm, before, after, r, self.model.norm_offset)
        return r[:, 0] if single else r

    def bias(self, layer: int) -> Tensor:
        """[d]: the attention output biases of the layers before `layer` (zero where none)."""
        d = self.model.sites.d_model
        total = self.trace.resid_pre[0].new_zeros(d)
        for b_o in self.out_biases[:layer]:
            if b_o is not None:
                total = total + b_o.to(total)
        return total

    def stack(self, layer: int, b: int) -> Tensor:
        """[n, T, d]: prompt b's components of layer `layer`'s input, rows as `names` (the bias row is the
        output biases in the residual stream, broadcast over positions). The last prompt's stack is kept: a
        layer before it takes its first rows (`names` of an earlier layer are a prefix)."""
        kept = self._stacked
        if kept is None or kept[0] != b or kept[1] < layer:
            rows = [self.trace.resid_pre[0][b][None]]
            for l in range(layer):
                rows.append(self.heads(l, b))
                mlp = self.mlp[l]
                if mlp is not None:
                    rows.append(mlp[b][None])
            kept = self._stacked = (b, layer, torch.cat(rows))
        components = kept[2][: len(self.names(layer)) - 1]
        return torch.cat([components, self.bias(layer).expand_as(components[:1])])

    def contribution(self, layer: int, name: str) -> Tensor:
        """[B, T, d]: one component of layer `layer`'s input, on every prompt."""
        if name == EMBED:
            return self.trace.resid_pre[0]
        if name == BIAS:
            return self.bias(layer).expand_as(self.trace.resid_pre[0])
        if name.startswith("MLP"):
            return self.mlp[int(name[3:])]  # type: ignore[return-value]
        l, h = (int(x) for x in name[1:].split("H"))
        return self.heads(l)[h]

    def clean(self, layer: int) -> dict:
        """The clean pass up to layer `layer`'s values: its q, k, v and its norms' inputs and outputs."""
        if layer not in self._clean:
            self._clean[layer] = run_layer(self, layer)
        return self._clean[layer]


def record(model: HookedModel, inputs: Inputs) -> Components:
    """One clean pass keeping what `Components` needs; refused in one line on a model the split does not cover."""
    check_model(model)
    mlp: list[Tensor | None] = [None] * model.n_layers
    io: list[tuple[Tensor, Tensor] | None] = [None] * model.n_layers
    post = not model.residual_sum

    def keep_mlp(layer: int) -> Callable:
        def hook(*args: object) -> None:
            out = args[-1]
            assert isinstance(out, Tensor)
            mlp[layer] = out.detach()

        return hook

    def keep_attn(layer: int) -> Callable:
        def hook(_module: nn.Module, args: tuple, out: Tensor) -> None:
            io[layer] = (args[0].detach(), out.detach())

        return hook

    with torch.no_grad(), ExitStack() as stack:
        store = stack.enter_context(model.sites.record((Site.z, Site.pattern)))
        for layer in range(model.n_layers):
            handles = []
            if post:
                handles.append(postnorm.attn_norm(model, layer).register_forward_hook(keep_attn(layer)))
                handles.append(postnorm.mlp_norm(model, layer).register_forward_hook(keep_mlp(layer)))
            elif model.mlps[layer] is not None:
                handles.append(model.mlps[layer].register_forward_hook(keep_mlp(layer)))  # type: ignore[union-attr]
            for handle in handles:
                stack.callback(handle.remove)
        trace = model.trace(inputs)
    z = [store[(Site.z, l)].detach() for l in range(model.n_layers)]
    pattern = [store[(Site.pattern, l)].detach() for l in range(model.n_layers)]
    comps = Components(model, inputs, trace, z, pattern, mlp, io)
    comps.error = _sum_error(comps)
    return comps


def _sum_error(comps: Components) -> float:
    """The largest gap between a layer's input (and the last block's output) and the sum of its components,
    relative to the largest entry of that residual stream."""
    model, trace = comps.model, comps.trace
    with torch.no_grad():
        running = trace.resid_pre[0].clone()
        worst = 0.0
        for layer in range(model.n_layers):
            target = trace.resid_pre[layer]
            worst = max(worst, float((running - target).abs().max() / target.abs().max().clamp_min(1e-30)))
            io = comps.attn_norm_io[layer]
            if io is not None:
                running = running + io[1]
            else:
                running = running + comps.heads(layer).sum(0)
                b_o = comps.out_biases[layer]
                if b_o is not None:
                    running = running + b_o
            mlp = comps.mlp[layer]
            if mlp is not None:
                running = running + mlp
        final = trace.resid_final
        return max(worst, float((running - final).abs().max() / final.abs().max().clamp_min(1e-30)))


# --- the layer's q, k and v per component ------------------------------------------------------------


@dataclass
class LayerParts:
    """One prompt's q, k and v of one layer split over the components of its input (rows as `names`, the
    "bias" row last), and the clean q, k, v the same block computes from the clean input."""

    names: list[str]
    q: Float[Tensor, "n head pos d_head"]  # after the held norms and the model's rotary
    k: Float[Tensor, "n kv pos d_head"]
    v: Float[Tensor, "n kv pos d_head"]
    clean_q: Float[Tensor, "head pos d_head"]
    clean_k: Float[Tensor, "kv pos d_head"]
    clean_v: Float[Tensor, "kv pos d_head"]
    scale: float

    def terms(self, head: int, kv_head: int, query: int, key: int) -> Float[Tensor, "n n"]:
        """[n, n]: scale * <Q_c(query), K_c'(key)>, query-side components down, key-side across."""
        return self.scale * self.q[:, head, query] @ self.k[:, kv_head, key].T

    def score(self, head: int, kv_head: int, query: int, key: int) -> Float[Tensor, ""]:
        """The clean pre-softmax score (before any softcap)."""
        return self.scale * self.clean_q[head, query] @ self.clean_k[kv_head, key]


def prompt_extra(trace: Trace, layer: int, b: int) -> tuple[tuple, dict]:
    """The block's extra arguments (masks, rotary tables, position ids) for prompt b alone: batch-shaped
    tensors sliced to its row (batch 1 broadcasts over the component rows)."""
    args, kwargs = trace.block_extra[layer]
    if trace.batch == 1:
        return args, kwargs

    def pick(obj: object) -> object:
        if isinstance(obj, Tensor):
            return obj[b : b + 1] if obj.dim() >= 2 and obj.shape[0] == trace.batch else obj
        if isinstance(obj, (tuple, list)):
            return type(obj)(pick(o) for o in obj)
        if isinstance(obj, dict):
            return {k: pick(v) for k, v in obj.items()}
        return obj

    return tuple(pick(a) for a in args), {k: pick(v) for k, v in kwargs.items()}


def layer_parts(comps: Components, layer: int, b: int) -> LayerParts:
    """Prompt b's q, k, v of layer `layer` per component of its input (the module docstring says how)."""
    model = comps.model
    names = comps.names(layer)
    with torch.no_grad():
        rows = comps.stack(layer, b)  # [n, T, d]
        n = rows.shape[0]
        norm = model.attn_inputs[layer]
        x = comps.trace.resid_pre[layer][b][None]
        clean = norm(x)  # type: ignore[misc]
        held = held_norm(norm, x, clean, model.norm_offset)
        normed = held.linear(rows)
        if held.bias is not None:
            normed[-1] = normed[-1] + held.bias
        batch = torch.cat([normed, clean])  # rows: components, bias, clean
        kept: dict[str, Tensor] = {}

        def record(site: str, stop: bool = False) -> Callable[[Tensor], Tensor]:
            def hook(t: Tensor) -> Tensor:
                kept[site] = t
                if stop:
                    raise _Stop
                return t

            return hook

        def unbiased(module: nn.Module, _args: tuple, out: Tensor) -> Tensor:
            bias = getattr(module, "bias", None)
            if not isinstance(bias, Tensor):
                return out
            out = out.clone()
            out[: n - 1] = out[: n - 1] - bias
            return out

        def held_qk(module: nn.Module, args: tuple, out: Tensor) -> Tensor:
            one = held_norm(module, args[0][-1:], out[-1:], model.norm_offset)
            return torch.cat([one.linear(args[0][:-1]), out[-1:]])

        with ExitStack() as stack:
            hooks = [norm.register_forward_hook(lambda _m, _a, _o: batch)]  # type: ignore[union-attr]
            projs = model.sites.qkv_projs[layer] if model.sites.qkv_projs else []
            hooks += [p.register_forward_hook(unbiased) for p in projs]
            hooks += [m.register_forward_hook(held_qk) for m in qk_norms(model, layer) if m is not None]
            for handle in hooks:
                stack.callback(handle.remove)
            stack.enter_context(model.sites.hooks(layer, q=record("q"), k=record("k"), v=record("v", stop=True)))
            args, kwargs = prompt_extra(comps.trace, layer, b)
            try:
                model.blocks[layer](torch.zeros_like(batch), *args, **kwargs)
            except _Stop:
                pass
    q, k, v = kept["q"], kept["k"], kept["v"]
    return LayerParts(names, q[:-1], k[:-1], v[:-1], q[-1], k[-1], v[-1], attention_scale(model, layer))


# --- interventions on the model itself -----------------------------------------------------------------


def run_layer(
    comps: Components,
    layer: int,
    delta: Tensor | None = None,
    held: bool = False,
    hold_pattern: bool = False,
    until: str = Site.v,
) -> dict:
    """The model's own block `layer` on its clean input, up to its site `until` (v, or z): q, k (and z) and the
    (input, output) of its input norm and QK-norms, with `delta` [B, T, d] added to the residual stream this
    attention alone reads; `held`: every one of those norms at its clean scale (comps.clean); `hold_pattern`: the clean
    pattern (what the values carry is then all that changes)."""
    model = comps.model
    seen: dict = {}
    clean = comps.clean(layer) if held else None
    norm = model.attn_inputs[layer]
    q_norm, k_norm = qk_norms(model, layer)

    def watch(key: str) -> Callable:
        def hook(module: nn.Module, args: tuple, out: Tensor) -> Tensor:
            seen[key] = (args[0], out)
            if clean is None:
                return out
            x0, out0 = clean[key]
            return out0 + held_norm(module, x0, out0, model.norm_offset).linear(args[0] - x0)

        return hook

    def keep(site: str) -> Callable[[Tensor], Tensor]:
        def hook(t: Tensor) -> Tensor:
            seen[site] = t
            if site == until:
                raise _Stop
            return t

        return hook

    sites: dict[str, Callable[[Tensor], Tensor]] = {s: keep(s) for s in (Site.q, Site.k, Site.v, Site.z)}
    if hold_pattern:
        sites[Site.pattern] = lambda _t: comps.pattern[layer]
    with torch.no_grad(), ExitStack() as stack:
        if delta is not None:
            stack.enter_context(model.input_hooks(layer, attn_in=lambda x: x + delta))
        for key, module in (("norm", norm), ("q_norm", q_norm), ("k_norm", k_norm)):
            if module is not None:
                stack.callback(module.register_forward_hook(watch(key)).remove)
        stack.enter_context(model.sites.hooks(layer, **sites))
        try:  # the layer's own block on its clean input: the blocks before it are unchanged
            model.run_blocks(comps.trace.resid_pre[layer], layer, comps.trace, stop=layer + 1)
        except _Stop:
            pass
    return seen


@dataclass
class Removal:
    """Per prompt: what taking one component out of one side's residual stream takes off the score (clean minus
    edited), and how far the norms' scales moved (0 where they were held)."""

    change: Tensor  # [B]
    norm_change: Tensor  # [B]: the input norm's scale at the edited position, edited / clean - 1
    qk_norm_change: Tensor | None  # [B]: the largest |edited / clean - 1| of QK-norm's scales there; None: none


def removal(
    comps: Components,
    layer: int,
    head: int,
    name: str,
    side: str,
    queries: Tensor,
    keys: Tensor,
    held: bool = True,
) -> Removal:
    """Component `name` taken out of the residual stream that layer `layer`'s attention reads at the query
    (side "query") or key (side "key") position of each prompt's edge (queries, keys: [B]); the score of `head`
    read with the other side clean."""
    model = comps.model
    kv = model.sites.kv_head_of(head)
    rows = torch.arange(comps.batch)
    at = queries if side == "query" else keys
    part = comps.contribution(layer, name)
    delta = torch.zeros_like(comps.trace.resid_pre[layer])
    delta[rows, at] = -part[rows, at]
    clean, edited = comps.clean(layer), run_layer(comps, layer, delta, held=held)
    q = (edited if side == "query" else clean)["q"][rows, head, queries]
    k = (edited if side == "key" else clean)["k"][rows, kv, keys]
    q0, k0 = clean["q"][rows, head, queries], clean["k"][rows, kv, keys]
    scale = attention_scale(model, layer)
    change = scale * ((q0 * k0).sum(-1) - (q * k).sum(-1))
    key = "q_norm" if side == "query" else "k_norm"
    if held:  # the scales are the clean ones by construction
        return Removal(change, torch.zeros_like(change), torch.zeros_like(change) if key in clean else None)
    norm_change = _scale_change(model.attn_inputs[layer], clean["norm"], edited["norm"], model.norm_offset)[rows, at]
    qk_change = None
    if key in clean:
        moved = _scale_change(qk_norms(model, layer)[side == "key"], clean[key], edited[key], model.norm_offset).abs()
        qk_change = moved.flatten(1).amax(1)
    return Removal(change, norm_change, qk_change)


def _scale_change(
    module: nn.Module | None, clean: tuple[Tensor, Tensor], edited: tuple[Tensor, Tensor], offset: float
) -> Tensor:
    """edited / clean - 1 of a norm's fitted scales, [...] (the last dimension dropped)."""
    before = held_norm(module, *clean, offset).scale
    after = held_norm(module, *edited, offset).scale
    return (after / before - 1).squeeze(-1)
