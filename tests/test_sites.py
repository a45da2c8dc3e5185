"""HeadSites on every HF family: idle hooks change nothing; hooks read and write what they claim."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import HF_FAMILIES
from headlab.models.hf import load_hf

TEXT = "When Mary and John went to the store, John gave a drink to"


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_idle_hooks_leave_logits_unchanged(family, tiny_hf_dir, gpt2_tokenizer):
    path = tiny_hf_dir(family)
    reference = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    hooked = load_hf(str(path), tokenizer=str(gpt2_tokenizer.name_or_path))
    ids = hooked.tokenizer(TEXT, return_tensors="pt")["input_ids"]
    assert ids[0].tolist() == [2215, 5335, 290, 1757, 1816, 284, 262, 3650, 11, 1757, 2921, 257, 4144, 284]
    batch = torch.cat([ids, ids.flip(1)])
    with torch.inference_mode():
        expected = reference(batch).logits
        plain = hooked.forward({"input_ids": batch})
        with hooked.sites.record(("q", "k", "v", "pattern", "z")) as store:
            recorded = hooked.forward({"input_ids": batch})
    assert (plain - expected).abs().max().item() < 1e-5
    assert (recorded - expected).abs().max().item() < 1e-5
    sites = hooked.sites
    n, t = batch.shape
    assert store[("z", 0)].shape == (n, t, sites.n_heads, sites.d_head)
    assert store[("pattern", 0)].shape == (n, sites.n_heads, t, t)
    assert store[("k", 0)].shape == (n, sites.n_kv_heads, t, sites.d_head)
    pattern = store[("pattern", 1)]
    torch.testing.assert_close(pattern.sum(-1), torch.ones(n, sites.n_heads, t))
    assert pattern.triu(1).abs().max().item() == 0.0  # causal


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_zeroing_a_head_equals_removing_its_output_projection_columns(family, tiny_hf_dir):
    """Independent of the hook path: zero head h's slice of W_O and compare logits."""
    path = tiny_hf_dir(family)
    hooked = load_hf(str(path), need_tokenizer=False)
    layer, head, dh = 1, 2, hooked.sites.d_head
    ids = torch.randint(0, 50257, (3, 11), generator=torch.Generator().manual_seed(3))

    def zero_head(z):
        z = z.clone()
        z[:, :, head] = 0
        return z

    with torch.inference_mode():
        with hooked.sites.hooks(layer, z=zero_head):
            hooked_logits = hooked.forward({"input_ids": ids})
        manual = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
        out_proj = {
            "gpt2": lambda m: m.transformer.h[layer].attn.c_proj,
            "gpt_neox": lambda m: m.gpt_neox.layers[layer].attention.dense,
        }.get(family, lambda m: m.model.layers[layer].self_attn.o_proj)(manual)
        if type(out_proj).__name__ == "Conv1D":
            out_proj.weight[head * dh : (head + 1) * dh, :] = 0
        else:
            out_proj.weight[:, head * dh : (head + 1) * dh] = 0
        manual_logits = manual(ids).logits
        clean = hooked.forward({"input_ids": ids})
    assert (hooked_logits - manual_logits).abs().max().item() < 1e-5
    assert (hooked_logits - clean).abs().max().item() > 1e-4  # the head mattered


def test_grouped_query_heads_share_their_kv_head(tiny_hf_dir):
    hooked = load_hf(str(tiny_hf_dir("llama")), need_tokenizer=False)
    sites = hooked.sites
    assert (sites.n_heads, sites.n_kv_heads) == (4, 2)
    assert [sites.kv_head_of(h) for h in range(4)] == [0, 0, 1, 1]
    ids = torch.randint(0, 50257, (2, 9), generator=torch.Generator().manual_seed(0))

    def zero_kv1(v):
        v = v.clone()
        v[:, 1] = 0
        return v

    with torch.inference_mode(), sites.record(("z",), layers=[0]) as store:
        with sites.hooks(0, v=zero_kv1):
            hooked.forward({"input_ids": ids})
    z = store[("z", 0)]
    assert z[:, :, 2:].abs().max().item() == 0.0  # query heads 2 and 3 read kv head 1
    assert z[:, :, :2].abs().max().item() > 0.0


def test_unknown_directory_and_architecture_fail_with_one_line(tmp_path):
    from headlab.errors import HeadlabError

    with pytest.raises(HeadlabError, match="cannot load local directory"):
        load_hf(str(tmp_path), need_tokenizer=False)
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    with pytest.raises(HeadlabError, match="unsupported architecture 'bert'"):
        load_hf(str(tmp_path), need_tokenizer=False)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_output_attentions_gives_the_patterns_of_plain_eager_attention(family, tiny_hf_dir):
    """Unwatched, headlab's attention makes no pattern (scaled_dot_product_attention) and returns None
    as its weights; asked for them (output_attentions=True: Llama passes the flag to the attention,
    GPT-2 collects each attention's weights with a hook), it makes them, as transformers' eager one."""
    path = tiny_hf_dir(family)
    reference = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    hooked = load_hf(str(path), need_tokenizer=False)
    ids = torch.randint(0, 1000, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = reference(ids, output_attentions=True).attentions
        got = hooked.module(ids, output_attentions=True).attentions
        unasked = hooked.module(ids)
    assert len(got) == len(expected) == hooked.n_layers
    for a, b in zip(got, expected, strict=True):
        assert a.shape == b.shape and (a - b).abs().max().item() < 1e-6
    assert unasked.attentions is None
