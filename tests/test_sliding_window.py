"""A sliding-window layer's attention over prompts at least two windows long runs a block of queries at a
time over the keys in their window (models/sites.py sliding_window, _windowed): the same numbers as
transformers' own eager attention over the whole masked score matrix."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from headlab.models import sites
from headlab.models.hf import load_hf

WINDOW = 4  # the tiny configs' sliding_window (conftest.tiny_configs)


def windowed(tokens: int, window: int) -> torch.Tensor:
    i, j = torch.arange(tokens)[:, None], torch.arange(tokens)
    return (j <= i) & (i - j < window)


def test_the_window_is_read_off_the_mask_and_only_a_plain_unpadded_one_is_split():
    mask = windowed(12, WINDOW)[None, None].expand(3, 1, 12, 12)
    assert sites.sliding_window(mask.clone()) == WINDOW
    additive = torch.zeros(1, 1, 12, 12).masked_fill_(~windowed(12, WINDOW), torch.finfo(torch.float32).min)
    assert sites.sliding_window(additive) == WINDOW
    padded = mask.clone()
    padded[1, :, :, 0] = False  # the second prompt's first position is padding
    assert sites.sliding_window(padded) is None
    assert sites.sliding_window(windowed(7, WINDOW)[None, None]) is None  # under two windows: one score matrix
    assert sites.sliding_window(torch.ones(12, 12, dtype=torch.bool).tril()[None, None]) is None  # no window
    wider = windowed(12, WINDOW) | windowed(12, WINDOW + 1)  # a window that is no window of its last row
    wider[-1] = windowed(12, WINDOW)[-1]
    assert sites.sliding_window(wider[None, None]) is None


@pytest.mark.parametrize("family", ["mistral", "gemma3_text"])
def test_a_prompt_of_several_windows_gives_transformers_eager_logits_and_head_ablations(
    family, tiny_hf_dir, monkeypatch
):
    path = tiny_hf_dir(family)
    hm = load_hf(str(path), need_tokenizer=False)
    reference = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    ids = torch.randint(0, reference.config.vocab_size, (2, 5 * WINDOW + 1), generator=torch.Generator().manual_seed(0))
    windows: list[int | None] = []
    read = sites.sliding_window
    monkeypatch.setattr(sites, "sliding_window", lambda mask: windows.append(read(mask)) or windows[-1])
    with torch.inference_mode():
        ours = hm.forward({"input_ids": ids})
        theirs = reference(input_ids=ids).logits
    assert WINDOW in windows  # the sliding layers took the split path
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)

    layer, head, d_head = 1, 1, reference.config.head_dim
    o_proj = reference.model.layers[layer].self_attn.o_proj

    def zero_head(_module, args):
        z = args[0].clone()
        z[..., head * d_head : (head + 1) * d_head] = 0
        return (z,)

    def zero_z(z: torch.Tensor) -> torch.Tensor:
        z[:, :, head] = 0  # [batch, pos, head, d_head]
        return z

    handle = o_proj.register_forward_pre_hook(zero_head)
    try:
        with torch.inference_mode(), hm.hooks(layer, z=zero_z):
            ablated = hm.forward({"input_ids": ids})
            expected = reference(input_ids=ids).logits
    finally:
        handle.remove()
    assert (expected - theirs).abs().max() > 1e-3  # the head moves the logits
    torch.testing.assert_close(ablated, expected, atol=1e-5, rtol=1e-5)
