"""A chunk of stacked copies stays inside its memory budget at long sequences, where a block's widest
activation is its attention's scores and pattern (heads x queries x keys per prompt), not its MLP's."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from headlab.interventions.edits import chunk_size, copy_bytes
from headlab.models.hf import load_hf
from headlab.models.sites import attention_bytes, headlab_attention
from headlab.models.toy import ToyConfig, ToyTransformer, hooked_toy
from headlab.tasks import TaskData


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_holds_two_score_sized_tensors_at_once(dtype):
    batch, heads, seq, d_head = 2, 3, 96, 8
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, heads, seq, d_head, generator=gen).to(dtype) for _ in range(3))
    mask = torch.full((seq, seq), float("-inf")).triu(1).to(dtype)
    with torch.inference_mode(), PeakBytes() as measured:
        z, pattern = headlab_attention(nn.Module(), q, k, v, mask)
    scores = batch * heads * seq * seq
    # float32: the scores and the pattern; bfloat16: the scores, softmax's float32 pattern and its cast
    held = scores * (4 + 4 if dtype == torch.float32 else 2 + 4 + 2)
    z_bytes = z.numel() * z.element_size()
    assert held <= measured.peak <= held + 2 * z_bytes  # z, and its transposed copy, beside them
    assert attention_bytes(heads, seq, seq, dtype) * batch == held


def _toy(n_ctx: int, d_mlp: int = 32):
    torch.manual_seed(0)
    cfg = ToyConfig(vocab_size=7, n_ctx=n_ctx, n_layers=2, n_heads=3, d_model=24, d_head=8, d_mlp=d_mlp)
    return hooked_toy(ToyTransformer(cfg).eval(), "toy")


def _prompts(n: int, seq: int, vocab: int) -> TaskData:
    ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(1))
    return TaskData(inputs={"input_ids": ids}, positions=torch.full((n, 1), seq - 1), answers={})


def test_a_chunk_at_a_long_sequence_stays_inside_its_budget():
    """512 tokens, 3 heads: a copy's scores and pattern take 2 x 3 x 512 x 512 x 4 bytes = 6 MiB, 96
    times its MLP's hidden units (512 x 32 x 4 bytes), which alone would put 256 copies in 16 MiB."""
    model, data, chunk_mb = _toy(512), _prompts(1, 512, 7), 16.0
    per_copy = 2 * 3 * 512 * 512 * 4
    assert copy_bytes(model, data) == per_copy
    copies = chunk_size(model, data, chunk_mb)
    assert copies == 2 == int(chunk_mb * 2**20 // per_copy)
    with torch.inference_mode():
        trace = model.trace(data.inputs)
        h = trace.resid_pre[0].repeat(copies, 1, 1)
        model.run_blocks(h, 0, trace, copies=copies)  # its masks, made once per trace, made here
        with PeakBytes() as measured:
            model.run_blocks(h, 0, trace, copies=copies)
    # inside the budget, and the estimate counts what is there (the rest is d_model or d_mlp wide)
    assert copies * per_copy <= measured.peak <= min(1.1 * copies * per_copy, chunk_mb * 2**20)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_short_sequences_keep_the_mlp_bound_and_long_ones_the_attention(family, tiny_hf_dir):
    """Tiny HF models of 4 query heads (llama: on 2 key/value heads), float32; d_mlp 256 (gpt2), 128
    (llama). Below d_mlp x 4 / (4 heads x 8) keys a copy's MLP is wider than its attention: the chunk
    is as large as before; above, its attention sets it."""
    model = load_hf(str(tiny_hf_dir(family)), need_tokenizer=False)
    d_mlp = {"gpt2": 256, "llama": 128}[family]
    short, long = _prompts(8, 10, 50257), _prompts(2, 128, 50257)
    assert copy_bytes(model, short) == 8 * 10 * d_mlp * 4
    assert chunk_size(model, short, 1.0) == 2**20 // (8 * 10 * d_mlp * 4)
    assert copy_bytes(model, long) == 2 * 4 * 128 * 128 * 8
    assert chunk_size(model, long, 1.0) == 2**20 // (2 * 4 * 128 * 128 * 8) == 1
    # a suffix of the last 16 positions: 16 queries over all 128 keys
    assert copy_bytes(model, long, length=16) == max(2 * 16 * d_mlp * 4, 2 * 4 * 16 * 128 * 8)
