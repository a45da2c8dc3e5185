"""The induction study (scores=induction) against computations that share none of its code path: a plain
eager transformers Llama's attention weights, its logits' cross-entropy (on the repeated tokens and on
data/alice.txt's 512-token sequences), and its forward pass with the ablated heads' slices zeroed by a
pre-hook on o_proj."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig

import headlab
from headlab.analysis.head_sets import random_heads
from headlab.analysis.scores import repeated_tokens
from headlab.errors import HeadlabError, UsageError
from headlab.locations import text_path
from headlab.models.hf import load_hf

ALICE = text_path("data/alice.txt")
T = 7  # tokens per copy
N = 6  # sequences
SEED = 3


@pytest.fixture(scope="module")
def llama(tmp_path_factory, gpt2_tokenizer):
    """(headlab model, the same weights as a plain eager HF model, the study's table) on a tiny random
    Llama with grouped-query attention, its weights drawn wide enough (std 0.2, not 0.02) that zeroing
    two heads moves the loss by more than the tolerance the ablation is checked to."""
    torch.manual_seed(0)
    config = LlamaConfig(
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=64,
        intermediate_size=128,
        vocab_size=50257,
        max_position_embeddings=512,  # the ICL score's sequences
        initializer_range=0.2,
    )
    path = tmp_path_factory.mktemp("llama-wide")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    model = load_hf(str(path), need_tokenizer=False)
    model.tokenizer = gpt2_tokenizer
    reference = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    task = headlab.load_task("counting", n_prompts=4)
    table = headlab.scores(
        model, task, kind="induction", seed=SEED, repeat_len=T, n_sequences=N, top_k=2, n_random=2, n_boot=50
    )
    return model, reference, table


def _value(table, metric: str, **where) -> float:
    rows = table[table["metric"] == metric]
    for key, value in where.items():
        rows = rows[rows[key] == value]
    assert len(rows) == 1, (metric, where, len(rows))
    return float(rows["value"].iloc[0])


def _logits(
    reference, ids: torch.Tensor, zeroed: list[tuple[int, int]] = (), at: list[int] | None = None
) -> torch.Tensor:
    """Logits (float64) of the plain eager model, with the `zeroed` heads' slices of each o_proj input set
    to zero; at: only those positions' (the unembedding of 512 positions x 50257 tokens in float64 costs
    more than the model)."""
    d_head = reference.config.hidden_size // reference.config.num_attention_heads
    handles = []
    for layer in {layer for layer, _ in zeroed}:
        heads = [h for lay, h in zeroed if lay == layer]

        def zero(_module, args, heads=heads):
            x = args[0].clone()
            for h in heads:
                x[..., h * d_head : (h + 1) * d_head] = 0
            return (x,)

        handles.append(reference.model.layers[layer].self_attn.o_proj.register_forward_pre_hook(zero))
    try:
        with torch.inference_mode():
            if at is None:
                return reference(ids).logits.double()
            return reference.lm_head(reference.model(ids).last_hidden_state[:, at]).double()
    finally:
        for handle in handles:
            handle.remove()


def _losses(reference, ids: torch.Tensor, zeroed: list[tuple[int, int]] = ()) -> tuple[float, float]:
    """(first copy, second copy) mean cross-entropy of x_2..x_T by hand."""
    logits = _logits(reference, ids, zeroed)

    def loss(first_read: int) -> float:
        reads = torch.arange(first_read, first_read + T - 1)
        per_token = F.cross_entropy(logits[:, reads].flatten(0, 1), ids[:, reads + 1].flatten(), reduction="none")
        return float(per_token.view(N, T - 1).mean(1).mean())

    return loss(1), loss(1 + T)


def _icl_by_hand(reference, tokenizer, zeroed: list[tuple[int, int]] = ()) -> tuple[np.ndarray, np.ndarray]:
    """Per sequence, the loss of the 50th and of the 500th token of alice.txt's consecutive 512-token
    pieces (GPT-2's tokenizer adds no BOS), from the plain model's logits."""
    tokens = tokenizer(ALICE.read_text(encoding="utf-8"))["input_ids"]
    n = len(tokens) // 512
    ids = torch.tensor(tokens[: n * 512]).view(n, 512)
    logp = torch.log_softmax(_logits(reference, ids, zeroed, at=[50 - 2, 500 - 2]), -1)  # reads of the 50th, 500th
    return -logp[torch.arange(n), 0, ids[:, 49]].numpy(), -logp[torch.arange(n), 1, ids[:, 499]].numpy()


def test_induction_score_equals_eager_attention_by_hand(llama):
    model, reference, table = llama
    ids = repeated_tokens(model, N, T, seed=SEED)
    assert ids.shape == (N, 1 + 2 * T) and torch.equal(ids[:, 1 : 1 + T], ids[:, 1 + T :])
    with torch.inference_mode():
        attentions = reference(ids, output_attentions=True).attentions  # [n, head, q, k] per layer
    second = np.arange(1 + T, 1 + 2 * T)
    checked = 0
    for layer, att in enumerate(attentions):
        att = att.double().numpy()
        for head in range(att.shape[1]):
            induction = att[:, head, second, second - T + 1].mean()
            duplicate = att[:, head, second, second - T].mean()
            prev = att[:, head, np.arange(2, 1 + 2 * T), np.arange(1, 2 * T)].mean()
            assert _value(table, "induction_score", layer=layer, head=head) == pytest.approx(induction, abs=1e-6)
            assert _value(table, "duplicate_token_score", layer=layer, head=head) == pytest.approx(duplicate, abs=1e-6)
            assert _value(table, "prev_token_score", layer=layer, head=head) == pytest.approx(prev, abs=1e-6)
            # TransformerLens's detector: the second copy's attention to its targets over all 2T+1 rows
            tl = att[:, head, second, second - T + 1].sum(-1) / att[:, head].sum((-2, -1))
            assert _value(table, "induction_score_tl", layer=layer, head=head) == pytest.approx(tl.mean(), abs=1e-6)
            checked += 1
    assert checked == 12
    scores = table[table["metric"] == "induction_score"]
    assert (scores["n"] == N).all() and (scores["ci_low"] <= scores["value"]).all()
    assert (scores["value"] <= scores["ci_high"]).all()


def test_top_k_zero_gives_the_scores_alone(llama):
    model, _, table = llama
    task = headlab.load_task("counting", n_prompts=4)
    alone = headlab.scores(model, task, kind="induction", seed=SEED, repeat_len=T, n_sequences=N, top_k=0, n_boot=50)
    assert set(alone["method"]) == {"score"}
    pd.testing.assert_frame_equal(alone, table[table["method"] == "score"][alone.columns].reset_index(drop=True))


def test_repeat_loss_equals_plain_cross_entropy(llama):
    model, reference, table = llama
    first, second = _losses(reference, repeated_tokens(model, N, T, seed=SEED))
    assert first > 5  # a random model over a 50257-token vocabulary: about log(50257) = 10.8 or more
    clean = {"intervention": "none", "method": "none"}
    assert _value(table, "first_copy_loss", **clean) == pytest.approx(first, abs=1e-5)
    assert _value(table, "second_copy_loss", **clean) == pytest.approx(second, abs=1e-5)
    assert _value(table, "repeat_loss_drop", **clean) == pytest.approx(first - second, abs=1e-5)


def test_ablated_heads_equal_a_hooked_pass_zeroing_their_o_proj_slices(llama):
    model, reference, table = llama
    ids = repeated_tokens(model, N, T, seed=SEED)
    scores = table[table["metric"] == "induction_score"].sort_values(["layer", "head"])
    order = sorted(range(len(scores)), key=lambda i: (-scores["value"].iloc[i], i))
    top = [divmod(i, model.n_heads) for i in order[:2]]
    # the draws stay outside the top 100 (Wu et al.'s code), as many as leave 2 heads to draw from here
    avoid = [divmod(i, model.n_heads) for i in order[: max(2, min(100, len(order) - 2))]]
    draws, apart = random_heads(model.n_layers, model.n_heads, avoid, 2, 2, SEED)
    assert apart and all(not set(avoid) & set(d) for d in draws)
    _, clean_second = _losses(reference, ids)
    for group, heads in (("top2", top), ("random2_0", draws[0]), ("random2_1", draws[1])):
        first, second = _losses(reference, ids, heads)
        assert abs(second - clean_second) > 1e-3  # the ablation moves the loss well past the tolerance
        rows = {"intervention": "ablate_head", "method": "zero", "group": group}
        assert _value(table, "first_copy_loss", **rows) == pytest.approx(first, abs=1e-5)
        assert _value(table, "second_copy_loss", **rows) == pytest.approx(second, abs=1e-5)
        increase = _value(table, "second_copy_loss_increase", **rows)
        assert increase == pytest.approx(second - clean_second, abs=1e-5)


def test_icl_score_on_text_equals_plain_cross_entropy(llama, gpt2_tokenizer):
    model, reference, table = llama
    early, late = _icl_by_hand(reference, gpt2_tokenizer)
    assert len(early) >= 9  # alice.txt: about 5,000 GPT-2 tokens
    clean = {"intervention": "none", "method": "none"}
    assert _value(table, "loss_50th_token", **clean) == pytest.approx(early.mean(), abs=1e-5)
    assert _value(table, "loss_500th_token", **clean) == pytest.approx(late.mean(), abs=1e-5)
    assert _value(table, "icl_score", **clean) == pytest.approx((late - early).mean(), abs=1e-5)
    rows = table[(table["metric"] == "icl_score") & (table["intervention"] == "none")]
    assert (
        int(rows["n"].iloc[0]) == len(early)
        and rows["ci_low"].iloc[0] < rows["value"].iloc[0] < rows["ci_high"].iloc[0]
    )
    scores = table[table["metric"] == "induction_score"].sort_values(["layer", "head"])
    top = [
        divmod(i, model.n_heads) for i in sorted(range(len(scores)), key=lambda i: (-scores["value"].iloc[i], i))[:2]
    ]
    early_top, late_top = _icl_by_hand(reference, gpt2_tokenizer, top)
    assert abs((late_top - early_top).mean() - (late - early).mean()) > 1e-4  # the ablation moves it
    score = _value(table, "icl_score", intervention="ablate_head", method="zero", group="top2")
    assert score == pytest.approx((late_top - early_top).mean(), abs=1e-5)


def test_icl_score_needs_the_models_positions_and_enough_text(tmp_path, tiny_hf_dir, gpt2_tokenizer, llama):
    model = load_hf(str(tiny_hf_dir("gpt2")), need_tokenizer=False)  # 128 learned positions
    model.tokenizer = gpt2_tokenizer
    task = headlab.load_task("counting", n_prompts=4)
    options = dict(repeat_len=5, n_sequences=3, top_k=1, n_random=1, n_boot=0)
    table = headlab.scores(model, task, kind="induction", **options)
    assert "icl_score" not in set(table["metric"]) and "second_copy_loss" in set(table["metric"])
    short = tmp_path / "short.txt"
    short.write_text("Alice was beginning to get very tired.\n")
    with pytest.raises(HeadlabError, match=f"study.icl_text={tmp_path / 'nope.txt'}: no such file"):
        headlab.scores(model, task, kind="induction", icl_text=str(tmp_path / "nope.txt"), **options)
    with pytest.raises(HeadlabError, match="short.txt holds fewer than 512 tokens"):  # 512 positions: it reads
        headlab.scores(llama[0], task, kind="induction", icl_text=str(short), **options)


def test_the_door_refuses_a_repeat_without_a_token_to_predict():
    with pytest.raises(UsageError, match="study.repeat_len=1"):
        headlab.compose("scores=induction", "scores.repeat_len=1")
    with pytest.raises(UsageError, match="study.n_sequences=0"):
        headlab.compose("scores=induction", "scores.n_sequences=0")
    with pytest.raises(UsageError, match="study.icl_len=499"):
        headlab.compose("scores=induction", "scores.icl_len=499")
    # the ICL score is the induction study's option (its text the one headlab ships): no other study has one
    assert headlab.compose("scores=induction").study.icl_text == "alice.txt"
    assert not hasattr(headlab.compose("scores=sinks").study, "icl_text")
