"""A chunk of stacked copies stays inside its memory budget at long sequences, where a block's widest
activation is its attention's scores and pattern (heads x queries x keys per prompt), not its MLP's."""

from __future__ import annotations

import weakref
from contextlib import ExitStack

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from headlab.interventions.edits import chunk_size, copy_bytes, edits_pattern
from headlab.interventions.plan import Intervention
from headlab.models.hf import load_hf
from headlab.models.sites import LayerSlot, attention_bytes, headlab_attention
from headlab.models.toy import ToyConfig, ToyTransformer, hooked_toy
from headlab.tasks import TaskData
from headlab.vocabulary import Kind, Method, Site


class PeakBytes(TorchDispatchMode):
    """The most bytes that tensors made by the ops run under it hold at once (each storage once, for as
    long as a tensor on it lives): a measurement of what a pass allocates, independent of headlab."""

    def __init__(self) -> None:
        super().__init__()
        self.tensors: dict[int, int] = {}  # storage -> tensors alive on it
        self.sizes: dict[int, int] = {}
        self.now = self.peak = 0

    def _release(self, key: int) -> None:
        self.tensors[key] -= 1
        if not self.tensors[key]:
            del self.tensors[key]
            self.now -= self.sizes.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            key = t.untyped_storage().data_ptr()
            if key not in self.tensors:
                if key in given:  # a view of (or an in-place op on) a tensor made before
                    continue
                self.tensors[key], self.sizes[key] = 0, t.untyped_storage().nbytes()
                self.now += self.sizes[key]
                self.peak = max(self.peak, self.now)
            self.tensors[key] += 1
            weakref.finalize(t, self._release, key)
        return out


def _qkv(batch: int, heads: int, kv_heads: int, seq: int, d_head: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, seq, d_head, generator=gen).to(dtype)
    return q, *(torch.randn(batch, kv_heads, seq, d_head, generator=gen).to(dtype) for _ in range(2))


def _watched() -> nn.Module:
    """An attention module whose pattern a hook reads: its attention runs eagerly."""
    module = nn.Module()
    module.headlab_slot = LayerSlot(0, pattern=lambda p: p)  # type: ignore[assignment]
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_watched_attention_holds_two_score_sized_tensors_at_once(dtype):
    batch, heads, seq, d_head = 2, 3, 96, 8
    q, k, v = _qkv(batch, heads, heads, seq, d_head, dtype)
    mask = torch.full((seq, seq), float("-inf")).triu(1).to(dtype)
    with torch.inference_mode(), PeakBytes() as measured:
        z, pattern = headlab_attention(_watched(), q, k, v, mask)
    scores = batch * heads * seq * seq
    # float32: the scores and the pattern; bfloat16: the scores, softmax's float32 pattern and its cast
    held = scores * (4 + 4 if dtype == torch.float32 else 2 + 4 + 2)
    z_bytes = z.numel() * z.element_size()
    assert held <= measured.peak <= held + 2 * z_bytes  # z, and its transposed copy, beside them
    assert attention_bytes(heads, seq, seq, dtype) * batch == held


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask_kind", ["float", "bool"])
@pytest.mark.parametrize("copies", [1, 3])
def test_an_unwatched_attention_holds_no_scores_and_matches_the_eager_one(dtype, mask_kind, copies):
    """No hook on the pattern: scaled_dot_product_attention's fused kernel, whose scratch lives inside it
    (per thread a block of queries by a block of keys; a resident-set measurement at 2048 tokens, 4 heads,
    float32: 1 to 4 MB beside the 64 MB of one [head, query, key] tensor). What ops outside it hold is
    z and its transposed copy; a bool mask (True: attend) adds one float mask per prompt; `copies`
    stacked copies of the 2 prompts under a mask of one row per prompt (HookedModel.run_blocks's), the
    copies folded into the heads, add that fold of q, k and v and its unfold of z. 9 query heads on 3
    key/value heads; the first prompt's first 5 keys masked for every query, the first query's too (a
    row with every key masked: uniform in both, as eager attention's fill)."""
    batch, heads, kv_heads, seq, d_head = 2, 9, 3, 256, 8
    q, k, v = _qkv(copies * batch, heads, kv_heads, seq, d_head, dtype)
    keep = torch.ones(seq, seq, dtype=torch.bool).tril().repeat(batch, 1, 1, 1)
    keep[0, :, :, :5] = False
    additive = torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)
    mask = keep if mask_kind == "bool" else additive
    with torch.inference_mode(), PeakBytes() as measured:
        z, none = headlab_attention(nn.Module(), q, k, v, mask)
    eager, pattern = headlab_attention(_watched(), q, k, v, mask.repeat(copies, 1, 1, 1))
    folded, _ = headlab_attention(_watched(), q, k, v, mask)
    assert none is None and pattern is not None
    torch.testing.assert_close(folded, eager, atol=0, rtol=0)
    z_bytes = z.numel() * z.element_size()
    # a bool mask made float; an additive one read once for whether it is the plain causal mask (a bool
    # mask of its size, beside two causal [query, key] ones)
    mask_bytes = seq * seq * dtype.itemsize * batch if mask_kind == "bool" else seq * seq * (batch + 2)
    held = (2 if copies == 1 else 2 + (1 + 2 / 3) + 1) * z_bytes + mask_bytes
    assert measured.peak <= held < copies * batch * heads * seq * seq * dtype.itemsize / 4
    assert attention_bytes(heads, seq, seq, dtype, eager=False) == 0
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(z.float(), eager.float(), atol=tol, rtol=tol)
    # the fully masked row: the mean of the values over every key, in both (every copy of prompt 0)
    uniform = v[::batch, :, :, :].float().mean(2).repeat_interleave(3, 1)  # [copies, head, d_head]
    torch.testing.assert_close(z[::batch, 0].float(), uniform, atol=tol, rtol=tol)


@pytest.mark.parametrize("mask_kind", ["float", "bool", "-inf"])
def test_a_plain_causal_mask_is_run_as_is_causal_and_matches_the_eager_attention(mask_kind, monkeypatch):
    """The plain causal mask (no padding, no window) goes to scaled_dot_product_attention as is_causal,
    which skips the hidden half of the scores, as transformers' sdpa path does; any other mask is given
    as it is. Either way z is the eager attention's. The answer is kept on the mask until it is edited."""
    batch, heads, kv_heads, seq, d_head = 2, 4, 2, 64, 8
    q, k, v = _qkv(batch, heads, kv_heads, seq, d_head, torch.float32)
    keep = torch.ones(seq, seq, dtype=torch.bool).tril().repeat(batch, 1, 1, 1)
    fill = float("-inf") if mask_kind == "-inf" else torch.finfo(torch.float32).min

    def as_kind(kept: torch.Tensor) -> torch.Tensor:
        return kept if mask_kind == "bool" else torch.zeros(kept.shape).masked_fill(~kept, fill)

    padded = keep.clone()
    padded[1, :, :, 1:4] = False  # prompt 1's keys 1 to 3 are padding
    window = keep & ~torch.ones(seq, seq, dtype=torch.bool).tril(-9)  # a sliding window of 8 keys
    calls: list[bool] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recorded(*args, **kwargs):
        calls.append(bool(kwargs.get("is_causal")) and kwargs.get("attn_mask") is None)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recorded)
    for kept, causal in ((keep, True), (keep[:1], True), (padded, False), (window, False)):
        mask = as_kind(kept)
        z, _ = headlab_attention(nn.Module(), q, k, v, mask)
        eager, _ = headlab_attention(_watched(), q, k, v, mask)
        assert calls.pop() is causal
        torch.testing.assert_close(z, eager, atol=1e-6, rtol=1e-6)
    mask = as_kind(keep.clone())  # read once, then edited in place: read again
    headlab_attention(nn.Module(), q, k, v, mask)
    mask[1, :, :, 1:4] = False if mask_kind == "bool" else fill
    z, _ = headlab_attention(nn.Module(), q, k, v, mask)
    assert calls[-2:] == [True, False]
    torch.testing.assert_close(z, headlab_attention(_watched(), q, k, v, mask)[0], atol=1e-6, rtol=1e-6)


def _toy(n_ctx: int, d_mlp: int = 32):
    torch.manual_seed(0)
    cfg = ToyConfig(vocab_size=7, n_ctx=n_ctx, n_layers=2, n_heads=3, d_model=24, d_head=8, d_mlp=d_mlp)
    return hooked_toy(ToyTransformer(cfg).eval(), "toy")


def _prompts(n: int, seq: int, vocab: int) -> TaskData:
    ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(1))
    return TaskData(inputs={"input_ids": ids}, positions=torch.full((n, 1), seq - 1), answers={})


def _peak_of_one_chunk(model, data, copies: int, watched: bool) -> int:
    """What run_blocks of `copies` stacked copies allocates at most; `watched`: a hook reads every
    layer's pattern."""
    with torch.inference_mode(), ExitStack() as stack:
        if watched:
            for layer in range(model.n_layers):
                stack.enter_context(model.hooks(layer, pattern=lambda p: p))
        trace = model.trace(data.inputs)
        h = trace.resid_pre[0].repeat(copies, 1, 1)
        model.run_blocks(h, 0, trace, copies=copies)  # its masks, made once per trace, made here
        with PeakBytes() as measured:
            model.run_blocks(h, 0, trace, copies=copies)
    return measured.peak


def test_a_chunk_at_a_long_sequence_stays_inside_its_budget():
    """512 tokens, 3 heads, a pattern edit: a copy's scores and pattern take 2 x 3 x 512 x 512 x 4 bytes
    = 6 MiB, 96 times its MLP's hidden units (512 x 32 x 4 bytes), which alone would put 256 copies in
    16 MiB."""
    model, data, chunk_mb = _toy(512), _prompts(1, 512, 7), 16.0
    per_copy = 2 * 3 * 512 * 512 * 4
    assert copy_bytes(model, data, pattern=True) == per_copy
    copies = chunk_size(model, data, chunk_mb, pattern=True)
    assert copies == 2 == int(chunk_mb * 2**20 // per_copy)
    peak = _peak_of_one_chunk(model, data, copies, watched=True)
    # inside the budget, and the estimate counts what is there (the rest is d_model or d_mlp wide)
    assert copies * per_copy <= peak <= min(1.1 * copies * per_copy, chunk_mb * 2**20)


def test_without_a_pattern_edit_a_long_sequence_keeps_the_mlp_bound():
    """512 tokens, d_mlp 256, nothing reads the pattern: scaled_dot_product_attention makes no scores,
    a copy's widest activation is its MLP's hidden units (512 x 256 x 4 bytes = 0.5 MiB), 32 copies fit
    16 MiB (2 where the pattern is edited). The chunk then holds the MLP's input and its GELU's output
    at once (16 MiB each) and a few d_model-wide tensors; the eager attention's scores and pattern
    would be 32 x 6 MiB more."""
    model, data, chunk_mb = _toy(512, d_mlp=256), _prompts(1, 512, 7), 16.0
    per_copy = 512 * 256 * 4
    assert copy_bytes(model, data) == per_copy
    copies = chunk_size(model, data, chunk_mb)
    assert copies == 32 and chunk_size(model, data, chunk_mb, pattern=True) == 2
    peak = _peak_of_one_chunk(model, data, copies, watched=False)
    h_bytes = copies * 512 * 24 * 4
    assert 2 * copies * per_copy <= peak <= 2 * copies * per_copy + 4 * h_bytes


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_short_sequences_keep_the_mlp_bound_and_eager_long_ones_the_attention(family, tiny_hf_dir):
    """Tiny HF models of 4 query heads (llama: on 2 key/value heads), float32; d_mlp 256 (gpt2), 128
    (llama). Where the attention runs eagerly (a pattern edit, a suffix run, a softcap), below
    d_mlp x 4 / (4 heads x 8) keys a copy's MLP is wider than its attention: the chunk is as large as
    before; above, its attention sets it. Elsewhere the MLP's bound holds at every length."""
    model = load_hf(str(tiny_hf_dir(family)), need_tokenizer=False)
    d_mlp = {"gpt2": 256, "llama": 128}[family]
    short, long = _prompts(8, 10, 50257), _prompts(2, 128, 50257)
    for pattern in (False, True):
        assert copy_bytes(model, short, pattern=pattern) == 8 * 10 * d_mlp * 4
        assert chunk_size(model, short, 1.0, pattern=pattern) == 2**20 // (8 * 10 * d_mlp * 4)
    assert copy_bytes(model, long) == 2 * 128 * d_mlp * 4
    assert copy_bytes(model, long, pattern=True) == 2 * 4 * 128 * 128 * 8
    assert chunk_size(model, long, 1.0, pattern=True) == 2**20 // (2 * 4 * 128 * 128 * 8) == 1
    # a suffix of the last 16 positions, after clean prefix keys (eager): 16 queries over all 128 keys
    assert copy_bytes(model, long, length=16) == max(2 * 16 * d_mlp * 4, 2 * 4 * 16 * 128 * 8)
    model.sites.attn_softcap = 50.0  # as Gemma 2's attention
    assert copy_bytes(model, long) == 2 * 4 * 128 * 128 * 8


def test_an_edit_on_the_pattern_is_told_from_one_on_z():
    zero = Intervention(Kind.ablate_head, Method.zero, layer=0, head=1)
    on_pattern = Intervention(Kind.ablate_head, Method.zero, layer=0, head=1, site=Site.pattern)
    swap = Intervention(Kind.pattern_from, layer=0, head=1, other_head=2)
    assert not edits_pattern([zero], 3)
    assert edits_pattern([zero, on_pattern], 3) and edits_pattern([swap], 3)
