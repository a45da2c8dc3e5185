"""Exact QK and OV attribution (analysis/qk_attribution.py, ov_attribution.py, study=head_attribution).

The reference below knows nothing of headlab's attribution code: it reads each component's output off hooks on the
Hugging Face modules (the first block's input, o_proj's input and output, the MLP's output or its post-norm's), the
positions' rotary tables off the attention's own keyword arguments, and builds each component's query, key and value
by hand from the weights (q_proj / c_attn, the norms' formulas with their clean scales, rotate_half). Tiny random
models of six families in float64 (GPT-2 with LayerNorm biases and attention biases; Llama and Qwen2 grouped-query,
Qwen2 with q/k biases; Qwen3 and Gemma 3 with QK-norm; Gemma 2 and 3 post-norm, Gemma 2 soft-capped), every norm's
weight and every bias drawn at random. A hand-set toy transformer whose previous-token head feeds an induction head
checks that the split finds the circuit it was built with.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from torch import Tensor

import headlab
from conftest import GPT2_TOKENIZER, error_line, run_headlab, tiny_configs
from headlab.analysis import ov_attribution as ov
from headlab.analysis import qk_attribution as qk
from headlab.door import compose
from headlab.models.families import FAMILIES
from headlab.models.hf import hook_hf, register_attention
from headlab.models.norms import held_norm
from headlab.models.toy import ToyConfig, ToyTransformer, hooked_toy
from headlab.tasks import build_task

FAMILY_CASES = ["gpt2", "llama", "qwen2", "qwen3", "gemma2", "gemma3_text"]
N_PROMPTS = 3
LAYER, HEAD = 2, 3
TOL = 1e-5  # of the largest term: HF's RMSNorms round through float32 even in a float64 model


pytestmark = pytest.mark.usefixtures("one_thread")


def _random_model(family: str, tokenizer):
    from transformers import AutoModelForCausalLM

    register_attention()
    torch.manual_seed(0)
    cfg = tiny_configs()[family]
    if family == "qwen2":
        cfg.attention_bias = True  # Qwen2 has q/k/v biases: a "bias" component on both sides
    hf = AutoModelForCausalLM.from_config(cfg, attn_implementation="headlab").double().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or name.split(".")[-2].startswith("ln"):  # a norm's weight (and LayerNorm's bias)
                gemma = family.startswith("gemma") and name.endswith("weight")
                p.normal_(0.0 if gemma or name.endswith("bias") else 1.0, 0.3)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    hf.requires_grad_(False)
    return hf, hook_hf(hf, family, FAMILIES[cfg.model_type], tokenizer)


@pytest.fixture(scope="module", params=FAMILY_CASES)
def case(request, gpt2_tokenizer):
    hf, model = _random_model(request.param, gpt2_tokenizer)
    task = build_task(compose(["task=ioi", f"task.n_prompts={N_PROMPTS}"]).task)
    data = task.build(N_PROMPTS, 0, model)
    return hf, model, task, data, qk.record(model, data.inputs)


# --- the reference ---------------------------------------------------------------------------------------


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@torch.no_grad()
def reference_parts(hf, ids: Tensor, layer: int, head: int) -> dict:
    """Plain torch on the HF model: each component's query, key and value (after the held norms and rotary) of
    `head` of layer `layer` for one prompt ids [1, T], rows embed, L0H0.., MLP0, .., bias; and the clean ones."""
    cfg = hf.config
    gpt2 = cfg.model_type == "gpt2"
    gemma = cfg.model_type.startswith("gemma")
    blocks = hf.transformer.h if gpt2 else hf.model.layers
    n_heads = cfg.n_head if gpt2 else cfg.num_attention_heads
    n_kv = n_heads if gpt2 else cfg.num_key_value_heads
    d = cfg.hidden_size
    hd = getattr(cfg, "head_dim", None) or d // n_heads
    seen: dict = {}

    def pre(key):
        return lambda _m, args, kwargs: seen.__setitem__(key, (args[0] if args else kwargs["hidden_states"], kwargs))

    def post(key):
        return lambda _m, args, out: seen.__setitem__(key, (args[0], out))

    handles = [blocks[0].register_forward_pre_hook(pre("embed"), with_kwargs=True)]
    handles.append(blocks[layer].register_forward_pre_hook(pre("x"), with_kwargs=True))
    attn_of = (lambda b: b.attn) if gpt2 else (lambda b: b.self_attn)
    handles.append(attn_of(blocks[layer]).register_forward_pre_hook(pre("attn"), with_kwargs=True))
    for l in range(layer):
        o_proj = attn_of(blocks[l]).c_proj if gpt2 else attn_of(blocks[l]).o_proj
        handles.append(o_proj.register_forward_hook(post(f"o{l}")))
        if gemma:
            handles.append(blocks[l].post_attention_layernorm.register_forward_hook(post(f"A{l}")))
            handles.append(blocks[l].post_feedforward_layernorm.register_forward_hook(post(f"m{l}")))
        else:
            handles.append(blocks[l].mlp.register_forward_hook(post(f"m{l}")))
    with torch.no_grad():
        hf(input_ids=ids, use_cache=False)
    for h in handles:
        h.remove()

    def rms(x, eps):
        return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    rows = [seen["embed"][0][0]]
    bias_resid = rows[0].new_zeros(d)
    for l in range(layer):
        z, a = seen[f"o{l}"][0][0], seen[f"o{l}"][1][0]  # [T, H * hd], [T, d]
        o_proj = attn_of(blocks[l]).c_proj if gpt2 else attn_of(blocks[l]).o_proj
        w_o = o_proj.weight if gpt2 else o_proj.weight.T  # [H * hd, d]
        for h in range(n_heads):
            r = z[:, h * hd : (h + 1) * hd] @ w_o[h * hd : (h + 1) * hd]
            if gemma:
                norm = blocks[l].post_attention_layernorm
                r = r * (1 + norm.weight) * rms(a, norm.eps)
            rows.append(r)
        rows.append(seen[f"m{l}"][1][0])
        if getattr(o_proj, "bias", None) is not None:
            bias_resid = bias_resid + o_proj.bias
    rows.append(bias_resid.expand_as(rows[0]))
    comps = torch.stack(rows)  # [n, T, d]
    x = seen["x"][0][0]
    block, attn = blocks[layer], attn_of(blocks[layer])
    if gpt2:
        ln = block.ln_1
        xc, cc = x - x.mean(-1, keepdim=True), comps - comps.mean(-1, keepdim=True)
        s = torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + ln.eps)
        normed, clean = cc * ln.weight * s, xc * ln.weight * s + ln.bias
        normed[-1] = normed[-1] + ln.bias
        w, b = attn.c_attn.weight, attn.c_attn.bias  # Conv1D [d, 3d]
        proj = {key: (w[:, i * d : (i + 1) * d], b[i * d : (i + 1) * d]) for i, key in enumerate("qkv")}
        scale = hd**-0.5 / (layer + 1 if cfg.scale_attn_by_inverse_layer_idx else 1)
    else:
        norm = block.input_layernorm
        g = (1 + norm.weight) if gemma else norm.weight
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
        s = rms(x, eps)
        normed, clean = comps * g * s, x * g * s
        proj = {key: (getattr(attn, f"{key}_proj").weight.T, getattr(attn, f"{key}_proj").bias) for key in "qkv"}
        scale = cfg.query_pre_attn_scalar**-0.5 if gemma else hd**-0.5
    group = n_heads // n_kv
    index = {"q": head, "k": head // group, "v": head // group}
    cos, sin = seen["attn"][1]["position_embeddings"] if not gpt2 else (None, None)
    out = {"scale": scale}
    for key in "qkv":
        w, b = proj[key]
        cols = slice(index[key] * hd, (index[key] + 1) * hd)
        parts = normed @ w[:, cols]  # [n, T, hd]
        whole = clean @ w[:, cols]
        if b is not None:
            parts[-1] = parts[-1] + b[cols]
            whole = whole + b[cols]
        qk_norm = getattr(attn, f"{key}_norm", None) if key != "v" else None
        if qk_norm is not None:
            g = (1 + qk_norm.weight) if gemma else qk_norm.weight
            eps = getattr(qk_norm, "variance_epsilon", getattr(qk_norm, "eps", None))
            held = rms(whole, eps)
            parts, whole = parts * g * held, whole * g * held
        if key != "v" and cos is not None:
            parts = parts * cos[0] + _rotate_half(parts) * sin[0]
            whole = whole * cos[0] + _rotate_half(whole) * sin[0]
        out[key], out[f"clean_{key}"] = parts, whole
    return out


def _edges(data) -> list[tuple[int, int, int]]:
    """(prompt, query, key): END to IO and S2 to S1+1 on each prompt."""
    roles = data.token_positions
    out = []
    for b in range(data.n):
        out += [(b, int(roles["END"][b]), int(roles["IO"][b])), (b, int(roles["S2"][b]), int(roles["S1"][b]) + 1)]
    return out


# --- exactness ---------------------------------------------------------------------------------------------


def test_the_terms_add_up_to_the_score_and_equal_the_reference(case):
    hf, model, _, data, comps = case
    assert comps.error < 1e-12  # the components add up to every layer's input
    kv = model.sites.kv_head_of(HEAD)
    for b, i, j in _edges(data):
        parts = qk.layer_parts(comps, LAYER, b)
        terms = parts.terms(HEAD, kv, i, j)
        score = parts.score(HEAD, kv, i, j)
        ids = data.inputs["input_ids"][b : b + 1]
        ref = reference_parts(hf, ids, LAYER, HEAD)
        want = ref["scale"] * ref["q"][:, i] @ ref["k"][:, j].T
        size = float(want.abs().max())
        assert float((terms.sum() - score).abs()) <= TOL * size
        assert float((terms - want).abs().max()) <= TOL * size
        # the clean score is the model's own: the one its pattern was made from (before a softcap)
        real = comps.clean(LAYER)
        model_score = parts.scale * real["q"][b, HEAD, i] @ real["k"][b, kv, j]
        assert float((score - model_score).abs()) <= TOL * size
        pattern = comps.pattern[LAYER][b, HEAD, i, : i + 1]
        logits = ref["scale"] * ref["clean_q"][i] @ ref["clean_k"][: i + 1].T
        cap = model.sites.attn_softcap
        logits = torch.tanh(logits / cap) * cap if cap else logits
        seen = pattern > 0  # a sliding window (Gemma 2 and 3) hides the keys before it
        assert torch.allclose(pattern[seen], torch.softmax(logits[seen], -1), atol=1e-6)


def test_removing_a_component_with_the_norms_held_takes_off_its_total(case):
    _, model, _, data, comps = case
    roles = data.token_positions
    queries, keys = roles["END"].cpu(), roles["IO"].cpu()
    kv = model.sites.kv_head_of(HEAD)
    terms = torch.stack(
        [qk.layer_parts(comps, LAYER, b).terms(HEAD, kv, int(queries[b]), int(keys[b])) for b in range(data.n)]
    )
    names = comps.names(LAYER)
    size = float(terms.abs().sum((1, 2)).max())
    for name in ("embed", "L0H1", "L1H2", "MLP1"):
        c = names.index(name)
        for side, total in (("query", terms[:, c].sum(-1)), ("key", terms[:, :, c].sum(-1))):
            held = qk.removal(comps, LAYER, HEAD, name, side, queries, keys, held=True)
            assert float((held.change - total).abs().max()) <= TOL * size
            assert float(held.norm_change.abs().max()) < 1e-12
            free = qk.removal(comps, LAYER, HEAD, name, side, queries, keys, held=False)
            assert float(free.norm_change.abs().max()) > 1e-4  # free, the scale moves
    # a pair term: the interaction of removing c on the query side and c' on the key side
    cq, ck = names.index("L1H2"), names.index("L0H1")
    assert torch.isfinite(terms[:, cq, ck]).all()


def test_the_ov_split_adds_up_to_the_heads_direct_effect(case):
    hf, model, task, data, comps = case
    u, reads = ov.answer_direction(comps, task, data)
    effect = ov.head_effect(comps, LAYER, HEAD, reads, u)
    names = comps.names(LAYER)
    totals = []
    for b in range(data.n):
        parts = qk.layer_parts(comps, LAYER, b)
        terms = ov.ov_terms(comps, parts, LAYER, HEAD, b, int(reads[b]), u[b])  # [n, T]
        assert float((terms.sum() - effect[b]).abs()) <= TOL * float(terms.abs().sum())
        # each component's value is the reference's
        ref = reference_parts(hf, data.inputs["input_ids"][b : b + 1], LAYER, HEAD)
        kv = model.sites.kv_head_of(HEAD)
        assert float((parts.v[:, kv] - ref["v"]).abs().max()) <= TOL * float(ref["v"].abs().max())
        totals.append(terms.sum(1))
        # the direct effect through the held final norm is the logit difference's share of the head's output
        out = ov.ov_vectors(comps, parts, LAYER, HEAD, b, int(reads[b])).sum(0)
        final = comps.model.final_norm
        x = comps.trace.resid_final[b, reads[b]]
        held = held_norm(final, x, final(x), model.norm_offset)
        w_u = hf.get_output_embeddings().weight
        want = held.linear(out) @ (w_u[data.answers["io"][b]] - w_u[data.answers["s"][b]])
        assert abs(float(want - effect[b])) <= TOL * float(want.abs().clamp_min(1e-3))
    totals_t = torch.stack(totals)
    for name in ("embed", "L1H0", "MLP0"):
        removed = ov.removal(comps, LAYER, HEAD, name, reads, u, held=True)
        total = totals_t[:, names.index(name)]
        assert float((removed.change - total).abs().max()) <= TOL * float(totals_t.abs().sum(1).max())


def test_maps_read_in_chunks_equal_the_whole_product(gpt2_tokenizer):
    hf, model = _random_model("llama", gpt2_tokenizer)
    vocab = torch.arange(3000)
    embed = hf.get_input_embeddings().weight[:3000]
    w_u = hf.get_output_embeddings().weight
    first = hf.model.layers[0]
    for through in (False, True):
        found = ov.maps(
            model, [(0, 1), (2, 3)], salient=4, targets=3, vocab=vocab, chunk=700, through_first_mlp=through
        )
        for (layer, head), mappings in found.items():
            # MAPS's apply_first_mlp: a later layer's head reads block 0's MLP output (alone) on the token
            x = first.mlp(first.post_attention_layernorm(embed)) if through and layer else embed
            g = hf.model.layers[layer].input_layernorm.weight
            kv = head // 2
            w_v = hf.model.layers[layer].self_attn.v_proj.weight[kv * 16 : (kv + 1) * 16]  # [hd, d]
            w_o = hf.model.layers[layer].self_attn.o_proj.weight[:, head * 16 : (head + 1) * 16]  # [d, hd]
            out = (x * g) @ w_v.T @ w_o.T  # [V, d]
            amp = out.norm(dim=-1) / x.norm(dim=-1)
            assert [m.source for m in mappings] == amp.topk(4).indices.tolist()
            np.testing.assert_allclose([m.amplification for m in mappings], amp.topk(4).values.numpy(), rtol=1e-10)
            logits = (out[amp.topk(4).indices] * hf.model.norm.weight) @ w_u.T  # the whole vocabulary
            assert [[t for t, _ in m.targets] for m in mappings] == logits.topk(3).indices.tolist()


# --- a circuit known by construction ------------------------------------------------------------------------


def induction_toy() -> tuple:
    """A 2-layer attention-only toy transformer set by hand: L0H0 attends from each token to the one before it and
    writes that token into a subspace of its own; L1H0's query reads the current token, its key that subspace, so
    it attends to the token after an earlier copy of the current one (an induction head). LayerNorms in front."""
    V, T = 16, 24
    cfg = ToyConfig(V, n_ctx=T, n_layers=2, n_heads=2, d_model=2 * V + T, d_head=T, d_mlp=0, layer_norm=True)
    torch.manual_seed(0)
    m = ToyTransformer(cfg).double()
    tok, pos, prev = slice(0, V), slice(V, V + T), slice(V + T, 2 * V + T)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.normal_(1.0 if "ln" in name and name.endswith("weight") else 0.0, 0.01)
        m.embed.weight.zero_()
        m.embed.weight[:, tok] = 3 * torch.eye(V)
        m.pos.weight.zero_()
        m.pos.weight[:, pos] = 3 * torch.eye(T)
        a0, a1 = m.blocks[0].attn, m.blocks[1].attn
        h0 = slice(0, T)  # head 0's rows of the q, k, v projections
        for w in (a0.q.weight, a0.k.weight, a0.v.weight, a1.q.weight, a1.k.weight):
            w[h0] = 0
        a0.q.weight[h0, pos] = 30 * torch.eye(T)
        a0.k.weight[h0, pos] = torch.eye(T).roll(1, 0).tril()  # key at j: the query feature of j + 1
        a0.v.weight[:V, tok] = torch.eye(V)
        a0.o.weight[:, h0] = 0
        a0.o.weight[prev, :V] = 3 * torch.eye(V)
        a1.q.weight[:V, tok] = 30 * torch.eye(V)
        a1.k.weight[:V, prev] = torch.eye(V)
    g = torch.Generator().manual_seed(1)
    half = torch.stack([torch.randperm(V, generator=g)[:10] for _ in range(4)])
    return hooked_toy(m.eval(), "toy-induction"), torch.cat([half, half], 1)


def test_the_previous_token_head_builds_the_induction_heads_key():
    model, ids = induction_toy()
    comps = qk.record(model, {"input_ids": ids})
    queries = torch.arange(10, 20)
    assert float(comps.pattern[0][:, 0, torch.arange(1, 20), torch.arange(19)].mean()) > 0.99  # previous token
    assert float(comps.pattern[1][:, 0, queries, queries - 9].mean()) > 0.9  # induction
    for b in range(ids.shape[0]):
        parts = qk.layer_parts(comps, 1, b)
        for i in (12, 15, 19):
            terms = parts.terms(0, 0, i, i - 9)
            key_side = dict(zip(parts.names, terms.sum(0).tolist()))
            query_side = dict(zip(parts.names, terms.sum(1).tolist()))
            assert max(key_side, key=key_side.get) == "L0H0"  # the previous-token head, first on the key side
            assert max(query_side, key=query_side.get) == "embed"  # the current token, on the query side
            assert key_side["L0H0"] > 0.9 * float(terms.sum())
    # taking L0H0 out of the key side's residual stream (norms held) takes off its whole total
    queries, keys = torch.full((4,), 15), torch.full((4,), 6)
    removed = qk.removal(comps, 1, 0, "L0H0", "key", queries, keys)
    expected = torch.stack([qk.layer_parts(comps, 1, b).terms(0, 0, 15, 6)[:, 1].sum() for b in range(4)])
    assert torch.allclose(removed.change, expected, rtol=1e-10)


# --- the study ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama-attribution")
    AutoModelForCausalLM.from_config(tiny_configs()["llama"]).save_pretrained(path)
    return path


def _args(path, run_dir, *more: str) -> list[str]:
    return [
        "run",
        "study=head_attribution",
        "model=hf",
        f"model.path={path}",
        f"model.tokenizer={GPT2_TOKENIZER}",
        "task=ioi",
        "task.n_prompts=4",
        "output.n_boot=50",
        f"output.root={run_dir.parent}",
        f"hydra.run.dir={run_dir}",
        *more,
    ]


def test_the_study_writes_a_tidy_table_whose_terms_add_up(tiny_llama_dir, tmp_path):
    run_dir = tmp_path / "run"
    args = _args(
        tiny_llama_dir,
        run_dir,
        "study.heads=[L2H1,L1H3]",
        "study.edges=[END:IO,S2:S1+1]",
        "study.top=5",
        "study.maps_vocab=prompts",
    )
    result = run_headlab(*args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    table = pd.read_parquet(run_dir / "results.parquet")
    meta = json.loads((run_dir / "meta.json").read_text())
    assert set(table["edge"].dropna()) == {"END:IO", "S2:S1+1", "read"}
    terms = table[table["metric"] == "qk_term"]
    assert len(terms) == 2 * 2 * 5 and terms["query_component"].notna().all() and terms["key_component"].notna().all()
    for (layer, head, edge), rows in table[table["method"] == "qk_attribution"].groupby(["layer", "head", "edge"]):
        score = rows.loc[rows["metric"] == "qk_score", "value"].item()
        for side in ("query", "key"):  # every component of a side: the totals add up to the mean score
            total = rows.loc[rows["metric"] == f"qk_{side}_total", "value"].sum()
            assert abs(total - score) <= 1e-5 * max(1.0, abs(score))
        assert meta["heads"][f"L{layer}H{head}"][edge]["sum_error"] < 1e-4
        assert meta["heads"][f"L{layer}H{head}"][edge]["removal_error"] < 1e-4
    held = table[(table["metric"] == "qk_removal") & (table["method"] == "held")]
    assert len(held) == 2 * 2 * 2 * 3  # heads x edges x sides x checks
    ov_rows = table[table["method"] == "ov_attribution"]
    for _, rows in ov_rows.groupby(["layer", "head"]):
        effect = rows.loc[rows["metric"] == "ov_direct_effect", "value"].item()
        assert abs(rows.loc[rows["metric"] == "ov_source_total", "value"].sum() - effect) <= 1e-5
    assert set(table.loc[table["metric"] == "ov_source_total", "source"]) >= {"IO", "S1", "S2", "END", "first"}
    assert not (table["method"] == "maps").any()  # the prompts' tokens alone: not MAPS, named for what they read
    maps = table[table["metric"] == "prompt_token_target"]
    assert len(maps) == 2 * 5 * 5 and maps["token"].notna().all() and maps["target"].notna().all()
    model = headlab.load_model(str(tiny_llama_dir), tokenizer=str(GPT2_TOKENIZER), root=str(tmp_path))
    data = headlab.load_task("ioi").build(4, seed=20_000, model=model)  # the study's prompts: seed + 20,000
    words = {model.tokenizer.decode([t]) for t in data.inputs["input_ids"].unique().tolist()}
    assert set(maps["token"]) <= words  # the sources: the prompts' tokens
    qk_rows = table[table["method"] == "qk_attribution"]
    assert (qk_rows["hook"] == "blocks." + qk_rows["layer"].astype(str) + ".attn.hook_attn_scores").all()
    assert "L1H3" in result.stdout and "key side" in result.stdout


@pytest.mark.parametrize(
    ("more", "said"),
    [
        ((), "study.heads=[]: expected a list of at least 1, each a head LnHm"),
        (("study.heads=[L7H0]",), "L7H0 is not a head"),
        (("study.heads=[L1H0]", "study.edges=[IO:END]"), "key after its query"),
        (("study.heads=[L1H0]", "study.edges=[END:XY]"), "no role XY"),
        (("study.heads=[1.0]",), "a head LnHm"),
    ],
)
def test_bad_input_is_refused_in_one_line_and_nothing_is_written(tiny_llama_dir, tmp_path, more, said):
    run_dir = tmp_path / "run"
    result = run_headlab(*_args(tiny_llama_dir, run_dir, *more), cwd=tmp_path)
    line = error_line(result)
    assert result.returncode != 0 and said in line and len(line) < 200
    assert not (run_dir / "results.parquet").exists() and not (run_dir / "meta.json").exists()


def test_the_study_yaml_holds_the_options_defaults():
    import dataclasses

    from headlab.studies.head_attribution import HeadAttributionOptions

    composed = compose(["study=head_attribution", "study.heads=[L0H0]"]).study  # no heads: refused at the door
    assert dataclasses.asdict(composed) == dataclasses.asdict(HeadAttributionOptions(heads=["L0H0"]))


# --- the atlas's cards -------------------------------------------------------------------------------------


def test_the_atlas_card_of_the_induction_head_names_the_previous_token_head_on_the_key_side():
    from headlab.studies.atlas_attribution import attribution_cards

    model, ids = induction_toy()
    cards = attribution_cards(model, ids[0], None)
    json.dumps(cards)  # what the page inlines
    card = cards["attribution"]["L1H0"]
    query, key, weight = card["edge"]
    assert query >= 10 and int(ids[0, key - 1]) == int(ids[0, query]) and weight > 0.9  # its induction edge
    assert card["key"][0][0] == "L0H0" and card["query"][0][0] == "embed"
    assert cards["attribution"]["L0H0"]["edge"][1] == cards["attribution"]["L0H0"]["edge"][0] - 1  # previous token
    assert len(cards["maps"]["L1H0"]) == 3 and all(len(m[2]) == 3 for m in cards["maps"]["L1H0"])


PAGE_PROBE = """<script>
(function () {
  document.querySelector('#atlas-grid td[data-head="L1H0"]').click();
  const card = document.getElementById("atlas-card");
  const splits = [...card.querySelectorAll("div.split")].map((d) => d.textContent);
  const keyLinks = [...card.querySelectorAll("div.split")][1].querySelectorAll("a");
  const cells = {};
  for (const td of document.querySelectorAll("#atlas-grid td[data-head]")) {
    const code = td.querySelector(".code");
    cells[td.dataset.head] = {code: code ? code.textContent : "", mark: !!td.querySelector(".mark")};
  }
  const legend = [...document.querySelectorAll("#atlas-codes span")].map((s) => s.textContent);
  const probe = document.createElement("pre");
  probe.id = "probe";
  probe.textContent = JSON.stringify({splits, key: keyLinks.length ? keyLinks[0].dataset.head : null, cells, legend,
    maps: card.querySelectorAll("ul.maps li").length, width: document.getElementById("atlas-grid").offsetWidth,
    page: document.body.offsetWidth});
  document.body.appendChild(probe);
})();
</script>"""


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_a_card_on_a_model_whose_norms_move_shows_its_largest_removal_held_and_free(family, gpt2_tokenizer):
    from headlab.studies.atlas_attribution import attribution_cards

    _, model = _random_model(family, gpt2_tokenizer)
    ids = torch.tensor(gpt2_tokenizer(" the cat sat on the mat and the cat sat on the")["input_ids"])
    cards = attribution_cards(model, ids, None)["attribution"]
    if family == "llama":  # no QK-norm, no post-norms: the split alone
        assert not any("removal" in card for card in cards.values())
        return
    assert qk.norms_move(model)
    for card in cards.values():
        name, held, free, _, qk_moved = card["removal"]
        top, total = card["query"][0]
        assert name == top and held == pytest.approx(total, abs=1e-3)  # held: the split's own total
        assert qk_moved is not None
    assert any(abs(card["removal"][2] - card["removal"][1]) > 1e-3 for card in cards.values())  # free moves


def test_the_atlas_page_shows_the_split_and_a_legend_for_every_code(tmp_path):
    import html
    import re

    from headlab.report.atlas_page import page
    from headlab.studies.atlas_attribution import attribution_cards
    from headlab.studies.atlas_probes import rules
    from headlab.studies.atlas_rules import rule_texts
    from test_report import CHROMIUM, chromium, script_error

    if CHROMIUM is None:
        pytest.skip("no Chromium installed (Debian package: chromium)")
    model, ids = induction_toy()
    cards = attribution_cards(model, ids[0], None)
    labels = {"L0H0": "previous-token, sink", "L0H1": "sink", "L1H0": "induction", "L1H1": "sink"}
    table = pd.DataFrame(
        [
            {
                "layer": int(n[1]),
                "head": int(n[3]),
                "metric": "induction_score",
                "value": 0.5,
                "ci_low": 0.4,
                "ci_high": 0.6,
                "rank": 1,
                "n": 4,
                "label": lab,
                "rule": "; ".join(["a rule"] * len(lab.split(", "))),
            }
            for n, lab in labels.items()
        ]
    )
    codes = {rule.label: rule.code for rule in rules()}
    text = page(table, {**cards, "rules": rule_texts(rules()), "codes": codes, "model": "toy-induction"})
    probed = tmp_path / "atlas.html"
    probed.write_text(text.replace("</body>", PAGE_PROBE + "</body>"))
    dom = chromium("--dump-dom", "--window-size=1200,900", probed.as_uri(), profile=tmp_path / "profile").stdout
    assert script_error(dom) is None
    probe = json.loads(html.unescape(re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S)[1]))
    assert probe["splits"][0].startswith("builds the query: embed") and probe["key"] == "L0H0"
    assert probe["cells"]["L1H0"] == {"code": "IND", "mark": False}
    assert probe["cells"]["L0H0"] == {"code": "PT", "mark": True} and probe["cells"]["L0H1"] == {
        "code": "",
        "mark": True,
    }
    assert any(s.startswith("IND induction (1 of 4") for s in probe["legend"])
    assert any("sink (3 of 4, most heads: a mark" in s for s in probe["legend"])
    assert probe["maps"] == 3 and probe["width"] >= 0.9 * probe["page"]  # the grid uses the page


def test_the_shapes_in_the_types_catch_transformerlenss_layout():
    """q, k and v put the head axis before position (models/sites.py), where TransformerLens's hook_q puts it
    after: the jaxtyping shapes, checked in the suite (conftest.py), refuse the other layout."""
    from headlab.models.hooked import Trace

    n, heads, kv, pos, d = 3, 4, 2, 5, 8
    parts = dict(
        names=["embed", "L0H0", "bias"],
        q=torch.zeros(n, heads, pos, d),
        k=torch.zeros(n, kv, pos, d),
        v=torch.zeros(n, kv, pos, d),
        clean_q=torch.zeros(heads, pos, d),
        clean_k=torch.zeros(kv, pos, d),
        clean_v=torch.zeros(kv, pos, d),
        scale=d**-0.5,
    )
    assert qk.LayerParts(**parts).terms(1, 0, 4, 2).shape == (n, n)
    with pytest.raises(TypeError):
        qk.LayerParts(**{**parts, "q": parts["q"].transpose(1, 2)})  # [n, pos, head, d_head]
    with pytest.raises(TypeError):
        Trace(2, [torch.zeros(2, pos, 16)], [], torch.zeros(3, pos, 16))  # the batch differs
