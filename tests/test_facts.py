import random
import re
from collections import Counter

import pytest

from headlab.tasks.facts import (
    FACTS,
    NAMES,
    REASONING_KINDS,
    RECALL_TEMPLATES,
    Fact,
    check_single_tokens,
    facts_of,
    reasoning_prompt,
    recall_prompt,
    single_token_subjects,
)

# Parsed here from the prompt text, independently of how facts.py builds it.
WINS = re.compile(r"(\w+) (?:scored more points than|finished ahead of|received more votes than) (\w+)\.")
ASKS_TOP = re.compile(r"the (?:most points|most votes|one that finished first)")
ASKS_BOTTOM = re.compile(r"the (?:fewest points|fewest votes|one that finished last)")
FRIEND = re.compile(r"(\w+)'s friend is (\w+)\.")
LIVES = re.compile(r"(\w+) lives in (\w+)\.")
QUERY = re.compile(r"(\w+)'s friend lives in$")


def one_token(tok, word):
    return len(tok(word, add_special_tokens=False)["input_ids"]) == 1


def test_the_tokenizer_is_gpt2_and_the_helper_finds_multi_token_words(gpt2_tokenizer):
    assert gpt2_tokenizer(" Mary")["input_ids"] == [5335]
    assert gpt2_tokenizer(" John")["input_ids"] == [1757]
    words = [" Mary", " Kyiv", " Paris", " New Delhi"]
    assert check_single_tokens(gpt2_tokenizer, words) == [" Kyiv", " New Delhi"]


def test_every_answer_is_one_gpt2_token_with_a_leading_space(gpt2_tokenizer):
    answers = sorted({" " + f.answer for f in FACTS})
    assert check_single_tokens(gpt2_tokenizer, answers) == []
    for f in FACTS:
        assert not f.answer.startswith(" ") and f.answer == f.answer.strip()
        assert one_token(gpt2_tokenizer, recall_prompt(f)[1])


def test_table_size_relations_and_no_duplicates():
    per_relation = Counter(f.relation for f in FACTS)
    assert len(FACTS) >= 200
    assert len(per_relation) >= 6
    assert set(per_relation) == set(RECALL_TEMPLATES)
    assert all(n >= 20 for n in per_relation.values()), per_relation
    keys = Counter((f.relation, f.subject) for f in FACTS)
    assert [k for k, n in keys.items() if n > 1] == []
    assert all(isinstance(f, Fact) and f.subject and f.answer for f in FACTS)
    assert sum(len(facts_of(r)) for r in RECALL_TEMPLATES) == len(FACTS)
    with pytest.raises(ValueError):
        facts_of("no_such_relation")


def test_recall_prompts_end_without_a_space_and_contain_the_subject():
    for f in FACTS:
        prompt, answer = recall_prompt(f)
        assert prompt == prompt.rstrip() and not prompt.endswith(" ")
        assert prompt[0].isupper()
        assert f.subject in prompt or f.subject[0].upper() + f.subject[1:] in prompt
        assert answer == " " + f.answer
        # the answer is recalled, not copied from the prompt
        assert f.answer not in prompt.split()


def test_subjects_and_names_for_reasoning_are_single_tokens(gpt2_tokenizer):
    subjects = single_token_subjects(gpt2_tokenizer)
    assert len(subjects) >= 40
    assert len(set(subjects)) == len(subjects)
    assert check_single_tokens(gpt2_tokenizer, [" " + s for s in subjects]) == []
    assert "the United Kingdom" not in subjects and "France" in subjects
    assert len(NAMES) >= 40 and len(set(NAMES)) == len(NAMES)
    assert check_single_tokens(gpt2_tokenizer, [" " + n for n in NAMES]) == []
    assert not set(NAMES) & {f.subject for f in FACTS}


def _transitive_answer(prompt):
    pairs = WINS.findall(prompt)
    assert len(pairs) == 2
    winners, losers = {w for w, _ in pairs}, {l for _, l in pairs}
    entities = winners | losers
    assert len(entities) == 3
    (top,) = winners - losers
    (bottom,) = losers - winners
    asks_top, asks_bottom = bool(ASKS_TOP.search(prompt)), bool(ASKS_BOTTOM.search(prompt))
    assert asks_top != asks_bottom
    return (top if asks_top else bottom), entities


def _two_hop_answer(prompt):
    friend = dict(FRIEND.findall(prompt))
    home = dict(LIVES.findall(prompt))
    assert len(friend) == 2 and len(home) == 2
    (asker,) = QUERY.findall(prompt)
    assert asker in friend
    return home[friend[asker]], set(home.values())


SOLVERS = {"transitive": _transitive_answer, "two_hop": _two_hop_answer}


@pytest.mark.parametrize("kind", REASONING_KINDS)
def test_reasoning_answer_is_stated_in_context_and_logically_correct(gpt2_tokenizer, kind):
    subjects = single_token_subjects(gpt2_tokenizer)
    rng = random.Random(0)
    for _ in range(300):
        prompt, answer, others = reasoning_prompt(subjects, rng, kind)
        assert prompt == prompt.rstrip()
        assert answer.startswith(" ") and one_token(gpt2_tokenizer, answer)
        assert all(o.startswith(" ") and one_token(gpt2_tokenizer, o) for o in others)
        expected, candidates = SOLVERS[kind](prompt)
        assert answer == " " + expected
        assert answer not in others
        assert {answer, *others} == {" " + c for c in candidates}
        assert all(c in subjects for c in candidates)


@pytest.mark.parametrize("kind,chosen", [("transitive", ["France", "Peru", "Japan"]), ("two_hop", ["France", "Peru"])])
def test_reasoning_answer_is_not_a_function_of_the_subjects(kind, chosen):
    answers = Counter()
    for seed in range(60):
        prompt, answer, others = reasoning_prompt(chosen, random.Random(seed), kind)
        assert {answer, *others} == {" " + s for s in chosen}
        answers[answer] += 1
    # same entities, other in-context statements: every entity is the answer for some seed
    assert set(answers) == {" " + s for s in chosen}


def test_reasoning_prompts_are_reproducible_and_vary():
    subjects = ["France", "Peru", "Japan", "Egypt"]
    for kind in REASONING_KINDS:
        a = [reasoning_prompt(subjects, random.Random(7), kind) for _ in range(2)]
        assert a[0] == a[1]
        rng = random.Random(1)
        assert len({reasoning_prompt(subjects, rng, kind)[0] for _ in range(20)}) > 5


def test_reasoning_rejects_bad_arguments():
    with pytest.raises(ValueError):
        reasoning_prompt(["France", "Peru"], random.Random(0), "transitive")
    with pytest.raises(ValueError):
        reasoning_prompt(["France", "France"], random.Random(0), "two_hop")
    with pytest.raises(ValueError):
        reasoning_prompt(["France", "Peru", "Japan"], random.Random(0), "no_such_kind")


# Parsed from the question text, independently of facts.py's templates.
PAIR_REASONING = re.compile(
    r"^Q: If X is (?:the capital of|a city in) ([\w ]+) and \1 is in (\w+), what continent is X in\?\nA:$"
)


def test_question_pairs_in_the_papers_style_are_well_formed(gpt2_tokenizer):
    from headlab.tasks.facts import question_pairs

    continent = {f.subject: f.answer for f in FACTS if f.relation == "continent"}
    pairs = question_pairs(gpt2_tokenizer)
    assert len(pairs) >= 40
    relations = Counter(p.fact.relation for p in pairs)
    assert set(relations) == {"capital", "city_country"}
    for p in pairs:
        (recall, recall_answer), (reasoning, reasoning_answer) = p.recall, p.reasoning
        assert recall.startswith("Q: ") and recall.endswith("?\nA:") and reasoning.endswith("?\nA:")
        assert one_token(gpt2_tokenizer, recall_answer) and one_token(gpt2_tokenizer, reasoning_answer)
        assert recall_answer == " " + p.fact.answer and p.fact.subject in recall
        m = PAIR_REASONING.match(reasoning)
        assert m, reasoning
        # the reasoning question is about the same country as the recall question (its subject or answer)
        assert m.group(1) == p.entity and p.entity in {p.fact.subject, p.fact.answer}
        assert m.group(2) == continent[p.entity] and reasoning_answer == " " + m.group(2)
        assert p.fact.answer not in reasoning.replace(p.entity, "") or p.fact.relation == "city_country"
    thailand = next(p for p in pairs if p.fact.subject == "Thailand")
    assert thailand.recall == ("Q: What is the capital of Thailand?\nA:", " Bangkok")
    assert thailand.reasoning == (
        "Q: If X is the capital of Thailand and Thailand is in Asia, what continent is X in?\nA:",
        " Asia",
    )


def test_question_style_task_pairs_the_ith_recall_with_the_ith_reasoning_prompt(tiny_hf_dir, gpt2_tokenizer):
    from conftest import GPT2_TOKENIZER
    from headlab.models.hf import load_hf
    from headlab.tasks.recall_reasoning import RecallReasoningConfig, RecallReasoningTask

    model = load_hf(str(tiny_hf_dir("gpt2")), tokenizer=str(GPT2_TOKENIZER))
    task = RecallReasoningTask(RecallReasoningConfig(source="facts", facts_style="questions"))
    data = task.build(20, seed=0, model=model)
    kind, ids, read = data.answers["kind"], data.inputs["input_ids"], data.token_positions["ANSWER"]
    assert kind.tolist() == [0] * 10 + [1] * 10
    continents = {gpt2_tokenizer(" " + c)["input_ids"][0] for c in ("Europe", "Asia", "Africa")}
    for i in range(10):
        recall = gpt2_tokenizer.decode(ids[i, : read[i] + 1])  # no BOS: GPT-2's tokenizer puts none
        reasoning = gpt2_tokenizer.decode(ids[10 + i, : read[10 + i] + 1])
        country = PAIR_REASONING.match(reasoning).group(1)
        recall_answer = gpt2_tokenizer.decode([int(data.answers["answer"][i])])
        assert country in recall or recall_answer == " " + country  # one country in both prompts of a pair
        assert int(data.answers["answer"][10 + i]) in continents
        cands = data.answers["candidates"][10 + i]
        assert set(cands[cands >= 0].tolist()) == continents - {int(data.answers["answer"][10 + i])}
