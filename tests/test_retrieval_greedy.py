"""Wu et al.'s retrieval score during greedy decoding (analysis/decoding.py, analysis/retrieval.py), the
natural needles of task.needles=sentences (tasks/needle_facts.py) and the random heads drawn outside the
top ones (analysis/head_sets.py).

Decoding is held to a plain transformers loop (a key-value cache, output_attentions, the argmax of each
head's last attention row: the loop of Wu et al.'s retrieval_head_detection.py), and the events to their
rule written out over a model rerun on the whole sequence at every step (no cache).
"""

from __future__ import annotations

import pytest
import torch

import headlab
from headlab.analysis.decoding import greedy_decode
from headlab.analysis.head_sets import avoided_heads, random_heads, top_heads
from headlab.analysis.retrieval import greedy_retrieval, needle_layout, retrieval_scores, token_recall
from headlab.locations import text_path
from headlab.tasks.needle import copy_role, needle_role
from headlab.tasks.needle_facts import FACTS, SENTENCE_ENDS
from test_retrieval import needle_task, planted_copy_model

ALICE = text_path("data/alice.txt")


@pytest.mark.parametrize("family", ["llama", "gpt2"])  # rotary and grouped keys; learned positions
def test_greedy_decoding_equals_a_plain_transformers_loop_with_a_cache(family, tiny_hf_dir):
    from transformers import AutoModelForCausalLM

    model = headlab.load_model(str(tiny_hf_dir(family)))
    ids = torch.randint(100, 5000, (2, 14), generator=torch.Generator().manual_seed(0))
    prompt_len, steps = 10, 4
    got = greedy_decode(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, prompt_len, steps, 2)
    plain = AutoModelForCausalLM.from_pretrained(tiny_hf_dir(family), attn_implementation="eager").eval()
    with torch.no_grad():
        for i in range(2):
            cache = plain(input_ids=ids[i : i + 1, : prompt_len - 1], use_cache=True).past_key_values
            token, tokens, tops = ids[i, prompt_len - 1], [], []
            for _ in range(steps):
                out = plain(input_ids=token.view(1, 1), past_key_values=cache, use_cache=True, output_attentions=True)
                cache, token = out.past_key_values, out.logits[0, -1].argmax()
                tokens.append(int(token))
                tops.append([int(a[0, h, -1].argmax()) for a in out.attentions for h in range(a.shape[1])])
            assert got.tokens[i].tolist() == tokens
            assert got.top_keys[i].tolist() == torch.tensor(tops).T.tolist()


def test_greedy_events_follow_wu_et_al_rule_written_out():
    model, task = planted_copy_model(), needle_task()
    data = task.build(6, seed=4)
    found = greedy_retrieval(model, data, batch_size=5)
    needle_positions, steps = needle_layout(data)
    prompt_len, length = int(steps[0, 0]) + 1, 3
    expected = torch.zeros(4, 6)
    for i in range(6):
        seq = data.inputs["input_ids"][i, :prompt_len].tolist()
        span = needle_positions[i].tolist()
        for _ in range(length):  # the whole sequence again at every step: no cache
            with torch.no_grad(), model.sites.record(sites=("pattern",)) as seen:
                logits = model.forward({"input_ids": torch.tensor([seq])})
            token = int(logits[0, -1].argmax())
            for layer in range(2):
                for head in range(2):
                    top = int(seen[("pattern", layer)][0, head, -1].argmax())
                    if span[0] <= top <= span[-1] and seq[top] == token:
                        expected[2 * layer + head, i] += 1 / length
            seq.append(token)
        assert seq[prompt_len:] == found.answers[i].tolist()
    torch.testing.assert_close(found.scores, expected)
    assert found.mean(0.5).tolist() == pytest.approx([0, 0, 1, 0]) and found.recall.eq(1).all()
    # the planted model copies right whichever way: the teacher-forced score agrees here
    torch.testing.assert_close(retrieval_scores(model, data, decoding="teacher_forced").scores, expected)


def test_token_recall_is_rouge1_recall_on_tokens():
    needle = torch.tensor([[5, 6, 5, 7], [1, 2, 3, 4]])
    answer = torch.tensor([[5, 5, 9, 6], [4, 3, 2, 1]])  # 5 twice of twice, 6, no 7; every token, any order
    assert token_recall(answer, needle).tolist() == [0.75, 1.0]
    assert token_recall(torch.tensor([[5, 9, 9, 9]]), needle[:1]).tolist() == [0.25]


def test_fact_needles_in_alice(gpt2_tokenizer):
    task = needle_task(haystack=str(ALICE), needles="sentences", haystack_len=120, needle_len=6, n_reference=5)

    class WithTokenizer:
        tokenizer = gpt2_tokenizer
        vocab_size = 50257
        module = None

    data = task.build(10, seed=0, model=WithTokenizer())
    ids, needle = data.inputs["input_ids"], data.answers["needle"]
    rows = torch.arange(10)
    for j in range(6):
        assert torch.equal(ids[rows, data.token_positions[needle_role(j)]], needle[:, j])
        assert torch.equal(ids[rows, data.token_positions[copy_role(j)] + 1], needle[:, j])
    answers = {tuple(gpt2_tokenizer(f.answer)["input_ids"][:6]) for f in FACTS}
    assert {tuple(r) for r in needle.tolist()} <= answers
    for i in range(10):
        text = gpt2_tokenizer.decode(ids[i])
        fact = next(f for f in FACTS if f.question in text)
        assert fact.statement + fact.answer + "." in text and text.endswith(
            fact.statement + gpt2_tokenizer.decode(needle[i])
        )
        # just after [BOS] (depth 0) or after a sentence end of the haystack
        before = int(data.token_positions[needle_role(0)][i]) - len(gpt2_tokenizer(fact.statement)["input_ids"])
        assert before == 1 or gpt2_tokenizer.decode(ids[i, before - 1]).rstrip().endswith(SENTENCE_ENDS)
    other = data.counterfactual["input_ids"]
    places = torch.cat(
        [torch.stack([data.token_positions[needle_role(j)] for j in range(6)], 1), data.positions + 1], 1
    )
    same = torch.ones_like(ids, dtype=torch.bool)
    same[rows[:, None], places] = False
    assert torch.equal(other[same], ids[same]) and (other[~same] != ids[~same]).all()
    assert data.reference["input_ids"].shape == (5, ids.shape[1])

    with pytest.raises(headlab.UsageError, match="shortest"):
        needle_task(haystack=str(ALICE), needles="sentences", needle_len=40).build(2, 0, model=WithTokenizer())
    with pytest.raises(headlab.UsageError, match="text haystack"):
        needle_task(needles="sentences").build(2, 0, model=WithTokenizer())
    with pytest.raises(headlab.UsageError, match="tokenizer"):
        needle_task(needles="sentences").build(2, 0)


def test_random_heads_stay_outside_the_top_random_outside():
    scores = torch.tensor([0.9, 0.1, 0.8, 0.0, 0.7, 0.2, 0.0, 0.0])  # 4 layers of 2 heads
    assert top_heads(scores, 2, 2) == [(0, 0), (1, 0)]
    assert avoided_heads(scores, 2, 2, 0) == [(0, 0), (1, 0)]  # as before: the top_k
    avoid = avoided_heads(scores, 2, 2, 4)
    assert avoid == [(0, 0), (1, 0), (2, 0), (2, 1)]
    draws, apart = random_heads(4, 2, avoid, 2, 20, seed=0)
    assert apart and all(not set(d) & set(avoid) and len(set(d)) == 2 for d in draws)
    assert {h for d in draws for h in d} == {(0, 1), (1, 1), (3, 0), (3, 1)}
