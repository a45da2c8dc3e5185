"""Retrieval heads (analysis/retrieval.py, `scores=retrieval`) and the needle task (tasks/needle.py).

A copy model built by hand: layer 0 head 0 is a previous-token head, layer 1 head 0 an induction head
that attends to the needle token it copies, the other heads are off. Its retrieval scores are 1 for the
induction head and 0 elsewhere, they equal a count from full attention patterns written out here, and
masking the induction head drops needle recall to chance while masking any other heads leaves it whole.
"""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

import headlab
from conftest import error_line, run_headlab
from headlab.analysis.head_sets import random_heads, top_heads
from headlab.analysis.retrieval import masked_quantities, needle_layout, retrieval_hits, retrieval_scores
from headlab.models.toy import ToyConfig, ToyTransformer, hooked_toy, save_toy
from headlab.tasks.needle import ASK, BOS, KEY, SPECIAL, NeedleConfig, NeedleTask, copy_role, needle_role

NEEDLE_CFG = dict(n_prompts=24, n_reference=24, haystack_len=6, needle_len=3, n_symbols=12)
N_CTX = 16  # haystack 6 + twice the needle 3 + [BOS] [KEY] [ASK] [KEY]
SHARP = 40.0  # query scale: the matching key wins by SHARP / sqrt(d_head) = 10 logits


def needle_task(**kw) -> NeedleTask:
    return NeedleTask(NeedleConfig(**{**NEEDLE_CFG, **kw}))


def planted_copy_model():
    """Residual stream [position one-hot | token one-hot | previous token one-hot | copied token one-hot].

    Head 0.0: query = position p, key = position p' + 1: attends to the previous position and writes its
    token into the previous-token block. Head 1.0: query = the token, key = the previous-token block:
    attends to the position after an earlier occurrence of the current token (the needle token to copy)
    and writes its token into the copied block, which the unembedding reads. Heads 0.1 and 1.1 are off."""
    vocab = len(SPECIAL) + NEEDLE_CFG["n_symbols"]
    pos, tok, prev, out = 0, N_CTX, N_CTX + vocab, N_CTX + 2 * vocab
    cfg = ToyConfig(vocab_size=vocab, n_ctx=N_CTX, n_layers=2, n_heads=2, d_model=64, d_head=16, layer_norm=False)
    model = ToyTransformer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.pos.weight[:, pos:tok] = torch.eye(N_CTX)
        model.embed.weight[:, tok:prev] = torch.eye(vocab)
        a0, a1 = model.blocks[0].attn, model.blocks[1].attn
        for i in range(N_CTX):
            a0.q.weight[i, pos + i] = SHARP
            if i + 1 < N_CTX:
                a0.k.weight[i + 1, pos + i] = 1.0
        for t in range(vocab):
            a0.v.weight[t, tok + t] = 1.0
            a0.o.weight[prev + t, t] = 1.0
            a1.q.weight[t, tok + t] = SHARP
            a1.k.weight[t, prev + t] = 1.0
            a1.v.weight[t, tok + t] = 1.0
            a1.o.weight[out + t, t] = 1.0
            model.unembed.weight[t, out + t] = 10.0
    return hooked_toy(model.eval(), "planted-copy")


def test_needle_prompts_put_each_role_where_its_token_is():
    task = needle_task()
    data = task.build(24, seed=3)
    ids, needle = data.inputs["input_ids"], data.answers["needle"]
    assert ids.shape == (24, N_CTX) and (ids[:, 0] == BOS).all()
    rows = torch.arange(24)
    for j in range(3):
        assert torch.equal(ids[rows, data.token_positions[needle_role(j)]], needle[:, j])
        assert torch.equal(ids[rows, data.token_positions[copy_role(j)] + 1], needle[:, j])  # next token
    assert (ids[rows, data.token_positions[needle_role(0)] - 1] == KEY).all()
    assert (ids[:, -5] == ASK).all() and (ids[:, -4] == KEY).all()
    # the haystack avoids the needle's symbols; the counterfactual's needle shares none of them
    hay = torch.ones_like(ids, dtype=torch.bool)
    hay[:, 0] = False
    hay[:, -5:] = False
    for j in range(3):
        hay[rows, data.token_positions[needle_role(j)]] = False
        hay[rows, data.token_positions[needle_role(0)] - 1] = False
    assert not (ids[:, :, None] == needle[:, None, :])[hay].any()
    other = data.counterfactual["input_ids"]
    swapped = other[rows[:, None], torch.stack([data.token_positions[needle_role(j)] for j in range(3)], 1)]
    assert not (swapped[:, :, None] == needle[:, None, :]).any()
    same = torch.ones_like(ids, dtype=torch.bool)
    same[rows[:, None], torch.stack([data.token_positions[needle_role(j)] for j in range(3)], 1)] = False
    same[:, -3:] = False  # the answer repeats the other needle
    assert torch.equal(other[same], ids[same])


def test_retrieval_hits_by_hand():
    # one prompt, one head, a needle of 2 at positions 2 and 3 holding tokens 7 and 8; copy steps 5 and 6
    ids = torch.tensor([[1, 5, 7, 8, 5, 2, 7]])
    needle, positions = torch.tensor([[7, 8]]), torch.tensor([[2, 3]])
    pattern = torch.zeros(1, 3, 2, 7)
    pattern[0, 0, 0, 2], pattern[0, 0, 1, 3] = 0.9, 0.9  # head 0: the needle token being copied
    pattern[0, 1, 0, 6], pattern[0, 1, 1, 6] = 0.9, 0.9  # head 1: token 7, but outside the needle
    pattern[0, 2, 0, 3], pattern[0, 2, 1, 2] = 0.9, 0.9  # head 2: the needle, the other token
    right = torch.tensor([[7, 8]])
    assert retrieval_hits(pattern, right, needle, ids, positions)[0].tolist() == [
        [True, True],
        [False, False],
        [False, False],
    ]
    # a wrong prediction is no copy-paste event, even where the head attends to what it predicted
    wrong = torch.tensor([[8, 8]])
    hits = retrieval_hits(pattern, wrong, needle, ids, positions)[0]
    assert hits.tolist() == [[False, True], [False, False], [False, False]]


def test_the_planted_induction_head_is_the_retrieval_head_by_the_count_written_out():
    model, task = planted_copy_model(), needle_task()
    data = task.build(24, seed=1)
    found = retrieval_scores(model, data, batch_size=10)
    assert found.recall.eq(1.0).all()
    with torch.no_grad(), model.sites.record(sites=("pattern",)) as seen:
        logits = model.forward(data.inputs)
    needle_positions, steps = needle_layout(data)
    expected = torch.zeros(4, 24)
    for i in range(24):
        for layer in range(2):
            for head in range(2):
                for j in range(3):
                    q = int(steps[i, j])
                    top = int(seen[("pattern", layer)][i, head, q].argmax())
                    predicted = int(logits[i, q].argmax())
                    token = int(data.inputs["input_ids"][i, top])
                    if top in needle_positions[i].tolist() and token == predicted == int(data.answers["needle"][i, j]):
                        expected[2 * layer + head, i] += 1 / 3
    torch.testing.assert_close(found.scores, expected)
    assert found.mean(0.5).tolist() == pytest.approx([0, 0, 1, 0])
    assert top_heads(found.mean(0.5), 2, 1) == [(1, 0)]


def test_masking_the_retrieval_head_drops_recall_and_random_heads_do_not():
    model, task = planted_copy_model(), needle_task()
    data = task.build(24, seed=2)
    draws, apart = random_heads(2, 2, [(1, 0)], k=2, draws=3, seed=0)
    assert apart and all((1, 0) not in d and len(set(d)) == 2 for d in draws)
    got = masked_quantities(model, task, data, [[(1, 0)], *draws])  # [1 + 1 + 3, n, Q]
    recall = got[..., task.quantities.index("needle_recall")].mean(1)
    assert recall[0] == 1.0 and (recall[2:] == 1.0).all(), recall
    assert recall[1] < 0.5, recall  # uniform attention over the context: a guess among its tokens


def test_the_study_and_the_cli_on_the_saved_copy_model(tmp_path):
    model = planted_copy_model()
    save_toy(model.module, tmp_path / "copy")
    task = needle_task()
    table = headlab.scores(model, task, kind="retrieval", n_prompts=24, n_boot=20, top_k=1, n_random=3)
    scores = table[table["metric"] == "retrieval_score"].set_index(["layer", "head"])["value"]
    assert scores.loc[(1, 0)] == 1.0 and scores.drop((1, 0)).eq(0).all()
    drops = table[table["metric"] == "needle_recall_drop"].set_index("group")["value"]
    assert drops["top1"] > 0.5 and all(drops[f"random1_{d}"] == 0 for d in range(3)), drops
    # the planted copy head is an induction head too: the top retrieval head is the top induction head
    assert table.loc[table["metric"] == "top_k_induction_overlap", "value"].tolist() == [1.0]
    alone = headlab.scores(model, task, kind="retrieval", n_prompts=24, n_boot=20, top_k=0)  # no masking
    assert set(alone["metric"]) == {"retrieval_score"}
    scored = table[table["metric"] == "retrieval_score"][alone.columns]
    pd.testing.assert_frame_equal(alone, scored.reset_index(drop=True))

    overrides = [f"task.{k}={v}" for k, v in NEEDLE_CFG.items()]
    done = run_headlab(
        "run",
        "task=needle",
        "scores=retrieval",
        "model=toy-copy",
        f"model.path={tmp_path / 'copy'}",
        "scores.top_k=1",
        "scores.n_random=1",
        "output.n_boot=20",
        *overrides,
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    assert meta["masked_top_heads"] == ["L1H0"] and meta["recall_clean"] == 1.0
    assert meta["recall_top_k_masked"] < 0.5 and meta["recall_random_k_masked_mean"] == 1.0
    assert meta["top_k_also_induction"] == ["L1H0"] and meta["masking"] == "greedy"
    assert set(pd.read_parquet(tmp_path / "run" / "results.parquet")["metric"]) >= {"retrieval_score", "needle_recall"}

    bad = run_headlab("run", "task=counting", "scores=retrieval", f"output.root={tmp_path}", cwd=tmp_path)
    assert bad.returncode != 0 and "task=needle" in error_line(bad)


def test_needle_prompts_from_a_text_haystack_with_the_gpt2_tokenizer(tmp_path, gpt2_tokenizer):
    text = tmp_path / "hay.txt"
    text.write_text("The quick brown fox jumps over the lazy dog near the river bank. " * 40)
    task = needle_task(haystack=str(text), haystack_len=30, needle_len=4)

    class WithTokenizer:
        tokenizer = gpt2_tokenizer
        vocab_size = 50257
        module = None

    data = task.build(8, seed=0, model=WithTokenizer())
    ids, needle = data.inputs["input_ids"], data.answers["needle"]
    rows = torch.arange(8)
    for j in range(4):
        assert torch.equal(ids[rows, data.token_positions[needle_role(j)]], needle[:, j])
        assert torch.equal(ids[rows, data.token_positions[copy_role(j)] + 1], needle[:, j])
    prompt = gpt2_tokenizer.decode(ids[0])
    assert "The secret sequence is:" in prompt and "What is the secret sequence?" in prompt
    assert "fox" in prompt or "river" in prompt or "lazy" in prompt

    for path, words in ((tmp_path / "missing.txt", "no such file"), (tmp_path, "not a file")):
        with pytest.raises(headlab.UsageError, match=words):
            needle_task(haystack=str(path)).build(2, seed=0, model=WithTokenizer())
    (tmp_path / "short.txt").write_text("too short")
    with pytest.raises(headlab.UsageError, match="fewer than"):
        needle_task(haystack=str(tmp_path / "short.txt")).build(2, seed=0, model=WithTokenizer())
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(headlab.UsageError, match="UTF-8"):
        needle_task(haystack=str(tmp_path / "binary.txt")).build(2, seed=0, model=WithTokenizer())
