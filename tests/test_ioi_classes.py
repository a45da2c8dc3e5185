"""study=ioi_classes: Wang et al.'s head classes by path patching, round by round from the logits back; the
path patching it runs (one position per round, per-query-head receivers) against plain torch."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

import headlab
from conftest import error_line, run_headlab
from headlab.analysis.ioi_classes import CLASS_METHOD, KNOCKOUT, READS, UNCLASSED, class_shares, classify, with_s1_next
from headlab.figures import FIGURES
from headlab.figures import ioi_classes as class_figure
from headlab.interventions import Intervention
from headlab.interventions.path import Held, path_patch
from headlab.models.hf import load_hf


def _grids(shape: tuple[int, int]) -> dict[str, np.ndarray]:
    return {name: np.zeros(shape) for name in READS}


def test_each_class_follows_its_stated_rule_and_a_head_keeps_its_first_class():
    shape = (4, 3)
    a = _grids(shape)
    a["attn_end_to_io"][3, 0] = a["attn_end_to_io"][3, 1] = a["attn_end_to_io"][2, 2] = a["attn_end_to_io"][2, 1] = 0.6
    a["attn_end_to_s2"][2, 0] = 0.5
    a["attn_s2_to_s1_next"][1, 0] = 0.7
    a["attn_s2_to_s1"][1, 1] = 0.4
    a["attn_s2_to_s1"][1, 2] = a["attn_s2_to_s1_next"][1, 2] = 0.05  # neither pattern reaches 0.1
    a["attn_s1_next_to_s1"][0, 2] = 0.9
    a["attn_end_to_io"][0, 1] = 0.05  # more than S2, but under 0.1
    clean = 4.0  # tau 0.05: a class needs an effect of 0.2
    nan = np.full(shape, np.nan)
    logits, backup, q, v, k = (nan.copy() for _ in range(5))
    logits[3, 0], logits[3, 1], logits[2, 2], logits[2, 0], logits[1, 0] = -1.0, -0.19, 0.5, -0.9, 0.3
    logits[2, 1], logits[0, 1] = -0.1, -0.5
    backup[2, 1], backup[3, 1], backup[3, 0] = -0.35, -0.25, -2.0  # 3.1 grew by 0.06 only; 3.0 is a mover
    q[2, 0], q[1, 1], q[0, 0] = -0.4, -0.3, -0.3
    v[1, 0], v[1, 1], v[0, 2], v[2, 0], v[1, 2] = -0.3, -0.25, -0.05, -0.5, -0.3  # 2.0 is an S-inhibition head
    k[0, 2], k[0, 1] = -0.3, -0.3
    effects = {"logits": logits, "backup": backup, "q": q, "v": v, "k": k}
    found = classify(effects, a, clean, tau=0.05, min_attention=0.1)
    # 3.1 falls short of 0.2; 2.0 has the effect but attends S2, not IO
    assert found["name mover"] == ["3.0"]
    assert found["negative name mover"] == ["2.2"]
    assert found["backup name mover"] == ["2.1"]
    assert found["S-inhibition"] == ["2.0"]  # unclassed in the first round, classed in the second
    assert found["induction"] == ["1.0"]  # a negative name mover's size of effect, but attends neither name
    assert found["duplicate token"] == ["1.1"]  # 1.2 attends S1 and S1+1 too little
    assert found[UNCLASSED["logits"]] == ["0.1"]  # listed once, under the first round it reached
    assert found[UNCLASSED["q"]] == ["0.0"]  # lowers the queries but attends neither name from END
    assert found[UNCLASSED["v"]] == ["1.2"]
    assert found["previous token"] == ["0.2"] and found[UNCLASSED["k"]] == []
    assert "S-inhibition" not in classify({"logits": logits}, a, clean, tau=0.05)


def test_class_shares_are_the_share_of_prompt_resamples_keeping_a_class():
    rng = np.random.default_rng(1)
    shape, n = (2, 2), 12
    a = {name: np.zeros((*shape, n)) for name in READS}
    a["attn_end_to_io"][1, 0] = rng.uniform(0.2, 0.8, n)
    a["attn_end_to_s2"][1, 0] = rng.uniform(0.0, 0.6, n)
    logits = np.full((*shape, n), np.nan)
    logits[1, 0] = rng.normal(-0.1, 0.3, n)
    logits[0, 1] = rng.normal(-0.3, 0.2, n)
    clean = rng.normal(3.0, 0.5, n)
    found = classify({"logits": logits.mean(-1)}, {k: x.mean(-1) for k, x in a.items()}, clean.mean(), tau=0.03)
    shares = class_shares({"logits": logits}, a, clean, found, tau=0.03, n_boot=400, seed=7)
    draws = np.random.default_rng(7).integers(0, n, size=(400, n))  # the resamples, drawn by hand
    size = 0.03 * np.abs(clean[draws].mean(1))
    effect, io, s2 = logits[1, 0][draws].mean(1), a["attn_end_to_io"][1, 0][draws], a["attn_end_to_s2"][1, 0][draws]
    mover = (effect <= -size) & (io.mean(1) >= 0.1) & (io.mean(1) > s2.mean(1))
    assert found["name mover"] == ["1.0"] and shares["name mover"]["1.0"] == pytest.approx(mover.mean())
    assert 0 < shares["name mover"]["1.0"] < 1
    lost = np.abs(logits[0, 1][draws].mean(1)) >= size  # 0.1 attends neither name: unclassed when large
    assert shares[UNCLASSED["logits"]]["0.1"] == pytest.approx(lost.mean())


# ---- path patching against plain torch on a tiny grouped-query Llama (4 query heads on 2 kv heads) ---------


@pytest.fixture(scope="module")
def llama(tiny_hf_dir, gpt2_tokenizer):
    from transformers import AutoModelForCausalLM

    model = load_hf(str(tiny_hf_dir("llama")), need_tokenizer=False, dtype="float64")
    model.tokenizer = gpt2_tokenizer
    module = AutoModelForCausalLM.from_pretrained(tiny_hf_dir("llama"), dtype=torch.float64).eval()  # untouched
    task = headlab.load_task("ioi")
    return model, module, task, with_s1_next(task.build(8, seed=1, model=model))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """z [b, pos, head, d] of plain causal attention; k, v shared by groups of query heads."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    causal = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).triu(1)
    return (scores.masked_fill(causal, float("-inf")).softmax(-1) @ v).transpose(1, 2)


def _forward(module, ids: torch.Tensor, edit=None) -> tuple[torch.Tensor, list[dict]]:
    """The HF Llama's own modules called by hand: logits and, per layer, q, k (after rotary), v and z;
    edit(layer, z, parts) may return another z."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    m, (b, length) = module.model, ids.shape
    d = module.config.head_dim
    h = m.embed_tokens(ids)
    cos, sin = m.rotary_emb(h, torch.arange(length)[None])
    seen = []
    for layer, block in enumerate(m.layers):
        attn, x = block.self_attn, block.input_layernorm(h)
        q, k, v = (proj(x).view(b, length, -1, d).transpose(1, 2) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        parts = {"q": q, "k": k, "v": v}
        z = _attend(q, k, v)
        z = z if edit is None else edit(layer, z, parts)
        seen.append({"z": z, **parts})
        h = h + attn.o_proj(z.flatten(-2))
        h = h + block.mlp(block.post_attention_layernorm(h))
    return module.lm_head(m.norm(h)), seen


def _by_hand(module, data, sender, role, receivers, site, held=()) -> torch.Tensor:
    """Wang et al.'s two passes, per prompt logit difference: the sender's z at `role` from ABC, every head of
    its layer and later at its clean z; then receiver r alone gets z_r from its own q, k, v with the pass-A
    value at `role` (v: A_r v_patched; k: softmax(q_r k_patched^T / sqrt(d) + mask) v). `held`: (layer,
    head, value [n, d]) at END in every pass."""
    rows, end = torch.arange(data.n), data.positions[:, 0]
    at = data.token_positions[role]
    rep = module.config.num_attention_heads // module.config.num_key_value_heads

    def hold(layer, z, _parts):
        for l, h, value in held:
            if l == layer:
                z = z.clone()
                z[rows, end, h] = value
        return z

    _, clean = _forward(module, data.inputs["input_ids"], hold)
    _, abc = _forward(module, data.reference["input_ids"][data.reference_rows], hold)  # prompt i's own ABC version
    s_layer, s_head = sender

    def pass_a(layer, z, _parts):
        if layer < s_layer:
            return z
        z = clean[layer]["z"].clone()
        if layer == s_layer:
            z[rows, at, s_head] = abc[layer]["z"][rows, at, s_head]
        return z

    logits, a = _forward(module, data.inputs["input_ids"], pass_a)

    def pass_b(layer, z, parts):
        z = hold(layer, z, parts)
        for l, r in receivers:
            if l == layer:
                g = r // rep
                q, k, v = (
                    parts["q"][:, r : r + 1].clone(),
                    parts["k"][:, g : g + 1].clone(),
                    parts["v"][:, g : g + 1].clone(),
                )
                mine = {"q": q, "k": k, "v": v}[site]
                mine[rows, 0, at] = a[layer][site][rows, r if site == "q" else g, at]
                z = z.clone()
                z[:, :, r] = _attend(q, k, v)[:, :, 0]
        return z

    if receivers:
        logits, _ = _forward(module, data.inputs["input_ids"], pass_b)
    last = logits[rows, end]
    return last[rows, data.answers["io"]] - last[rows, data.answers["s"]]


@pytest.mark.parametrize(
    "sender,role,receivers,site",
    [
        ((1, 0), "END", "logits", None),  # per-position sender patching into the logits
        ((0, 1), "S2", "1.2", "v"),  # z_r = A_r v_patched, sibling 1.3 clean
        ((0, 1), "S2", "1.2 1.3", "v"),  # the whole group: the shared v patched
        ((1, 3), "S1+1", "2.0", "k"),  # z_r = softmax(q_r k_patched^T / sqrt(d) + mask) v
        ((0, 0), "S1+1", "2.0 1.1", "k"),
        ((0, 2), "END", "2.1 1.0", "q"),
    ],
)
def test_path_patching_at_one_position_into_each_query_head_equals_plain_torch(llama, sender, role, receivers, site):
    model, module, task, data = llama
    iv = Intervention("path_patch", "path", *sender, token=role, site=site, receivers=receivers)
    clean, (got,) = path_patch(model, task, data, [iv])
    heads = [] if receivers == "logits" else [tuple(map(int, r.split("."))) for r in receivers.split()]
    with torch.no_grad():
        expected = _by_hand(module, data, sender, role, heads, site)
    torch.testing.assert_close(got[:, 0], expected, atol=1e-7, rtol=0)
    # the path carries more than the tolerance: a wrong receiver or position would show
    assert (expected - clean[:, 0]).abs().max() > 1e-5


@pytest.mark.parametrize("chunk_mb", [32.0, 1e-3])  # every sender in one chunk; one sender a chunk
@pytest.mark.parametrize(("role", "receivers", "site"), [("S1+1", "2.0 1.1", "k"), ("END", "logits", None)])
def test_senders_of_every_layer_run_together_equal_each_by_hand(llama, role, receivers, site, chunk_mb):
    # one call stacks the senders of layers 0..2 (pass A's staircase, pass B grouped by the first receiver
    # layer each hears: 1 for layer 0, 2 for layer 1, none for layer 2 into these receivers)
    model, module, task, data = llama
    senders = [(l, h) for l in range(3) for h in range(model.n_heads)]
    ivs = [Intervention("path_patch", "path", l, h, token=role, site=site, receivers=receivers) for l, h in senders]
    clean, got = path_patch(model, task, data, ivs, chunk_mb=chunk_mb)
    heads = [] if receivers == "logits" else [tuple(map(int, r.split("."))) for r in receivers.split()]
    with torch.no_grad():
        for sender, quantities in zip(senders, got):
            hearing = [r for r in heads if r[0] > sender[0]]
            expected = _by_hand(module, data, sender, role, hearing, site) if hearing or not site else clean[:, 0]
            torch.testing.assert_close(quantities[:, 0], expected, atol=1e-7, rtol=0)


def test_a_path_sweep_patches_at_the_positions_it_is_given(llama):
    # patch.positions reaches path patching as it reaches activation patching: at S1+1, Wang et al.'s two
    # passes there; at `all`, every position (into the logits the two agree: only the MLPs run, position by
    # position, so a receiver head shows the difference)
    from omegaconf import OmegaConf

    from headlab.interventions import plan
    from headlab.interventions.engine import execute
    from headlab.interventions.options import PatchConfig

    model, module, task, data = llama
    patch = PatchConfig(kinds=["path"], receivers=["2.0"], receiver_site="k", positions=["S1+1", "all"])
    cfg = OmegaConf.create({"ablate": {"sweep": "none", "method": "zero"}, "patch": OmegaConf.structured(patch)})
    ivs = [iv for iv in plan(cfg, model.n_layers, model.n_heads)[1:] if (iv.layer, iv.head) == (1, 0)]
    assert [iv.token for iv in ivs] == ["S1+1", None]
    at_role, everywhere = execute(model, task, data, ivs, seed=0)[:, :, 0]
    with torch.no_grad():
        expected = _by_hand(module, data, (1, 0), "S1+1", [(2, 0)], "k")
    torch.testing.assert_close(at_role, expected, atol=1e-7, rtol=0)
    assert (everywhere - at_role).abs().max() > 1e-5


def test_the_group_of_a_key_value_head_receives_more_than_one_of_its_query_heads(llama):
    model, _, task, data = llama
    ivs = [Intervention("path_patch", "path", 0, 1, token="S2", site="v", receivers=r) for r in ("1.2", "1.2 1.3")]
    _, (alone, group) = path_patch(model, task, data, ivs)
    assert (alone[:, 0] - group[:, 0]).abs().max() > 1e-4


def test_a_held_head_stays_held_in_every_pass(llama):
    model, module, task, data = llama
    end = data.positions[:, 0]
    value = torch.linspace(-1, 1, data.n * 16, dtype=torch.float64).view(data.n, 16)
    iv = Intervention("path_patch", "path", 1, 3, token="END", receivers="logits")
    clean, (got,) = path_patch(model, task, data, [iv], held=[Held(2, 1, end, value)])
    with torch.no_grad():
        expected = _by_hand(module, data, (1, 3), "END", [], None, held=[(2, 1, value)])
        plain = _by_hand(module, data, (1, 3), "END", [], None)
    torch.testing.assert_close(got[:, 0], expected, atol=1e-7, rtol=0)
    assert (expected - plain).abs().max() > 1e-4


# ---- the study on a tiny GPT-2 ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gpt2(tiny_hf_dir, gpt2_tokenizer):
    model = load_hf(str(tiny_hf_dir("gpt2")), need_tokenizer=False)
    model.tokenizer = gpt2_tokenizer
    return model


@pytest.fixture(scope="module")
def table(tiny_gpt2):
    # a random model attends almost uniformly, about 0.06 of END's attention on each name: 0.02 lets it have classes
    return headlab.study(
        tiny_gpt2, headlab.load_task("ioi"), "ioi_classes", n_prompts=24, tau=0.01, min_attention=0.02, n_boot=50
    )


def _grid(rows: pd.DataFrame, shape: tuple[int, int], clean: float) -> np.ndarray:
    m = np.full(shape, np.nan)
    for r in rows.itertuples():
        m[int(r.layer), int(r.head)] = r.value - clean
    return m


def test_the_study_patches_into_the_class_it_found_at_each_rounds_position(tiny_gpt2, table):
    shape = (tiny_gpt2.n_layers, tiny_gpt2.n_heads)
    ld = table[table["metric"] == "logit_diff"]
    clean = float(ld[(ld["intervention"] == "none") & (ld["method"] == "none")]["value"].iloc[0])
    knocked = float(ld[(ld["intervention"] == "ablate_head") & (ld["group"] == KNOCKOUT)]["value"].iloc[0])
    path = ld[ld["intervention"] == "path_patch"]
    mine = path[path["group"].isna()]
    effects = {"logits": _grid(mine[mine["receivers"] == "logits"], shape, clean)}
    effects["backup"] = _grid(path[path["group"] == KNOCKOUT], shape, knocked)
    for site in ("q", "v", "k"):
        if (path["site"] == site).any():
            effects[site] = _grid(path[path["site"] == site], shape, clean)
    score = table[table["method"] == "score"]
    attention = {
        name: score[score["metric"] == name].pivot_table(index="layer", columns="head", values="value").to_numpy()
        for name in READS
    }
    expected = {cls: heads for cls, heads in classify(effects, attention, clean, 0.01, 0.02).items() if heads}
    assert expected.get("name mover"), "the random model should have a name mover at tau 0.01"
    assert {k: v for k, v in class_figure.procedure_classes(table).items() if v} == {
        k: v for k, v in expected.items() if not k.startswith("unclassed")
    }
    rows = table[table["method"] == CLASS_METHOD]
    for r in rows[(rows["group"] == "name mover") & (rows["metric"] == "path_effect")].itertuples():
        assert r.value == pytest.approx(effects["logits"][int(r.layer), int(r.head)], abs=1e-6)
    assert set(rows["metric"]) == {"path_effect", "class_share"} and rows["value"].notna().all()
    # round 2 entered exactly the name movers' queries at END, from every head below the last of them
    into_q = path[path["site"] == "q"]
    assert set(into_q["receivers"]) == {" ".join(expected["name mover"])} and set(into_q["token"]) == {"END"}
    last = max(int(h.split(".")[0]) for h in expected["name mover"])
    assert set(into_q["layer"]) == set(range(last))
    assert set(mine.loc[mine["receivers"] == "logits", "token"]) == {"END"}


def test_figures_draw_the_classes_and_the_circuit_diagram(table, tmp_path):
    numbers = FIGURES["ioi"](table, tmp_path)
    classes = numbers["head_classes"]
    assert classes["procedure"].startswith("path patching")
    assert classes["found"] == class_figure.procedure_classes(table)
    assert (tmp_path / "ioi_circuit.png").stat().st_size > 10_000
    assert "ioi_circuit.png" in numbers["figures"]
    # the backup round's panel reads its effects against the knockout's own run, not the clean one
    ld = table[table["metric"] == "logit_diff"]
    knocked = float(ld[(ld["intervention"] == "ablate_head") & (ld["group"] == KNOCKOUT)]["value"].iloc[0])
    top = numbers["path_patching"][f"logits, {KNOCKOUT}"][0]
    layer, head = map(int, top["head"].split("."))
    row = ld[(ld["group"] == KNOCKOUT) & (ld["layer"] == layer) & (ld["head"] == head)]
    assert top["value"] == pytest.approx(float(row["value"].iloc[0]) - knocked)
    assert set(classes["class_shares"]) == set(classes["found"])
    json.dumps(numbers)


def test_a_task_without_abc_prompts_or_a_bad_option_is_refused_in_one_line(tmp_path):
    for bad, word in (("study.tau=2", "tau"), ("study.receivers=kv", "receivers")):
        out = run_headlab("run", "study=ioi_classes", bad, f"output.root={tmp_path}", cwd=tmp_path)
        assert out.returncode == 2 and word in error_line(out) and len(error_line(out)) < 200
    assert not list(tmp_path.rglob("results.parquet"))
