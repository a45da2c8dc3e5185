"""Composition scores (analysis/head_composition.py, `scores=composition`): the weights HeadSites reads
against the model's own q, k, v; the scores against the definition with explicit d_model x d_model
products and against TransformerLens on the same random GPT-2; GQA; the study's table."""

from __future__ import annotations

import json

import pytest
import torch

import headlab
from conftest import HF_FAMILIES, run_headlab
from headlab.analysis.head_composition import composition
from headlab.models.hf import load_hf


def explicit(model, mode: str, l1: int, h1: int, l2: int, h2: int) -> tuple[float, torch.Tensor]:
    """The score and all normalised singular values from full d_model x d_model matrices."""
    sites = model.sites
    group = sites.n_heads // sites.n_kv_heads
    q1, k1, v1 = (w.double() for w in sites.W_QKV(l1))
    q2, k2, v2 = (w.double() for w in sites.W_QKV(l2))
    left = v1[h1 // group] @ sites.W_O(l1)[h1].double()
    right = {
        "q": q2[h2] @ k2[h2 // group].T,
        "k": k2[h2 // group] @ q2[h2].T,
        "v": v2[h2 // group] @ sites.W_O(l2)[h2].double(),
    }[mode]
    norms = torch.linalg.matrix_norm(left) * torch.linalg.matrix_norm(right)
    return (torch.linalg.matrix_norm(left @ right) / norms).item(), torch.linalg.svdvals(left @ right) / norms


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_head_weights_give_the_q_k_v_the_model_computes(tiny_hf_dir, family):
    model = load_hf(str(tiny_hf_dir(family)), name=family, need_tokenizer=False)
    ids = torch.randint(0, 1000, (2, 1), generator=torch.Generator().manual_seed(0))  # position 0: no rotation
    attn = model.sites.attn_modules[1]
    projected = {}  # a per-head q or k norm (Gemma 3, Qwen3) comes after W_Q and W_K: read q and k before it
    handles = [
        getattr(attn, f"{site}_proj").register_forward_hook(
            lambda _m, _a, out, site=site: projected.__setitem__(site, out.unflatten(-1, (-1, model.sites.d_head)))
        )
        for site in ("q", "k")
        if getattr(attn, f"{site}_norm", None) is not None
    ]
    with torch.no_grad(), model.sites.record(sites=("q", "k", "v")) as seen:
        model.forward({"input_ids": ids})
        x = model.attn_inputs[1](model.trace({"input_ids": ids}).resid_pre[1])  # layer 1's normed input
    for handle in handles:
        handle.remove()
    for site, w in zip(("q", "k", "v"), model.sites.W_QKV(1)):
        got = projected[site][:, 0] if site in projected else seen[(site, 1)][:, :, 0]  # [batch, head, d_head]
        bias = got - torch.einsum("bm,hmd->bhd", x[:, 0], w)
        assert torch.allclose(bias[0], bias[1], atol=1e-5), f"{family} {site}: not x @ W + a constant"
        assert got.shape[1] == w.shape[0]


def test_scores_and_channels_equal_the_definition_and_gqa_shares_kv(tiny_hf_dir):
    # 4 query heads on 2 kv heads: `explicit` takes query head h's W_K and W_V from kv head h // 2
    model = load_hf(str(tiny_hf_dir("llama")), name="llama", need_tokenizer=False)
    found = composition(model, channels=3)
    for mode in ("q", "k", "v"):
        assert found.scores[mode][1, :, 0].isnan().all() and found.scores[mode][2, :, 1].isnan().all()
        for l1, h1, l2, h2 in ((0, 0, 1, 3), (0, 3, 2, 1), (1, 2, 2, 2)):
            score, sv = explicit(model, mode, l1, h1, l2, h2)
            assert found.scores[mode][l1, h1, l2, h2].item() == pytest.approx(score, rel=1e-9)
            assert found.channels[mode][l1, h1, l2, h2] == pytest.approx(sv[:3].tolist(), rel=1e-7, abs=1e-12)
    alone = composition(model, channels=0)  # no SVDs: the same scores, no channels
    for mode in ("q", "k", "v"):
        torch.testing.assert_close(alone.scores[mode], found.scores[mode], rtol=1e-12, atol=0, equal_nan=True)
        assert alone.channels[mode].shape[-1] == 0


def tl_gpt2(hf, processed: bool = False):
    """TransformerLens's HookedTransformer on hf's weights: raw, or processed as from_pretrained does by default."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions import convert_gpt2_weights

    c = hf.config
    cfg = HookedTransformerConfig(
        n_layers=c.n_layer,
        d_model=c.n_embd,
        d_head=c.n_embd // c.n_head,
        n_heads=c.n_head,
        d_mlp=4 * c.n_embd,
        d_vocab=c.vocab_size,
        n_ctx=c.n_positions,
        act_fn="gelu_new",
        normalization_type="LN",
    )
    model = HookedTransformer(cfg)
    if processed:  # from_pretrained's defaults: fold_ln, center_writing_weights, center_unembed, fold_value_biases
        model.load_and_process_state_dict(convert_gpt2_weights(hf, cfg))
        return model
    model.load_and_process_state_dict(
        convert_gpt2_weights(hf, cfg),
        fold_ln=False,
        center_writing_weights=False,
        center_unembed=False,
        fold_value_biases=False,
    )
    return model


def randomise_norms(hf) -> None:
    """Norm scales and biases away from their initial 1 and 0, so that folding them changes the scores."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "ln" in name or "norm" in name:
                p.copy_(p + 0.5 * torch.randn(p.shape, generator=generator))


def test_scores_equal_transformerlens_on_the_same_gpt2_weights(tiny_hf_dir):
    pytest.importorskip("transformer_lens")
    model = load_hf(str(tiny_hf_dir("gpt2")), name="gpt2", need_tokenizer=False)
    tl = tl_gpt2(model.module)
    found = composition(model)
    for mode in ("q", "k", "v"):
        theirs = tl.all_composition_scores(mode.upper()).double()  # 0 where the writer is not earlier
        ours = torch.nan_to_num(found.scores[mode], nan=0.0)
        assert torch.allclose(ours, theirs, atol=1e-5), f"{mode}: {(ours - theirs).abs().max():.2e}"
        assert (ours > 0).sum() == 3 * 16  # layer pairs (0,1), (0,2), (1,2) x 4 x 4 heads


def test_folded_scores_equal_transformerlens_default_processing_and_differ_from_the_raw_ones(tiny_hf_dir):
    pytest.importorskip("transformer_lens")
    model = load_hf(str(tiny_hf_dir("gpt2")), name="gpt2", need_tokenizer=False)
    randomise_norms(model.module)
    tl = tl_gpt2(model.module, processed=True)
    assert tl.cfg.normalization_type == "LNPre"  # TransformerLens did fold the LayerNorms
    folded, raw = composition(model, fold_norms=True), composition(model)
    for mode in ("q", "k", "v"):
        theirs = tl.all_composition_scores(mode.upper()).double()
        ours = torch.nan_to_num(folded.scores[mode], nan=0.0)
        assert torch.allclose(ours, theirs, atol=1e-5), f"{mode}: {(ours - theirs).abs().max():.2e}"
        apart = (ours - torch.nan_to_num(raw.scores[mode], nan=0.0)).abs().max()
        assert apart > 1e-2, f"{mode}: folding changed the scores by {apart:.2e} only"


def rms_explicit(model, mode: str, l1: int, h1: int, l2: int, h2: int) -> float:
    """The score of an RMSNorm model with each layer's attention norm scale multiplied into its W_Q, W_K, W_V by
    hand (the writer's W_V too), full d_model x d_model products, nothing centred."""
    sites = model.sites
    group = sites.n_heads // sites.n_kv_heads
    scale = [model.module.model.layers[layer].input_layernorm.weight.double()[:, None] for layer in (l1, l2)]
    v1 = sites.W_QKV(l1)[2].double()[h1 // group] * scale[0]
    q2, k2, v2 = (w.double() * scale[1] for w in sites.W_QKV(l2))
    left = v1 @ sites.W_O(l1)[h1].double()
    right = {
        "q": q2[h2] @ k2[h2 // group].T,
        "k": k2[h2 // group] @ q2[h2].T,
        "v": v2[h2 // group] @ sites.W_O(l2)[h2].double(),
    }[mode]
    norms = torch.linalg.matrix_norm(left) * torch.linalg.matrix_norm(right)
    return (torch.linalg.matrix_norm(left @ right) / norms).item()


def tl_llama(hf):
    """TransformerLens's HookedTransformer on a Llama's weights, processed as from_pretrained does by default."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions import convert_llama_weights

    c = hf.config
    d_head = c.hidden_size // c.num_attention_heads
    cfg = HookedTransformerConfig(
        n_layers=c.num_hidden_layers,
        d_model=c.hidden_size,
        d_head=d_head,
        n_heads=c.num_attention_heads,
        n_key_value_heads=c.num_key_value_heads,
        d_mlp=c.intermediate_size,
        d_vocab=c.vocab_size,
        n_ctx=c.max_position_embeddings,
        act_fn="silu",
        normalization_type="RMS",
        positional_embedding_type="rotary",
        rotary_dim=d_head,
        gated_mlp=True,
        final_rms=True,
        original_architecture="LlamaForCausalLM",
    )
    model = HookedTransformer(cfg)
    model.load_and_process_state_dict(convert_llama_weights(hf, cfg))
    return model


def test_folded_scores_of_a_gqa_rms_model_equal_transformerlens(tiny_hf_dir):
    pytest.importorskip("transformer_lens")
    model = load_hf(str(tiny_hf_dir("llama")), name="llama", need_tokenizer=False)
    randomise_norms(model.module)
    tl = tl_llama(model.module)
    assert tl.cfg.normalization_type == "RMSPre"  # TransformerLens did fold the RMSNorms
    folded = composition(model, fold_norms=True)
    for mode in ("q", "k", "v"):
        theirs = tl.all_composition_scores(mode.upper()).double()
        ours = torch.nan_to_num(folded.scores[mode], nan=0.0)
        assert torch.allclose(ours, theirs, atol=1e-5), f"{mode}: {(ours - theirs).abs().max():.2e}"


def test_an_rms_model_folds_the_scale_and_centres_nothing(tiny_hf_dir):
    model = load_hf(str(tiny_hf_dir("llama")), name="llama", need_tokenizer=False)
    randomise_norms(model.module)
    folded, raw = composition(model, fold_norms=True), composition(model)
    for mode in ("q", "k", "v"):
        for l1, h1, l2, h2 in ((0, 0, 1, 3), (0, 3, 2, 1), (1, 2, 2, 2)):
            want = rms_explicit(model, mode, l1, h1, l2, h2)
            assert folded.scores[mode][l1, h1, l2, h2].item() == pytest.approx(want, rel=1e-9)
            assert abs(want - raw.scores[mode][l1, h1, l2, h2].item()) > 1e-4


def test_the_study_writes_one_row_per_pair_mode_and_channel(tiny_hf_dir, tmp_path):
    path = tiny_hf_dir("gpt_neox")
    result = headlab.run(
        "model=hf", f"model.path={path}", "model.name=neox", "scores=composition", "scores.channels=2",
        "study.fold_norms=false", f"output.root={tmp_path}", f"hydra.run.dir={tmp_path / 'run'}",
    )  # fmt: skip
    table = result.table
    scores = table[table["metric"] == "k_composition"]
    assert len(scores) == 3 * 16 and scores["writer_layer"].lt(scores["layer"]).all()
    channels = table[table["metric"] == "v_channel"]
    assert len(channels) == 3 * 16 * 2 and set(channels["channel"]) == {1, 2}
    model = load_hf(str(path), name="neox", need_tokenizer=False)
    row = scores[(scores["writer_layer"] == 0) & (scores["writer_head"] == 2) & (scores["layer"] == 2)]
    assert row[row["head"] == 1]["value"].item() == pytest.approx(explicit(model, "k", 0, 2, 2, 1)[0], rel=1e-9)
    assert (result.run_dir / "figures" / "composition_k_composition.png").is_file()
    meta = json.loads((result.run_dir / "meta.json").read_text())
    assert meta["weight_processing"].startswith("raw")  # study.fold_norms=false: named beside the numbers
    done = run_headlab(  # the command line prints the model's provenance beside it
        "run", "model=hf", f"model.path={path}", "model.name=neox", "scores=composition", "scores.channels=0",
        f"output.root={tmp_path}", f"hydra.run.dir={tmp_path / 'cli'}", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


def test_gemma_folds_its_qk_norms_and_its_attention_output_norm(tiny_hf_dir):
    """Gemma 3: each reader's W_Q, W_K, W_V scaled by (1 + its input norm's weight), W_Q and W_K's d_head
    columns by (1 + q_norm's and k_norm's), each W_O's d_model columns by (1 + post_attention_layernorm's),
    all by hand on full d_model x d_model products."""
    model = load_hf(str(tiny_hf_dir("gemma3_text")), name="gemma3_text", need_tokenizer=False)
    randomise_norms(model.module)
    folded, sites = composition(model, fold_norms=True), model.sites
    group = sites.n_heads // sites.n_kv_heads
    layers = model.module.model.layers

    def weights(layer: int):
        block = layers[layer]
        scale = 1 + block.input_layernorm.weight.double()[:, None]
        q, k, v = (w.double() * scale for w in sites.W_QKV(layer))
        q, k = q * (1 + block.self_attn.q_norm.weight.double()), k * (1 + block.self_attn.k_norm.weight.double())
        o = sites.W_O(layer).double() * (1 + block.post_attention_layernorm.weight.double())
        return q, k, v, o

    for mode in ("q", "k", "v"):
        for l1, h1, l2, h2 in ((0, 0, 1, 3), (0, 3, 2, 1), (1, 2, 2, 2)):
            _, _, v1, o1 = weights(l1)
            q2, k2, v2, o2 = weights(l2)
            left = v1[h1 // group] @ o1[h1]
            right = {"q": q2[h2] @ k2[h2 // group].T, "k": k2[h2 // group] @ q2[h2].T, "v": v2[h2 // group] @ o2[h2]}
            norms = torch.linalg.matrix_norm(left) * torch.linalg.matrix_norm(right[mode])
            want = (torch.linalg.matrix_norm(left @ right[mode]) / norms).item()
            # 1 + w is formed in the weights' float32, as Gemma's RMSNorm forms it
            assert folded.scores[mode][l1, h1, l2, h2].item() == pytest.approx(want, rel=1e-6)
