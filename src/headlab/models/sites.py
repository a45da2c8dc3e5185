"""HeadSites: the one place that knows where a head lives.

Every attention layer that headlab serves, Hugging Face or toy, computes attention through
`headlab_attention` below. Each such module carries a `LayerSlot`; when a slot's hooks are all None the
function is plain attention, so an installed-but-idle HeadSites leaves logits unchanged (to float
rounding). Where nothing needs the pattern (no pattern hook, no prefix, no softcap, no output_attentions:
needs_pattern) it is torch's scaled_dot_product_attention, which never makes the [head, query, key]
scores; elsewhere eager attention, which makes the scores and the pattern.

Hook signatures. The sites are TransformerLens's hook points and tables name them so
(vocabulary.hook_name: blocks.{l}.attn.hook_q, ...), but only pattern and z have TransformerLens's
layout: q, k and v come as transformers' attention interface hands them over, head before position,
where TransformerLens's hook_q, hook_k and hook_v are [batch, pos, head_index, d_head]. A
TransformerLens hook function copied over indexes the wrong axis of q, k and v
(`t.transpose(1, 2)` turns one layout into the other).
  q:        [batch, head, pos, d_head]        -> same   (query heads; hook_q is [batch, pos, head, d_head])
  k, v:     [batch, kv_head, pos, d_head]     -> same   (before grouped-query sharing; hook_k, hook_v
                                                         are [batch, pos, kv_head, d_head])
  pattern:  [batch, head, query_pos, key_pos] -> same   (as hook_pattern)
  z:        [batch, pos, head, d_head]        -> same   (as hook_z: the input of the output projection)
On a rotary model q and k are taken after the rotation, where TransformerLens has hook_rot_q and
hook_rot_k. The shapes are in the types (jaxtyping) where tensors cross a module's border: W_QKV, W_O,
Trace, the attribution's parts and terms; the suite checks them at every call (tests/conftest.py).

A layer whose q, k, v and pattern are not edited, whose input is the clean one, need not compute its
attention at all: `replayed` gives its output as the output projection of the clean z, after the z hook.

A slot's `prefix` (clean keys and values of the positions before a suffix, [batch, kv_head, p, d_head],
one for all the stacked copies of the prompts) lets a block run on positions p.. alone: its keys and
values come before the suffix's own, and its attention mask has the rows of the suffix's queries over
every key (HookedModel.run_blocks).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor, nn

from ..vocabulary import ATTENTION_SITES, HEAD_SITES, Site

Hook = Callable[[Tensor], Tensor]


@dataclass
class LayerSlot:
    layer: int
    q: Hook | None = None
    k: Hook | None = None
    v: Hook | None = None
    pattern: Hook | None = None
    z: Hook | None = None
    prefix: tuple[Tensor, Tensor] | None = None  # clean (keys, values) of the positions before the suffix


def prefix_length(module: nn.Module) -> int:
    """How many positions come before the ones an attention module computes now (0: all of them)."""
    slot: LayerSlot | None = getattr(module, "headlab_slot", None)
    return 0 if slot is None or slot.prefix is None else slot.prefix[0].shape[2]


def runs_eagerly(pattern: bool, suffix: bool, softcap: float | None, wants_weights: bool = False) -> bool:
    """Must `headlab_attention` make the scores and the pattern themselves (its eager path)? Where a hook
    reads or edits the pattern (recording it goes through the hook too), a softcap bends the scores, a
    suffix run puts clean prefix keys before the queries' own (their scores are made per prompt, not
    per copy: see per_copy), or the caller asked for the attention weights (output_attentions)."""
    return pattern or suffix or softcap is not None or wants_weights


def needs_pattern(slot: LayerSlot | None, softcap: float | None = None, wants_weights: bool = False) -> bool:
    """runs_eagerly for the hooks a layer's slot holds now."""
    hooked = slot is not None and slot.pattern is not None
    return runs_eagerly(hooked, slot is not None and slot.prefix is not None, softcap, wants_weights)


def attention_bytes(heads: int, queries: int, keys: int, dtype: torch.dtype, eager: bool = True) -> int:
    """The memory `headlab_attention` holds at once for one prompt. Eager: two [heads, queries, keys]
    tensors, the scores and the pattern (each step below makes a new one before the old is freed;
    softmax writes the pattern in at least float32, and a cast back to a narrower dtype makes a third,
    narrow one); at long sequences this, not the MLP's hidden units, is a block's widest activation.
    Not eager (scaled_dot_product_attention): nothing of that size; what it holds per prompt is its
    output z, no wider than d_model, and its CPU kernel's scratch is per thread (a block of queries by a
    block of keys: about 1 MB per thread at 2048 tokens), not per prompt: 0."""
    if not eager:
        return 0
    softmax = torch.promote_types(dtype, torch.float32)
    per_score = dtype.itemsize + softmax.itemsize + (dtype.itemsize if softmax != dtype else 0)
    return heads * queries * keys * per_score


def headlab_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    **kwargs: object,
) -> tuple[Tensor, Tensor | None]:
    """Attention with hook points; the signature of transformers' attention interface. The weights it
    returns are the pattern, or None (as transformers' sdpa does) where nothing needs the pattern: then
    z comes from scaled_dot_product_attention, which never makes the [heads, queries, keys] scores."""
    slot: LayerSlot | None = getattr(module, "headlab_slot", None)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if slot is not None:
        if slot.q is not None:
            query = slot.q(query)
        if slot.k is not None:
            key = slot.k(key)
        if slot.v is not None:
            value = slot.v(value)
    if needs_pattern(slot, softcap, bool(kwargs.get("output_attentions"))):
        z, pattern = _eager(module, slot, query, key, value, attention_mask, scaling, dropout, softcap)
    else:
        z, pattern = _fused(module, query, key, value, attention_mask, scaling, dropout), None
    if slot is not None and slot.z is not None:
        z = slot.z(z)
    return z.contiguous(), pattern


def _fused(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, scaling: float, dropout: float
) -> Tensor:
    """z [batch, pos, head, d_head] from scaled_dot_product_attention, with the eager path's mask
    semantics: a bool mask keeps its True keys, a masked key adds the dtype's lowest value (as the
    eager path's fill does, so a row with every key masked is uniform, not NaN); a float mask adds. A
    mask of one row per prompt for g stacked copies of b > 1 prompts is applied by folding the copies
    into the heads ([g * b, head, ...] -> [b, g * head, ...]): the mask then broadcasts over them."""
    prompts = 1
    square = query.shape[-2] == key.shape[-2]  # every query over its own keys
    causal = mask is not None and square and plain_causal(mask, key.shape[-2])
    window = None
    if mask is not None and square and not causal and not (dropout and module.training):
        window = sliding_window(mask)
    if window is not None:
        return _windowed(query, key, value, window, scaling)
    if causal:
        mask = None
    elif mask is not None:
        mask = (additive(mask, query.dtype) if mask.dtype == torch.bool else mask)[..., : key.shape[-2]]
        if mask.dtype != query.dtype:
            mask = mask.to(query.dtype)
        if mask_per_prompt(mask, query.shape[0]):
            prompts = mask.shape[0]
    heads = query.shape[1]
    if prompts > 1:
        query, key, value = (t.unflatten(0, (-1, prompts)).transpose(0, 1).flatten(1, 2) for t in (query, key, value))
    z = nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=mask,
        dropout_p=dropout if module.training else 0.0,
        is_causal=causal,
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    if prompts > 1:
        z = z.unflatten(1, (-1, heads)).transpose(0, 1).flatten(0, 1)
    return z.transpose(1, 2)


def additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A bool mask as scores to add: 0 where a key takes part, the dtype's lowest value where it does not.
    Kept on the mask, which every layer and chunk of a pass is handed; filled on the mask's device (a
    scalar made from Python is a host-to-device copy per layer and chunk, which stalls a GPU's stream)."""
    return _kept(
        mask,
        "_headlab_additive",
        (_version(mask), dtype),
        lambda: torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min),
    )


def _kept(mask: Tensor, name: str, key: Any, make: Callable[[], Any]) -> Any:
    """make()'s answer about `mask`, kept on it under `name` and `key`: every layer and chunk of a pass is
    handed the same mask."""
    known: dict = mask.__dict__.setdefault(name, {})
    if key not in known:
        known[key] = make()
    return known[key]


def _version(mask: Tensor) -> int:
    """An in-place edit of the mask makes its readers ask again where torch counts them (not on inference
    tensors; nothing in headlab or transformers edits a mask in place)."""
    return 0 if mask.is_inference() else mask._version


def plain_causal(mask: Tensor, keys: int) -> bool:
    """Is `mask` ([..., queries, keys and more], bool or additive) over its first `keys` keys the plain
    causal mask for every prompt, key j visible to query i iff j <= i (no padding, no window)?
    scaled_dot_product_attention then takes is_causal instead, which skips the hidden half of the scores
    (as transformers' own sdpa path does). The answer is kept on the mask: every layer and chunk of a
    sweep is handed the same one, and at 2048 tokens reading it costs a fifth of a small model's sweep."""
    return _kept(mask, "_headlab_plain_causal", (_version(mask), keys), lambda: _within(mask[..., :keys], keys))


# a sliding-window layer's attention runs a block of queries at a time over the keys within the window when
# the prompts are at least this many windows long: each block then reads 2 windows of keys, not all of them
WINDOWS_TO_SPLIT = 2
ROWS_CHECKED = 1024  # rows of a long mask read at a time: bounds what checking it holds beside it


def sliding_window(mask: Tensor) -> int | None:
    """The window w where `mask` ([..., queries, keys], queries == keys, bool or additive) is the causal
    sliding-window mask for every prompt (key j visible to query i iff 0 <= i - j < w: transformers'
    sliding_window_overlay) and the prompts are at least WINDOWS_TO_SPLIT windows long; else None. Kept on
    the mask, as plain_causal's answer."""
    return _kept(mask, "_headlab_window", (_version(mask), mask.shape[-1]), lambda: _reads_sliding_window(mask))


def _reads_sliding_window(mask: Tensor) -> int | None:
    keys = mask.shape[-1]
    window = int(_visible(mask[..., -1, :]).reshape(-1, keys)[0].sum())  # the last query sees `window` keys
    return window if window * WINDOWS_TO_SPLIT <= keys and _within(mask, window) else None


def _within(mask: Tensor, window: int) -> bool:
    """Is `mask` ([..., queries, keys], bool or additive) the causal mask of a `window`-key sliding window
    (window >= keys: the plain causal mask) for every prompt? An additive mask's seen keys are 0 and its
    hidden ones at most half the dtype's lowest value (the eager fill, or -inf): no weight after the
    softmax. Read ROWS_CHECKED rows at a time, so that checking a long mask holds little beside it."""
    queries, keys = mask.shape[-2:]
    if queries != keys:
        return False
    j = torch.arange(keys, device=mask.device)
    for start in range(0, queries, ROWS_CHECKED):
        i = torch.arange(start, min(start + ROWS_CHECKED, queries), device=mask.device)[:, None]
        rows = mask[..., start : start + ROWS_CHECKED, :]
        expected = ((j <= i) & (j > i - window)).expand_as(rows)  # bool from the start: no [rows, keys] of ints
        if not torch.equal(_visible(rows), expected):
            return False
        if rows.dtype != torch.bool and not torch.equal(rows <= torch.finfo(rows.dtype).min / 2, ~expected):
            return False
    return True


def _visible(mask: Tensor) -> Tensor:
    """The keys a bool or additive mask lets through (an additive mask's 0s)."""
    return mask if mask.dtype == torch.bool else mask == 0


def _windowed(query: Tensor, key: Tensor, value: Tensor, window: int, scaling: float) -> Tensor:
    """z [batch, pos, head, d_head] of causal attention within a sliding window of `window` keys, a block of
    `window` queries at a time over the keys it can see (the block's and the window before it): the same
    softmax over the same keys as the whole mask gives, at 2 x window keys a query instead of all of them."""
    tokens, blocks = query.shape[-2], []
    for start in range(0, tokens, window):
        stop, first = min(start + window, tokens), max(0, start - window + 1)
        i = torch.arange(start, stop, device=query.device)[:, None]
        j = torch.arange(first, stop, device=query.device)
        blocks.append(
            nn.functional.scaled_dot_product_attention(
                query[..., start:stop, :],
                key[..., first:stop, :],
                value[..., first:stop, :],
                attn_mask=(j <= i) & (j > i - window),  # [block, keys]: True takes part
                scale=scaling,
                enable_gqa=query.shape[1] != key.shape[1],
            )
        )
    return torch.cat(blocks, dim=-2).transpose(1, 2)


def _eager(
    module: nn.Module,
    slot: LayerSlot | None,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float,
    dropout: float,
    softcap: float | None,
) -> tuple[Tensor, Tensor]:
    """z [batch, pos, head, d_head] and the pattern, through the slot's pattern hook and prefix. Grouped
    keys and values are never repeated per query head, nor the prefix joined to the suffix's keys and
    values (per_copy): a decoding step copies nothing of the cache."""
    prefix = None if slot is None else slot.prefix
    scores = per_copy(query, key.transpose(-1, -2))
    if prefix is not None:
        scores = torch.cat([per_copy(query, prefix[0].transpose(-1, -2)), scores], dim=-1)
    scores = scores * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        scores = _masked(scores, attention_mask[..., : scores.shape[-1]])
    # at least float32 (as HF's eager attention), but never below the model's own precision
    pattern = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(value.dtype)
    if slot is not None and slot.pattern is not None:
        pattern = slot.pattern(pattern)
    if dropout and module.training:
        pattern = nn.functional.dropout(pattern, p=dropout)
    if prefix is None:
        z = per_copy(pattern, value)
    else:  # the prefix's keys, then the suffix's own: the two parts of one product over every key
        before = prefix[1].shape[2]
        z = per_copy(pattern[..., :before], prefix[1]) + per_copy(pattern[..., before:], value)
    return z.transpose(1, 2), pattern


def mask_per_prompt(mask: Tensor, batch: int) -> bool:
    """Is `mask` one row per prompt of a batch of `batch` stacked copies (rather than one per row or one
    for all)?"""
    return mask.dim() == 4 and mask.shape[0] not in (1, batch)


def _masked(scores: Tensor, mask: Tensor) -> Tensor:
    """Scores [g * b, head, q, k] under a mask of one row per prompt ([b, ...]) or one for all."""
    by_prompt = mask_per_prompt(mask, scores.shape[0])
    if by_prompt:  # [g, b, head, q, k]: the mask broadcasts over the copies
        scores = scores.unflatten(0, (-1, mask.shape[0]))
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    else:
        scores = scores + mask
    return scores.flatten(0, 1) if by_prompt else scores


def per_copy(a: Tensor, b: Tensor) -> Tensor:
    """a [g * batch, head, S, x] @ b [batch, kv_head, x, m] -> [g * batch, head, S, m]: b shared by the g
    stacked copies (group-major) of a and by the head // kv_head query heads of each group (grouped-query
    attention), multiplied without repeating it: the copies and the group's heads are folded into the
    rows of one product per prompt and key/value head (a view, where g is 1)."""
    batch, kv, heads, rows = b.shape[0], b.shape[1], a.shape[1], a.shape[2]
    copies, rep = a.shape[0] // batch, heads // kv
    folded = a.unflatten(0, (copies, batch)).unflatten(2, (kv, rep))  # [g, batch, kv, rep, S, x]
    folded = folded.permute(1, 2, 0, 3, 4, 5).reshape(batch, kv, copies * rep * rows, -1)
    out = torch.matmul(folded, b)  # [batch, kv, g * rep * S, m]
    out = out.unflatten(2, (copies, rep, rows)).permute(2, 0, 1, 3, 4, 5)  # [g, batch, kv, rep, S, m]
    return out.reshape(copies * batch, heads, rows, -1)


@dataclass
class HeadSites:
    """Per-head read/write access to a model's attention layers."""

    attn_modules: list[nn.Module]
    w_o: Callable[[int], Tensor]  # layer -> [head, d_head, d_model]
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_model: int
    # layer -> W_Q [head, d_model, d_head], W_K and W_V [kv_head, d_model, d_head]; None: not known
    w_qkv: Callable[[int], tuple[Tensor, Tensor, Tensor]] | None = None
    # per layer the attention's output projection, whose input is z [..., head * d_head]; None: not known
    out_projs: list[nn.Module] | None = None
    returns_pattern: bool = True  # the attention module returns (output, weights), as HF's do, not output alone
    # per layer the modules whose outputs hold q, k and v before any per-head operation (rotary, q/k
    # norms; nothing between them and the q, k, v sites mixes heads), and how their outputs [..., features]
    # split into (q [..., head, d_head], k, v [..., kv_head, d_head]), as w_qkv reads their weights
    qkv_projs: list[list[nn.Module]] | None = None
    qkv_split: Callable[[list[Tensor]], tuple[Tensor, Tensor, Tensor]] | None = None
    attn_softcap: float | None = None  # the softcap the model's attention puts on its scores (Gemma 2)
    slots: list[LayerSlot] = field(init=False)

    def __post_init__(self) -> None:
        self.slots = []
        for layer, module in enumerate(self.attn_modules):
            slot = LayerSlot(layer)
            module.headlab_slot = slot  # type: ignore[assignment]  # torch types Module attributes as Tensor | Module
            self.slots.append(slot)

    @property
    def n_layers(self) -> int:
        return len(self.slots)

    def kv_head_of(self, head: int) -> int:
        return head // (self.n_heads // self.n_kv_heads)

    def W_O(self, layer: int) -> Float[Tensor, "head d_head d_model"]:
        return self.w_o(layer)

    def W_QKV(
        self, layer: int
    ) -> tuple[
        Float[Tensor, "head d_model d_head"], Float[Tensor, "kv d_model d_head"], Float[Tensor, "kv d_model d_head"]
    ]:
        """The layer's input weights in TransformerLens's orientation (x @ W), as stored: the norm before
        the attention, biases, rotary and q/k norms stay out, as in TransformerLens's weight scores."""
        if self.w_qkv is None:
            raise ValueError("this model's HeadSites do not know its query, key and value weights")
        return self.w_qkv(layer)

    @contextmanager
    def hooks(self, layer: int, **fns: Hook | None) -> Iterator[None]:
        """Install hooks on one layer for the duration of the block; existing hooks run first."""
        slot = self.slots[layer]
        saved = {name: getattr(slot, name) for name in fns}
        for name, fn in fns.items():
            if name not in HEAD_SITES:
                raise ValueError(f"unknown head site {name!r}; sites: {', '.join(HEAD_SITES)}")
            previous = saved[name]
            setattr(slot, name, fn if previous is None or fn is None else _chain(previous, fn))
        try:
            yield
        finally:
            for name, fn in saved.items():
                setattr(slot, name, fn)

    @contextmanager
    def prefixed(self, layer: int, keys: Tensor, values: Tensor) -> Iterator[None]:
        """The layer's attention runs on a suffix of positions, after these clean keys and values."""
        slot = self.slots[layer]
        slot.prefix = (keys, values)
        try:
            yield
        finally:
            slot.prefix = None

    @property
    def replays(self) -> bool:
        """Can `replayed` stand in for a layer's attention?"""
        return self.out_projs is not None

    @contextmanager
    def replayed(self, layer: int, z: Tensor) -> Iterator[None]:
        """The layer's attention module computes nothing: its output is the output projection of `z`
        ([batch, pos, head, d_head], what it computed before on the same input; the z hook may edit it in
        place). Exact where the layer's input is that input and its q, k, v and pattern are not edited."""
        if self.out_projs is None:
            raise ValueError("this model's HeadSites do not know its output projections")
        module, out_proj, slot = self.attn_modules[layer], self.out_projs[layer], self.slots[layer]
        if any(getattr(slot, site) is not None for site in ATTENTION_SITES):
            raise ValueError(f"layer {layer}'s attention is edited inside: it cannot be replayed")

        def forward(*_args: object, **_kwargs: object) -> Tensor | tuple[Tensor, None]:
            out = out_proj((z if slot.z is None else slot.z(z)).flatten(-2))
            return (out, None) if self.returns_pattern else out

        own = module.__dict__.get("forward")  # an instance's own forward: accelerate's device hooks set one
        module.__dict__["forward"] = forward
        try:
            yield
        finally:
            if own is None:
                del module.__dict__["forward"]
            else:
                module.__dict__["forward"] = own

    @contextmanager
    def record(
        self, sites: tuple[str, ...] = (Site.z,), layers: list[int] | None = None, keep: Hook | None = None
    ) -> Iterator[dict]:
        """Record activations: yields a dict (site, layer) -> tensor (or what `keep` makes of it), filled by
        forward passes inside."""
        store: dict[tuple[str, int], Tensor] = {}
        layers = list(range(self.n_layers)) if layers is None else layers
        hooks = [self.hooks(layer, **{s: _recorder(store, s, layer, keep) for s in sites}) for layer in layers]
        with _stack(hooks):
            yield store


def _chain(first: Hook, second: Hook) -> Hook:
    return lambda t: second(first(t))


def _recorder(store: dict, site: str, layer: int, keep: Hook | None = None) -> Hook:
    def hook(t: Tensor) -> Tensor:
        store[(site, layer)] = t if keep is None else keep(t)
        return t

    return hook


@contextmanager
def _stack(managers: list) -> Iterator[None]:
    from contextlib import ExitStack

    with ExitStack() as stack:
        for m in managers:
            stack.enter_context(m)
        yield
