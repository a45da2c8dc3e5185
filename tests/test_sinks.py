"""Attention sinks (analysis/sinks.py, `scores=sinks`): the sink rate on a pattern written by hand, a
model with a planted sink found by it, and the study end to end."""

from __future__ import annotations

import pytest
import torch

import headlab
from headlab.analysis.sinks import sink_quantities, sink_scores
from headlab.models.toy import ToyConfig, ToyTransformer, hooked_toy
from headlab.tasks import TaskData


def test_sink_rate_counts_real_queries_after_the_first_by_hand():
    pattern = torch.tensor(
        [[[[1.0, 0, 0, 0], [0.6, 0.4, 0, 0], [0.2, 0.5, 0.3, 0], [0.9, 0.1, 0, 0]]]]
    )  # [batch 1, head 1, query, key]; query 3 is padding
    real = torch.tensor([[True, True, True, False]])
    rate, mean = sink_quantities(pattern, real, epsilon=0.3)[0, 0].tolist()
    assert rate == pytest.approx(1 / 2)  # query 1 puts 0.6 > 0.3 on the first token, query 2 puts 0.2
    assert mean == pytest.approx((0.6 + 0.2) / 2)
    assert sink_quantities(pattern, real, epsilon=0.1)[0, 0, 0].item() == pytest.approx(1.0)


def planted_sink_model():
    """One layer, two heads, no norm: head 0's query is a constant that matches only the first
    position's key (a large position-0 embedding along dimension 0); head 1 is left at random."""
    torch.manual_seed(0)
    cfg = ToyConfig(vocab_size=20, n_ctx=16, n_layers=1, n_heads=2, d_model=16, d_head=4, layer_norm=False)
    model = ToyTransformer(cfg)
    with torch.no_grad():
        model.embed.weight[:, 0] = 0.0
        model.pos.weight[:, 0] = 0.0
        model.pos.weight[0, 0] = 10.0
        attn = model.blocks[0].attn
        attn.k.weight[0:4] = 0.0
        attn.k.bias[0:4] = 0.0
        attn.k.weight[0, 0] = 1.0
        attn.q.weight[0:4] = 0.0
        attn.q.bias[0:4] = torch.tensor([5.0, 0, 0, 0])
    return hooked_toy(model, "planted")


def test_a_planted_sink_is_found_and_a_random_head_is_not():
    model = planted_sink_model()
    ids = torch.randint(0, 20, (32, 12), generator=torch.Generator().manual_seed(1))
    data = TaskData(inputs={"input_ids": ids}, positions=torch.zeros(32, 1, dtype=torch.long), answers={})
    scores = sink_scores(model, data, epsilon=0.3, batch_size=10)  # [heads, prompts, 2]
    rate = scores[..., 0].mean(1)
    first = scores[..., 1].mean(1)
    assert rate[0].item() == 1.0 and first[0].item() > 0.99, (rate, first)
    # near-uniform attention puts more than 0.3 on the first token only from queries 1 and 2 of 11
    assert rate[1].item() < 0.4, rate


def test_the_study_gives_each_head_its_rate_with_an_interval(trained_count01, tmp_path):
    model, task, _ = trained_count01
    table = headlab.scores(model, task, kind="sinks", n_prompts=64, n_boot=50, epsilon=0.5)
    rates = table[table["metric"] == "sink_rate"]
    assert len(rates) == model.n_layers * model.n_heads
    assert rates["value"].between(0, 1).all() and (rates["ci_low"] <= rates["value"]).all()
    data = task.build(64, seed=20_000, model=model)
    direct = sink_scores(model, data, epsilon=0.5)[..., 0].mean(1).double()
    assert torch.allclose(torch.tensor(rates["value"].to_numpy()), direct, atol=1e-6)
