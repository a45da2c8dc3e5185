"""Attention sinks (analysis/sinks.py, `scores=sinks`) and their calibration (`ablate=sink_calibration`):
sink rate and hidden sinks on patterns written by hand, a model with a planted sink and a planted hidden
sink found by them, the calibrated pattern against a hand computation, batched against naive, and both
studies end to end."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf

import headlab
from conftest import counting_cfg, error_line, run_headlab
from headlab.analysis.sinks import SINK_QUANTITIES, exact_length, most_often, sink_1, sink_quantities, sink_scores
from headlab.interventions import CLEAN, Intervention, plan
from headlab.interventions.edits import calibrated
from headlab.interventions.engine import execute
from headlab.interventions.options import PatchConfig
from headlab.interventions.sinks import hidden_sinks, real_tokens
from headlab.models.hf import load_hf
from headlab.models.toy import ToyConfig, ToyTransformer, hooked_toy
from headlab.tasks import TaskData
from headlab.tasks.counting import CountingTask

COLUMNS = {name: j for j, name in enumerate(SINK_QUANTITIES)}


def test_sink_rate_counts_real_queries_after_the_first_by_hand():
    pattern = torch.tensor(
        [[[[1.0, 0, 0, 0], [0.6, 0.4, 0, 0], [0.2, 0.5, 0.3, 0], [0.9, 0.1, 0, 0]]]]
    )  # [batch 1, head 1, query, key]; query 3 is padding
    real = torch.tensor([[True, True, True, False]])
    rate, mean = sink_quantities(pattern, real, epsilon=0.3)[0, 0, :2].tolist()
    assert rate == pytest.approx(1 / 2)  # query 1 puts 0.6 > 0.3 on the first token, query 2 puts 0.2
    assert mean == pytest.approx((0.6 + 0.2) / 2)
    assert sink_quantities(pattern, real, epsilon=0.1)[0, 0, 0].item() == pytest.approx(1.0)


def test_hidden_sinks_by_hand_count_real_tokens_and_queries_only():
    """Four real tokens (N = 4) and one padding position; alpha = 1.2 puts the threshold at 0.3."""
    pattern = torch.tensor(
        [
            [1.0, 0, 0, 0, 0],
            [0.2, 0.8, 0, 0, 0],
            [0.1, 0.6, 0.3, 0, 0],
            [0.1, 0.31, 0.24, 0.35, 0],
            [0, 0, 0, 0, 1.0],  # the padding query, all on itself: never counted
        ]
    )[None, None]
    real = torch.tensor([[True, True, True, True, False]])
    # mean attention received over the real queries at or after each key:
    #   key 1 (0.8 + 0.6 + 0.31) / 3 = 0.57 > 0.3    key 2 (0.3 + 0.24) / 2 = 0.27 (over 0.24 = 1.2 / 5:
    #   a sink if the padding counted in N)          key 3 0.35 / 1 > 0.3    key 4 padding
    assert hidden_sinks(pattern, real, alpha=1.2)[0, 0].tolist() == [False, True, False, True, False]
    rate, first, count, share, mass, gu, gu_sink = sink_quantities(pattern, real, epsilon=0.3, alpha=1.2)[0, 0].tolist()
    assert (rate, count) == (0.0, 2.0)
    assert first == pytest.approx((0.2 + 0.1 + 0.1) / 3)
    assert share == pytest.approx(2 / 3)  # of the three real tokens after the first
    assert mass == pytest.approx((0.8 + 0.6 + (0.31 + 0.35)) / 3)  # queries 1..3 on keys 1 and 3
    # Gu et al. average over every real query, the first (1.0 on itself) included: (1 + 0.2 + 0.1 + 0.1) / 4
    assert gu == pytest.approx(0.35) and gu_sink == 1.0
    # the first token is never a hidden sink, however much it draws
    assert not hidden_sinks(pattern, real, alpha=0.1)[0, 0, 0]
    # ACT's released code: a fixed threshold whatever N. At 0.28 key 2 (0.27) stays out and keys 1, 3 are in;
    # at 0.26 key 2 joins, where alpha / N = 0.3 leaves it out; alpha is ignored then
    assert hidden_sinks(pattern, real, alpha=1.2, fixed=0.28)[0, 0].tolist() == [False, True, False, True, False]
    assert hidden_sinks(pattern, real, alpha=99.0, fixed=0.26)[0, 0].tolist() == [False, True, True, True, False]
    count_fixed = sink_quantities(pattern, real, epsilon=0.3, alpha=1.2, fixed=0.26)[0, 0, 2].item()
    assert count_fixed == 3.0


def test_gu_sink_metric_equals_plain_transformers_attentions(tiny_hf_dir):
    """Gu et al.'s alpha_1 (mean attention on the first token over all T queries), their sink heads and
    Sink_1^epsilon, from the attentions transformers itself returns (eager attention) on a random Llama;
    the sink rate (queries after the first above epsilon) from the same attentions, as before. Its heads
    attend nearly uniformly (alpha_1 about H_T / T): at about their median, about half of them are sink heads."""
    from transformers import AutoModelForCausalLM

    path = str(tiny_hf_dir("llama"))
    model = load_hf(path, need_tokenizer=False)
    ids = torch.randint(0, 50257, (6, 16), generator=torch.Generator().manual_seed(4))
    data = TaskData(inputs={"input_ids": ids}, positions=torch.zeros(6, 1, dtype=torch.long), answers={})
    plain = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    with torch.no_grad():
        attentions = torch.stack(plain(ids, output_attentions=True).attentions, 1).double()  # [b, L, H, q, k]
    on_first = attentions[..., 0]  # [b, L, H, query]
    alpha_1 = on_first.mean(-1).flatten(1).T  # [L * H, b]: over all 16 queries, the first included
    for epsilon in (0.3, float(alpha_1.median()) + 1e-4):  # clear of every alpha_1 by more than 1e-6
        assert (alpha_1 - epsilon).abs().min() > 1e-6
        scores = sink_scores(model, data, epsilon=epsilon, batch_size=4)
        expected_sink_1 = 100 * (alpha_1 > epsilon).double().mean(0)  # per sequence: % of the L x H heads
        got = scores.quantities.double()
        torch.testing.assert_close(got[..., COLUMNS["gu_first_token_attention"]], alpha_1, atol=1e-6, rtol=0)
        torch.testing.assert_close(got[..., COLUMNS["gu_sink"]], (alpha_1 > epsilon).double(), atol=0, rtol=0)
        torch.testing.assert_close(sink_1(scores).double(), expected_sink_1, atol=1e-6, rtol=0)
        rate = (on_first[..., 1:] > epsilon).double().mean(-1).flatten(1).T  # queries after the first only
        torch.testing.assert_close(got[..., COLUMNS["sink_rate"]], rate, atol=1e-6, rtol=0)
    assert 20 < expected_sink_1.mean() < 80, expected_sink_1  # a mix of sink heads and others: a real check
    assert 0 < rate.mean() < 1


def test_exact_length_cuts_long_prompts_and_leaves_out_short_ones():
    ids = torch.arange(24).view(3, 8)
    mask = torch.tensor([[1] * 8, [1] * 5 + [0] * 3, [1] * 6 + [0] * 2])
    data = TaskData(inputs={"input_ids": ids, "attention_mask": mask}, positions=ids[:, :1], answers={})
    cut = exact_length(data, 6)
    assert cut.n == 2
    assert cut.inputs["input_ids"].tolist() == [list(range(6)), list(range(16, 22))]
    assert cut.inputs["attention_mask"].eq(1).all()


def test_left_padded_prompts_are_refused_in_one_line():
    ids = torch.zeros(2, 4, dtype=torch.long)
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
    data = TaskData(inputs={"input_ids": ids, "attention_mask": mask}, positions=ids[:, :1], answers={})
    with pytest.raises(headlab.HeadlabError, match="right-padded"):
        real_tokens(data)


SINK_TOKEN = 19  # the planted hidden sink of head 1


def planted_sink_model():
    """One layer, two heads, no norm. Head 0's query is a constant that matches only the first position's
    key (a large position-0 embedding along dimension 0); head 1's matches only token SINK_TOKEN's key (a
    large embedding of that token along dimension 1), wherever it stands."""
    torch.manual_seed(0)
    cfg = ToyConfig(vocab_size=20, n_ctx=16, n_layers=1, n_heads=2, d_model=16, d_head=4, layer_norm=False)
    model = ToyTransformer(cfg)
    with torch.no_grad():
        model.embed.weight[:, :2] = 0.0
        model.pos.weight[:, :2] = 0.0
        model.pos.weight[0, 0] = 10.0
        model.embed.weight[SINK_TOKEN, 1] = 10.0
        attn = model.blocks[0].attn
        for head, dim in ((0, 0), (1, 1)):
            rows = slice(4 * head, 4 * head + 4)
            attn.k.weight[rows] = 0.0
            attn.k.bias[rows] = 0.0
            attn.k.weight[4 * head, dim] = 1.0
            attn.q.weight[rows] = 0.0
            attn.q.bias[rows] = torch.tensor([5.0, 0, 0, 0])
    return hooked_toy(model, "planted")


def test_a_planted_sink_and_a_planted_hidden_sink_are_found_in_their_heads():
    model = planted_sink_model()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SINK_TOKEN, (32, 12), generator=gen)
    where = torch.randint(1, 12, (32,), generator=gen)  # one SINK_TOKEN per prompt, after the first token
    ids[torch.arange(32), where] = SINK_TOKEN
    data = TaskData(inputs={"input_ids": ids}, positions=torch.zeros(32, 1, dtype=torch.long), answers={})
    scores = sink_scores(model, data, epsilon=0.3, batch_size=10)
    q = scores.quantities  # [heads, prompts, quantities]
    rate, first = q[..., COLUMNS["sink_rate"]].mean(1), q[..., COLUMNS["first_token_attention"]].mean(1)
    assert rate[0].item() == 1.0 and first[0].item() > 0.99, (rate, first)
    # head 1 puts more than 0.3 on the first token only from queries 1 and 2 (uniform before the sink)
    assert rate[1].item() < 0.4, rate
    count = q[..., COLUMNS["hidden_sink_count"]]
    assert count[0].eq(0).all() and count[1].eq(1).all(), count
    # every query at or after the sink token puts (nearly) all of head 1's attention there
    expected_mass = (12 - where).double() / 11
    torch.testing.assert_close(q[1, :, COLUMNS["hidden_sink_mass"]].double(), expected_mass, atol=1e-6, rtol=0)
    assert scores.hidden[torch.arange(32), where].eq(1).all() and scores.hidden.sum() == 32
    positions, tokens = most_often(scores, ids, n_heads=2)
    assert tokens[0][0] == SINK_TOKEN and tokens[0][1] == pytest.approx(0.5)  # head 1 of the two heads
    assert tokens[0][2] == 32 and len(tokens) == 1
    assert {p for p, _, _ in positions} <= set(where.tolist())


def test_calibrated_rows_by_hand():
    rows = torch.tensor([[1.0, 0, 0, 0], [0.5, 0.5, 0, 0], [0.5, 0.3, 0.2, 0], [0.0, 0.25, 0.75, 0]])
    got = calibrated(rows, 0.4)
    # 0.5 on the sink -> 0.2; the freed 0.3 goes to 0.3 and 0.2 in proportion: + 0.18 and + 0.12
    expected = torch.tensor([[1.0, 0, 0, 0], [0.2, 0.8, 0, 0], [0.2, 0.48, 0.32, 0], [0.0, 0.25, 0.75, 0]])
    torch.testing.assert_close(got, expected)
    assert torch.equal(calibrated(rows, 1.0), rows)
    torch.testing.assert_close(calibrated(rows, 0.0)[1:, 0], torch.zeros(3))


def _toy(n_layers=2, d_mlp=32, seed=0):
    torch.manual_seed(seed)
    cfg = ToyConfig(vocab_size=7, n_ctx=32, n_layers=n_layers, n_heads=3, d_model=24, d_head=8, d_mlp=d_mlp)
    model = ToyTransformer(cfg)
    for p in model.parameters():  # larger weights than the init, so that every head moves the logits
        p.data.normal_(0, 0.3)
    return hooked_toy(model.eval(), "toy")


def _calibration_plan(model, factor, sinks="first", alpha=5.0, threshold=0.0):
    ablate = {"sweep": "sink_calibration", "method": "zero", "calibration": factor, "sinks": sinks}
    ablate |= {"sink_alpha": alpha, "sink_threshold": threshold}
    return plan(OmegaConf.create({"ablate": ablate, "patch": PatchConfig()}), model.n_layers, model.n_heads)


@pytest.mark.parametrize("sinks,threshold", [("first", 0.0), ("hidden", 0.0), ("hidden", 0.05)])
def test_the_calibration_sweep_batched_equals_naive_and_factor_one_equals_clean(sinks, threshold):
    model = _toy()
    task = CountingTask(counting_cfg())
    data = task.build(40, seed=1)
    # a low alpha (or a fixed threshold, as ACT's code has, lower than its 0.1): every head has hidden sinks here
    ivs = _calibration_plan(model, 0.4, sinks, alpha=1.5, threshold=threshold)
    assert len(ivs) == 1 + 6 and {iv.group for iv in ivs[1:]} == {"calibration 0.4"}
    # two copies a chunk: a copy's widest activation is its scores and pattern (3 heads, float32)
    fast = execute(model, task, data, ivs, chunk_mb=2 * 40 * 3 * 27 * 27 * 8 / 2**20)
    slow = execute(model, task, data, ivs, naive=True)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=0)
    margin = task.quantities.index("label_margin")
    assert ((fast[1:, :, margin] - fast[0, :, margin]).abs().amax(1) > 1e-3).all()
    unchanged = execute(model, task, data, _calibration_plan(model, 1.0, sinks, alpha=1.5))
    torch.testing.assert_close(unchanged[1:], unchanged[:1].expand_as(unchanged[1:]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma3_text"])
def test_the_calibration_sweep_batched_equals_naive_on_hf(family, tiny_hf_dir):
    from test_engine import _LastTokenTask

    model = load_hf(str(tiny_hf_dir(family)), need_tokenizer=False)
    ids = torch.randint(0, 50257, (8, 10), generator=torch.Generator().manual_seed(0))
    data = TaskData(inputs={"input_ids": ids}, positions=torch.full((8, 1), 9), answers={})
    ivs = _calibration_plan(model, 0.2)
    fast = execute(model, _LastTokenTask(), data, ivs, chunk_mb=8 * 10 * 128 * 4 * 3 / 2**20)
    slow = execute(model, _LastTokenTask(), data, ivs, naive=True)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=0)
    assert (fast[1:] - fast[0]).abs().amax() > 1e-4


def test_calibrated_rows_with_hidden_sinks_by_hand():
    rows = torch.tensor([[1.0, 0, 0, 0], [0.2, 0.8, 0, 0], [0.1, 0.6, 0.3, 0], [0.1, 0.5, 0.2, 0.2]])
    sinks = torch.tensor([False, True, False, False])
    got = calibrated(rows, 0.5, sinks)
    # key 1 halved, what it frees shared by the other keys in proportion: row 1 frees 0.4 onto 0.2 (x 3),
    # row 2 0.3 onto 0.4 (x 1.75), row 3 0.25 onto 0.5 (x 1.5); row 0 has nothing on the sink
    expected = torch.tensor([[1.0, 0, 0, 0], [0.6, 0.4, 0, 0], [0.175, 0.3, 0.525, 0], [0.15, 0.25, 0.3, 0.3]])
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got.sum(-1), torch.ones(4))


def test_calibrating_the_hidden_sinks_of_the_planted_head_equals_hand_computation():
    """Head 1 of the planted model attends to the SINK_TOKEN wherever it stands: a hidden sink by the rule
    written out here, calibrated in head 1 only; the model computed from its weights without HeadSites.
    (With the planted sink at full strength the other keys hold ~1e-9 of the attention, and sharing the
    freed attention in proportion to them amplifies their rounding.)"""
    from test_engine import _LastTokenTask

    model, beta, alpha = planted_sink_model(), 0.4, 5.0
    net = model.module
    with torch.no_grad():  # a milder sink (about half the attention): the rule is then well conditioned
        net.blocks[0].attn.q.bias[4] = 0.5
        net.blocks[0].attn.v.weight[4:8] *= 100  # and a head whose output moves the logits
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, SINK_TOKEN, (16, 12), generator=gen)
    where = torch.randint(1, 9, (16,), generator=gen)
    ids[torch.arange(16), where] = SINK_TOKEN
    data = TaskData(inputs={"input_ids": ids}, positions=torch.full((16, 1), 11), answers={})
    with torch.no_grad():
        x = net.embed.weight[ids] + net.pos.weight[:12]
        a = net.blocks[0].attn
        q, k, v = ((x @ lin.weight.T + lin.bias).unflatten(-1, (2, 4)) for lin in (a.q, a.k, a.v))
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / 2.0
        pattern = scores.masked_fill(torch.ones(12, 12).triu(1).bool(), float("-inf")).softmax(-1)
        for i in range(16):
            p = pattern[i, 1]
            sinks = [j for j in range(1, 12) if p[j:, j].mean() > alpha / 12]
            assert int(where[i]) in sinks
            for row in range(1, 12):
                held = p[row, sinks].sum()
                rest = 1 - held
                if rest > 0:
                    others = [j for j in range(12) if j not in sinks]
                    p[row, others] *= 1 + (1 - beta) * held / rest
                    p[row, sinks] *= beta
        z = torch.einsum("bhqk,bkhd->bqhd", pattern, v)
        resid = x + z.flatten(2) @ a.o.weight.T + a.o.bias
        expected = _LastTokenTask().per_prompt(net.unembed(resid)[:, 11:], data)
    ivs = [CLEAN, Intervention("calibrate_sink", "calibration_hidden", 0, 1, scale=(beta, alpha))]
    got = execute(model, _LastTokenTask(), data, ivs)
    torch.testing.assert_close(got[1], expected, atol=1e-4, rtol=0)
    assert (got[1] - got[0]).abs().max() > 2e-2


def test_calibrating_one_head_equals_hand_computation():
    """One-layer attention-only toy model, computed from its weights without HeadSites, with head 1's
    pattern calibrated row by row by the rule written out here."""
    model = _toy(n_layers=1, d_mlp=0)
    net = model.module
    task = CountingTask(counting_cfg())
    data = task.build(16, seed=2)
    ids = data.inputs["input_ids"]
    head, beta, H, dh = 1, 0.4, 3, 8
    with torch.no_grad():
        x = net.embed.weight[ids] + net.pos.weight[: ids.shape[1]]
        a = net.blocks[0].attn
        y = net.blocks[0].ln1(x)
        q, k, v = ((y @ lin.weight.T + lin.bias).unflatten(-1, (H, dh)) for lin in (a.q, a.k, a.v))
        t = ids.shape[1]
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / dh**0.5
        pattern = scores.masked_fill(torch.ones(t, t).triu(1).bool(), float("-inf")).softmax(-1)
        sink = pattern[:, head, 1:, :1].clone()  # every query but the first, which sees only itself
        pattern[:, head, 1:, :1] = beta * sink
        pattern[:, head, 1:, 1:] += (1 - beta) * sink * pattern[:, head, 1:, 1:] / (1 - sink)
        z = torch.einsum("bhqk,bkhd->bqhd", pattern, v)
        resid = x + z.flatten(2) @ a.o.weight.T + a.o.bias
        logits = net.unembed(net.ln_f(resid))[torch.arange(16).unsqueeze(1), data.positions]
        expected = task.per_prompt(logits, data)
    ivs = [CLEAN, Intervention("calibrate_sink", "calibration", 0, head, scale=(beta,))]
    got = execute(model, task, data, ivs)
    torch.testing.assert_close(got[1], expected, atol=1e-4, rtol=0)
    assert (got[1] - got[0]).abs().max() > 1e-3


def test_the_sinks_study_gives_each_head_its_scores_with_intervals(trained_count01):
    model, task, _ = trained_count01
    table = headlab.scores(model, task, kind="sinks", n_prompts=64, n_boot=50, epsilon=0.5, alpha=3.0)
    data = task.build(64, seed=20_000, model=model)
    direct = sink_scores(model, data, epsilon=0.5, alpha=3.0).quantities.mean(1).double()
    for name, j in COLUMNS.items():
        rows = table[table["metric"] == name]
        assert len(rows) == model.n_layers * model.n_heads, name
        assert (rows["ci_low"] <= rows["value"] + 1e-12).all() and (rows["value"] <= rows["ci_high"] + 1e-12).all()
        torch.testing.assert_close(torch.tensor(rows["value"].to_numpy()), direct[:, j], atol=1e-6, rtol=0)
    assert table.loc[table["metric"] == "sink_rate", "value"].between(0, 1).all()
    overall = table[table["metric"] == "sink_1"]
    assert len(overall) == 1 and overall["layer"].isna().all() and overall["epsilon"].iloc[0] == 0.5
    direct_sink_1 = 100 * direct[:, COLUMNS["gu_sink"]].mean().item()  # the same prompts, all of them
    assert overall["value"].iloc[0] == pytest.approx(direct_sink_1, abs=1e-9)
    assert overall["ci_low"].iloc[0] <= direct_sink_1 <= overall["ci_high"].iloc[0]


def test_the_sinks_study_takes_sequences_of_seq_len_tokens_exactly(trained_count01):
    model, task, _ = trained_count01
    table = headlab.scores(model, task, kind="sinks", n_prompts=64, n_boot=0, seq_len=12)
    full = task.build(64, seed=20_000, model=model)
    data = exact_length(full, 12)
    assert full.inputs["input_ids"].shape[1] > 12 and data.inputs["input_ids"].shape == (64, 12)
    direct = sink_scores(model, data).quantities.mean(1).double()
    rows = table[table["metric"] == "gu_first_token_attention"]
    torch.testing.assert_close(torch.tensor(rows["value"].to_numpy()), direct[:, COLUMNS["gu_first_token_attention"]])
    with pytest.raises(headlab.HeadlabError, match="study.seq_len=999"):
        headlab.scores(model, task, kind="sinks", n_prompts=8, n_boot=0, seq_len=999)


def test_cli_runs_the_sinks_study_and_the_calibration_sweep(demo_root, tmp_path):
    common = (f"output.root={demo_root}", "task.n_prompts=48", "output.n_boot=20")
    done = run_headlab("run", "scores=sinks", *common, f"hydra.run.dir={tmp_path / 's'}", cwd=demo_root)
    assert done.returncode == 0, done.stderr
    table = pd.read_parquet(tmp_path / "s" / "results.parquet")
    assert set(COLUMNS) <= set(table["metric"]) and set(table["method"]) == {"score"}
    meta = json.loads((tmp_path / "s" / "meta.json").read_text())
    assert len(meta["top_sink_heads"]) == 4 and meta["alpha"] == 5.0
    assert all(
        isinstance(meta[key], list) for key in ("top_hidden_sink_heads", "hidden_sink_positions", "hidden_sink_tokens")
    )
    assert (tmp_path / "s" / "figures" / "score_hidden_sink_mass.png").is_file()

    done = run_headlab("run", "ablate=sink_calibration", *common, f"hydra.run.dir={tmp_path / 'c'}", cwd=demo_root)
    assert done.returncode == 0, done.stderr
    sweep = pd.read_parquet(tmp_path / "c" / "results.parquet")
    calibrated_rows = sweep[(sweep["intervention"] == "calibrate_sink") & (sweep["metric"] == sweep["metric"].iloc[0])]
    assert len(calibrated_rows) == 4 and set(calibrated_rows["group"]) == {"calibration 0.4"}
    bad = run_headlab("run", "ablate=sink_calibration", "ablate.calibration=1.5", *common, cwd=tmp_path)
    assert bad.returncode != 0 and "ablate.calibration" in error_line(bad)
