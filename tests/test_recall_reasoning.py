"""Recall vs reasoning (arXiv 2510.03366): task mechanics, selectivity arithmetic, the study end to end."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf

from headlab.analysis.selectivity import drops, top_components
from headlab.tasks.recall_reasoning import ARROW, BOS, QUERY, SEP, RecallReasoningTask
from test_cli import _error_line, headlab


def rr_cfg(**kw):
    base = dict(
        name="recall_reasoning",
        n_prompts=200,
        n_reference=0,
        source="synthetic",
        n_entities=20,
        n_relations=3,
        n_values=8,
        world_seed=0,
        recall_fraction=0.4,
        one_hop_fraction=0.2,
        one_hop_steps=0,
        prepend_bos=True,
        facts_style="statements",
    )
    return OmegaConf.create({**base, **kw})


def _follow(ids: list[int]) -> int:
    """Answer a reasoning prompt by reading its links: the query's successor's successor."""
    assert ids[0] == BOS and ids[-2] == QUERY
    links = {}
    for i in range(1, len(ids) - 2, 4):
        src, arrow, dst, sep = ids[i : i + 4]
        assert arrow == ARROW and sep == SEP
        links[src] = dst
    return links[links[ids[-1]]]


def test_recall_answers_are_the_world_facts_and_cover_every_fact():
    task = RecallReasoningTask(rr_cfg())
    data = task.build(2 * 60, seed=1)  # 20 entities x 3 relations = 60 facts, each once
    ids, kind, answer = data.inputs["input_ids"], data.answers["kind"], data.answers["answer"]
    recall = ids[kind == 0]
    facts = {(int(e) - task.ent0, int(r) - task.rel0) for e, r in recall[:, 1:3].tolist()}
    assert len(facts) == 60
    for (e, r), a in zip(recall[:, 1:3].tolist(), answer[kind == 0].tolist()):
        assert a - task.val0 == task.attributes[e - task.ent0, r - task.rel0]


def test_reasoning_answers_follow_the_context_and_are_not_memorisable():
    task = RecallReasoningTask(rr_cfg())
    data = task.build(400, seed=2)
    ids, kind, answer = data.inputs["input_ids"], data.answers["kind"], data.answers["answer"]
    answers_by_query: dict[int, set[int]] = {}
    for row, a in zip(ids[kind == 1].tolist(), answer[kind == 1].tolist()):
        assert _follow(row) == a
        answers_by_query.setdefault(row[-1], set()).add(a)
    # the same question with other links in the context has another answer
    assert sum(len(v) > 1 for v in answers_by_query.values()) >= len(answers_by_query) // 2
    # matched pairs: reasoning prompt i asks about recall prompt i's entity
    half = data.n // 2
    assert torch.equal(ids[half:, -1], ids[:half, 1])


def test_counterfactuals_keep_the_layout_and_change_the_answer():
    task = RecallReasoningTask(rr_cfg())
    data = task.build(200, seed=3)
    clean, cf = data.inputs["input_ids"], data.counterfactual["input_ids"]
    assert clean.shape == cf.shape
    assert (data.answers["counter_answer"] != data.answers["answer"]).all()
    rea = data.answers["kind"] == 1
    assert torch.equal(clean[rea][:, :-1], cf[rea][:, :-1])  # same links, other query
    for row, a in zip(cf[rea].tolist(), data.answers["counter_answer"][rea].tolist()):
        assert _follow(row) == a


def test_margin_is_the_answer_logit_minus_the_best_other_candidate():
    task = RecallReasoningTask(rr_cfg())
    data = task.build(20, seed=4)
    logits = torch.randn(data.n, 1, task.vocab_size, generator=torch.Generator().manual_seed(0))
    q = task.per_prompt(logits, data)
    for i in range(data.n):
        a = int(data.answers["answer"][i])
        if data.answers["kind"][i] == 0:
            pool = range(task.val0, task.val0 + task.n_val)
        else:
            pool = range(task.ent0, task.ent0 + task.n_ent)
        best = max(float(logits[i, 0, t]) for t in pool if t != a)
        assert float(q[i, 1]) == pytest.approx(float(logits[i, 0, a]) - best, abs=1e-6)
        assert float(q[i, 0]) == float(int(logits[i, 0].argmax()) == a)


def test_drops_selectivity_and_classes_by_hand():
    kind = np.array([0] * 100 + [1] * 100)
    clean = np.ones(200)
    recall_only = clean.copy()
    recall_only[:40] = 0  # breaks 40% of recall prompts
    reasoning_only = clean.copy()
    reasoning_only[100:130] = 0  # 30% of reasoning
    both = clean.copy()
    both[:20], both[100:120] = 0, 0
    harmless = clean.copy()
    harmless[:2] = 0
    correct = np.stack([clean, recall_only, reasoning_only, both, harmless])
    labels = [{"component": c} for c in ("r", "q", "b", "h")]
    df = drops(correct, kind, labels, n_boot=200, seed=0).set_index("component")
    assert df.loc["r", "drop_recall"] == pytest.approx(0.4) and df.loc["r", "drop_reasoning"] == 0
    assert df.loc["q", "drop_reasoning"] == pytest.approx(0.3)
    assert df.loc["r", "selectivity"] == 1.0 and df.loc["q", "selectivity"] == -1.0
    assert df.loc["b", "selectivity"] == pytest.approx(0.0)
    assert df["class"].to_dict() == {"r": "recall", "q": "reasoning", "b": "shared", "h": "none"}
    assert df.loc["r", "drop_recall_low"] > 0.25 and df.loc["r", "drop_recall_high"] < 0.55
    # ranked by the kind's drop among components on its side of selectivity ("b" is on neither)
    assert list(top_components(df.reset_index(), "recall", 3)["component"]) == ["r", "h"]
    assert list(top_components(df.reset_index(), "reasoning", 3)["component"]) == ["q"]


def test_facts_source_builds_single_token_answers_for_gpt2(tiny_hf_dir, gpt2_tokenizer):
    from types import SimpleNamespace

    task = RecallReasoningTask(rr_cfg(source="facts"))
    data = task.build(60, seed=0, model=SimpleNamespace(tokenizer=gpt2_tokenizer, name="gpt2"))
    ids = data.inputs["input_ids"]
    assert (data.answers["kind"] == 0).sum() == (data.answers["kind"] == 1).sum() == 30
    for i in range(data.n):
        last = int(data.positions[i, 0])
        assert ids[i, 0] == gpt2_tokenizer.bos_token_id
        text = gpt2_tokenizer.decode(ids[i, 1 : last + 1])
        answer = gpt2_tokenizer.decode([int(data.answers["answer"][i])])
        assert not text.endswith(" ") and answer.startswith(" ")
        if data.answers["kind"][i] == 1:
            assert answer in text  # reasoning answers come from the context
        others = [gpt2_tokenizer.decode([int(t)]) for t in data.answers["candidates"][i] if t >= 0]
        assert others and answer not in others


FAST = [
    "experiment=recall_reasoning",
    "model.n_layers=2",
    "model.d_model=32",
    "model.d_head=8",
    "model.d_mlp=64",
    "train.steps=60",
    "train.eval_every=30",
    "task.n_entities=10",
    "task.n_prompts=60",
    "output.n_boot=20",
]


def test_circuits_run_writes_drops_classes_knockouts_and_figures(tmp_path):
    proc = headlab("run", *FAST, f"output.root={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    run_dir = next(tmp_path.rglob("results.parquet")).parent
    table = pd.read_parquet(run_dir / "results.parquet")
    comps = table[table["metric"] == "drop_recall"]
    ablated, crossed = comps[comps["intervention"] != "patch_head"], comps[comps["intervention"] == "patch_head"]
    assert len(ablated) == 2 * 4 + 2 * 2 + 2 * 4  # heads, attention + MLP per layer, 4 neuron groups per layer
    assert len(crossed) == 8 and (crossed["group"] == "other_kind").all()  # every head, from the other kind
    assert set(comps["class"]) <= {"recall", "reasoning", "shared", "none"}
    knock = table[table["intervention"] == "knockout"]
    assert {"recall_top", "reasoning_top", "random", "clean"} >= set(knock["method"]) >= {"random", "clean"}
    assert knock["k"].max() == 10
    patches = table[(table["intervention"] == "patch_head") & (table["metric"] == "recall_margin")]
    assert len(patches) == 16 and patches["group"].isna().sum() == 8  # same kind, then the other kind
    numbers = json.loads((run_dir / "figures" / "numbers.json").read_text())
    assert set(numbers["clean"]) == {"recall_acc", "reasoning_acc"}
    assert {p.name for p in (run_dir / "figures").glob("*.png")} == {
        "fig_component_effects.png",
        "fig_knockouts.png",
        "fig_layer_profile.png",
    }


def test_circuits_on_a_pretrained_model_with_the_fact_table(tiny_hf_dir, gpt2_tokenizer):
    from conftest import GPT2_TOKENIZER
    from headlab.models.hf import load_hf
    from headlab.studies import recall_reasoning

    model = load_hf(str(tiny_hf_dir("gpt2")), tokenizer=str(GPT2_TOKENIZER))  # 3 layers x 4 heads
    task = RecallReasoningTask(rr_cfg(source="facts"))
    data = task.build(24, seed=0, model=model)
    cfg = OmegaConf.create(
        {
            "ablate": {"method": "mean"},
            "engine": {"chunk_mb": 32.0, "naive": False},
            "output": {"n_boot": 20},
            "seed": 0,
        }
    )
    table, extra = recall_reasoning.measure(
        cfg, model, task, data, {"experiment": "t", "model": "tiny", "task": task.name, "seed": 0}
    )
    comps = table[table["metric"] == "drop_recall"]
    ablated = comps[comps["intervention"] != "patch_head"]
    assert len(ablated) == 3 * 4 + 3 * 2 + 3 * 4  # heads, attention + MLP, neuron groups
    assert extra["n_components"] == len(ablated)
    # the fact table has no same-kind counterfactuals; every head is patched from the other kind
    patched = table[(table["intervention"] == "patch_head") & (table["metric"] == "recall_acc")]
    assert len(patched) == 12 and (patched["group"] == "other_kind").all()
    clean = table[
        (table["intervention"] == "knockout") & (table["method"] == "clean") & (table["metric"] == "recall_acc")
    ]
    base = table[(table["intervention"] == "none") & (table["metric"] == "recall_acc")]
    assert float(clean["value"].iloc[0]) == pytest.approx(float(base["value"].iloc[0]))


def test_circuits_needs_a_recall_reasoning_task(tmp_path):
    proc = headlab("run", "ablate=circuits", "train.steps=20", f"output.root={tmp_path}", cwd=tmp_path)
    assert proc.returncode != 0
    assert "ablate=circuits needs a task with recall and reasoning prompts" in _error_line(proc)


def test_other_kind_pairs_each_prompt_with_the_other_kinds_prompt_over_the_same_entity():
    from headlab.tasks.recall_reasoning import other_kind

    task = RecallReasoningTask(rr_cfg())
    data = task.build(40, seed=4)
    paired = other_kind(data)
    ids, cf = data.inputs["input_ids"], paired.counterfactual["input_ids"]
    half = data.n // 2
    kind = data.answers["kind"]
    for i in range(half):
        recall, reasoning = ids[i].tolist(), ids[half + i].tolist()
        assert kind[i] == 0 and kind[half + i] == 1
        assert cf[i].tolist() == reasoning and cf[half + i].tolist() == recall
        assert reasoning[-1] == recall[1]  # the reasoning query starts at the recalled entity
    answer = data.token_positions["ANSWER"]
    moved = paired.counterfactual_positions["ANSWER"]
    assert answer[:half].tolist() == [3] * half and moved[:half].tolist() == [task.max_len - 1] * half
    assert moved[half:].tolist() == [3] * half
    assert paired.inputs is data.inputs and data.counterfactual is not None  # the original is untouched


def test_numbers_report_drops_in_percentage_points_and_random_vs_recall_top():
    import pandas as pd

    from headlab.figures.recall_reasoning import numbers

    table = pd.DataFrame(
        [
            {"intervention": "none", "metric": "recall_acc", "value": 0.9},
            {"intervention": "none", "metric": "reasoning_acc", "value": 0.8},
        ]
    )
    ko = pd.DataFrame(
        [
            {"method": "clean", "k": 0, "recall_acc": 0.9, "reasoning_acc": 0.8},
            {"method": "recall_top", "k": 3, "recall_acc": 0.58, "reasoning_acc": 0.74},
            {"method": "random", "k": 3, "recall_acc": 0.58, "reasoning_acc": 0.31},
        ]
    )
    comps = pd.DataFrame(
        [
            {"intervention": "ablate_head", "component": "L0H0", "drop_recall": 0.29, "drop_reasoning": -0.01,
             "class": "recall"},
            {"intervention": "ablate_head", "component": "L0H1", "drop_recall": 0.01, "drop_reasoning": 0.73,
             "class": "reasoning"},
        ]
    )  # fmt: skip
    out = numbers(table, comps, ko)
    assert out["paper_max_drop_pp"] == 15.0
    # (0.9 - 0.58) * 100 = 32 points; (0.8 - 0.31) * 100 = 49 points
    assert out["knockout_recall_top"][3] == {"recall_drop_pp": 32.0, "reasoning_drop_pp": 6.0}
    assert out["knockout_random"][3] == {"recall_drop_pp": 32.0, "reasoning_drop_pp": 49.0}
    assert out["random_vs_recall_top_at_k3"]["random_cuts_recall_as_much"] is True
    assert out["heads"] == {"max_recall_drop_pp": 29.0, "max_reasoning_drop_pp": 73.0, "mean_abs_drop_pp": 26.0}
