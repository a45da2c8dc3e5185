"""Wu et al.'s retrieval score during greedy decoding (analysis/decoding.py, analysis/retrieval.py), the
natural needles of task.needles=sentences (tasks/needle_facts.py) and the random heads drawn outside the
top ones (analysis/head_sets.py).

Decoding is held to a plain transformers loop (a key-value cache, output_attentions, the argmax of each
head's last attention row, a stop after a newline token, masked heads' query projections zeroed at every
decoding step and not in the prefill: the loops of Wu et al.'s retrieval_head_detection.py and
needle_in_haystack_with_mask.py), the events to their rule and the ROUGE-1 recall on words to
rouge_score's definition, written out over a model rerun on the whole sequence at every step (no cache).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import headlab
from headlab.analysis.decoding import greedy_decode
from headlab.analysis.head_sets import avoided_heads, random_heads, top_heads
from headlab.analysis.retrieval import (
    greedy_masked_recall,
    greedy_retrieval,
    needle_layout,
    retrieval_scores,
    rouge1_recall,
    token_recall,
)
from headlab.locations import text_path
from headlab.tasks.needle import copy_role, needle_role
from headlab.tasks.needle_facts import FACTS, SENTENCE_ENDS, asked
from test_retrieval import needle_task, planted_copy_model

ALICE = text_path("data/alice.txt")


MASKED = [(1, 2), (2, 0)]  # (layer, head) of the tiny models' 3 layers of 4 heads


def plain_loop(plain, ids, prompt_len, steps, stop, masked):
    """Wu et al.'s loop: prefill all but the prompt's last token unmasked, then one token at a time through
    the cache, the masked heads' query projections zeroed, stopping after a token in `stop`."""
    config = plain.config
    d_head = config.hidden_size // config.num_attention_heads
    masking = []

    def zero(heads):
        def hook(_module, _args, out):
            out = out.clone()
            for h in heads:  # GPT-2's c_attn holds q, k, v side by side: q comes first
                out[..., h * d_head : (h + 1) * d_head] = 0
            return out

        return hook

    if config.model_type == "gpt2":
        projections = [block.attn.c_attn for block in plain.transformer.h]
    else:
        projections = [layer.self_attn.q_proj for layer in plain.model.layers]
    cache = plain(input_ids=ids[None, : prompt_len - 1], use_cache=True).past_key_values
    for layer in {layer for layer, _ in masked}:
        masking.append(projections[layer].register_forward_hook(zero([h for m, h in masked if m == layer])))
    token, tokens, tops = ids[prompt_len - 1], [], []
    for step in range(steps):
        out = plain(input_ids=token.view(1, 1), past_key_values=cache, use_cache=True, output_attentions=True)
        cache, token = out.past_key_values, out.logits[0, -1].argmax()
        tokens.append(int(token))
        # a sliding-window layer's cache keeps only its window's keys: its argmax counts from the window's start
        seen = prompt_len + step
        tops.append([int(a[0, h, -1].argmax()) + seen - a.shape[-1] for a in out.attentions for h in range(a.shape[1])])
        if int(token) in stop:
            break
    for handle in masking:
        handle.remove()
    return tokens, tops


@pytest.mark.parametrize(
    "family", ["llama", "gpt2", "gemma3_text"]
)  # rotary and grouped keys; learned positions; windows
def test_greedy_decoding_masked_and_stopped_equals_a_plain_transformers_loop_with_a_cache(family, tiny_hf_dir):
    from transformers import AutoModelForCausalLM

    model = headlab.load_model(str(tiny_hf_dir(family)))
    plain = AutoModelForCausalLM.from_pretrained(tiny_hf_dir(family), attn_implementation="eager").eval()
    ids = torch.randint(100, 5000, (2, 10), generator=torch.Generator().manual_seed(0))
    prompt_len, steps = 10, 5
    with torch.no_grad():
        free, free_tops = plain_loop(plain, ids[0], prompt_len, steps, set(), MASKED)
        stop = {free[2]}  # row 0 stops after its third token (where the rows differ, row 1 runs on)
        expected = [plain_loop(plain, ids[i], prompt_len, steps, stop, MASKED) for i in range(2)]
        unmasked = plain_loop(plain, ids[0], prompt_len, steps, set(), [])[1]
    masked_rows = [4 * layer + head for layer, head in MASKED]  # a zero query: uniform attention, key 0 first
    window = getattr(plain.config, "sliding_window", None) or 10**9
    layer_types = getattr(plain.config, "layer_types", None) or ["full_attention"] * 3
    for step, top in enumerate(free_tops):  # where a window hides key 0, the first key the window holds
        seen = prompt_len + step
        first = [max(0, seen - window) if layer_types[r // 4] == "sliding_attention" else 0 for r in masked_rows]
        assert [top[r] for r in masked_rows] == first
    assert any(top[r] != 0 for top in unmasked for r in masked_rows)
    stops = torch.zeros(model.vocab_size, dtype=torch.bool)
    stops[list(stop)] = True
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    got = greedy_decode(model, inputs, prompt_len, steps, 2, stop=stops, masked=MASKED)
    for i, (tokens, tops) in enumerate(expected):
        pad = steps - len(tokens)
        assert got.tokens[i].tolist() == tokens + [-1] * pad
        assert got.top_keys[i].tolist() == [row + [-1] * pad for row in torch.tensor(tops).T.tolist()]


def test_greedy_events_and_word_recall_follow_wu_et_al_rule_written_out():
    model, task = planted_copy_model(), needle_task()
    data = task.build(6, seed=4)
    found = greedy_retrieval(model, data, batch_size=5)
    needle_positions, steps = needle_layout(data)
    prompt_len = int(steps[0, 0]) + 1
    length = 16 - prompt_len + 1  # as many steps as the model's 16 positions hold (Wu et al.: 50)
    expected, recall = torch.zeros(4, 6), []
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
                        expected[2 * layer + head, i] += 1 / len(span)
            seq.append(token)
        assert seq[prompt_len:] == found.answers[i].tolist()
        # rouge_score's rouge1 recall; no tokenizer: token ids are the words
        want, got = Counter(data.answers["needle"][i].tolist()), Counter(seq[prompt_len:])
        recall.append(sum(min(c, got[w]) for w, c in want.items()) / sum(want.values()))
    torch.testing.assert_close(found.scores, expected)
    torch.testing.assert_close(found.recall, torch.tensor(recall), atol=1e-4, rtol=0)
    assert found.mean(0.5).tolist() == pytest.approx([0, 0, 1, 0]) and found.recall.eq(1).all()
    # the planted model copies right whichever way: the teacher-forced score agrees here
    torch.testing.assert_close(retrieval_scores(model, data, decoding="teacher_forced").scores, expected)
    # masked while decoding, the copy head reads the context uniformly: the needle is lost; masking an
    # idle head changes nothing
    masked = greedy_masked_recall(model, data, [[(1, 0)], [(0, 1)]], batch_size=5)
    assert masked[0].mean() < 0.5 and masked[1].eq(1).all(), masked


def test_rouge1_recall_on_stemmed_words():
    # rouge_score's rouge1 with use_stemmer=True: lower case, non-alphanumerics break words, words of more
    # than 3 letters Porter-stemmed (cats -> cat, running -> run, quickly -> quickli; "ran" stays)
    assert rouge1_recall("The cats are running quickly.", "A cat ran quickly!") == pytest.approx(2 / 5)
    assert rouge1_recall("eat a sandwich, eat", "EAT sandwiches") == pytest.approx(2 / 4)  # clipped: eat once
    assert rouge1_recall("Dolores Park", " dolores-park\n") == 1.0
    assert rouge1_recall("...", "anything") == 0.0  # no reference words


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
        fact = next(f for f in FACTS if f.question.strip() in text)
        assert fact.statement + fact.answer + "." in text and text.endswith(
            asked(fact.question) + gpt2_tokenizer.decode(needle[i])
        )
        whole = data.answers["answer"][i]
        start = int(data.answers["answer_start"][i])
        assert gpt2_tokenizer.decode(ids[i, start : start + int((whole >= 0).sum())]) == fact.answer
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

    cue = needle_task(haystack=str(ALICE), needles="sentences", haystack_len=120, needle_len=6, prompt="cue")
    text = gpt2_tokenizer.decode(cue.build(1, seed=0, model=WithTokenizer()).inputs["input_ids"][0])
    fact = next(f for f in FACTS if f.question in text)
    assert fact.statement + fact.answer + "." in text and "Answer:" not in text
    assert text.endswith(
        fact.question + fact.statement + gpt2_tokenizer.decode(gpt2_tokenizer(fact.answer)["input_ids"][:6])
    )
    with pytest.raises(headlab.UsageError, match="chat template"):
        needle_task(haystack=str(ALICE), needles="sentences", prompt="chat").build(2, 0, model=WithTokenizer())
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


def test_wu_depth_grid_places_prompt_i_at_its_share_of_the_haystack(gpt2_tokenizer):
    # Wu et al.'s retrieval_head_detection.py: np.round(np.linspace(0, 100, 10)) percent
    percents = [0, 11, 22, 33, 44, 56, 67, 78, 89, 100]
    symbols = needle_task(depths=10, haystack_len=50).build(20, seed=1)
    assert (symbols.answers["depth"] * 50).round().long().tolist() == [round(p / 2) for p in percents] * 2

    class WithTokenizer:
        tokenizer = gpt2_tokenizer
        vocab_size = 50257
        module = None

    task = needle_task(haystack=str(ALICE), needles="sentences", haystack_len=300, needle_len=6, depths=10)
    facts = task.build(10, seed=0, model=WithTokenizer())
    share = facts.answers["depth"]
    # moved back to a sentence end: at most the grid's share (Alice's sentences run up to ~90 tokens here)
    gap = torch.tensor(percents) / 100 - share
    assert (gap >= -1e-9).all() and gap.median() < 0.1 and share[0] == 0 and share[-1] > 0.75
