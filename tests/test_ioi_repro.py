"""`headlab reproduce ioi_trained --quick` end to end; the score-based class rules against the paper's GPT-2 heads."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from conftest import GPT2_TOKENIZER
from headlab.figures import ioi_classes


def test_classes_follow_the_rules_and_score_against_the_paper():
    shape = (12, 12)
    scores = {name: np.zeros(shape) for name, _ in sum(ioi_classes.RULES.values(), [])}
    for layer, head in ((9, 9), (9, 6), (3, 3)):  # two of the paper's three name movers, one wrong head
        scores["attn_end_to_io"][layer, head] = scores["copy_score"][layer, head] = 0.9
    scores["attn_end_to_s2"][7, 3] = 0.5
    scores["induction_score"][5, 5] = 0.5
    direct = np.zeros(shape)
    direct[9, 9], direct[9, 6], direct[3, 3] = 2.0, 1.5, 0.1  # 3.3 carries under a fifth of 9.9's effect
    found = ioi_classes.classify(scores, direct)
    assert found["name mover"] == ["9.6", "9.9"] and found["backup name mover"] == ["3.3"]
    vs = ioi_classes.versus_paper(found)
    assert vs["name mover"]["precision"] == 1.0 and vs["name mover"]["recall"] == pytest.approx(2 / 3)
    assert vs["backup name mover"]["precision"] == 0.0 and vs["previous token"]["precision"] is None
    order = ioi_classes.structure(found)
    assert order["s_inhibition_before_name_movers"] and order["induction_duplicate_before_s_inhibition"]


def test_quick_reproduction_draws_the_figures_and_numbers_match_the_table(tmp_path):
    from headlab.reproduce import registry, run_all

    assert "ioi_trained" in registry()
    smaller = (f"model.tokenizer={GPT2_TOKENIZER}", "train.steps=150", "task.n_prompts=32")  # the pipeline only
    result = run_all("ioi_trained", tmp_path, quick=True, extra=smaller, log=lambda *_: None)
    base = tmp_path / "reproduce" / "ioi_trained-quick"
    names = {p.split("/")[-1] for p in result["figures"]}
    assert {
        "ioi_ablation_mean.png",
        "ioi_path_patching.png",
        "ioi_head_scores.png",
        "ioi_head_classes.png",
        "circuit_eap_ig.png",
    } <= names
    numbers = json.loads((base / "numbers.json").read_text())
    assert numbers["model"] == "gpt2-ioi" and (numbers["n_layers"], numbers["n_heads"]) == (2, 4)
    classes = numbers["head_classes"]
    assert {"found", "paper_gpt2_small", "structure", "thresholds"} <= set(classes)
    assert classes["paper_gpt2_small"]["name mover"] == ["9.9", "9.6", "10.0"]
    assert numbers["circuit"]["circuit_edges_eap_ig"] >= 1

    # recomputed from the collected table, with pandas rather than the figure code
    table = pd.read_parquet(base / "collected.parquet")
    score = table[table["method"] == "score"].pivot_table(index=["layer", "head"], columns="metric", values="value")
    best = score["attn_end_to_io"].idxmax()
    top = numbers["head_scores"]["attn_end_to_io"][0]
    assert top["head"] == f"{int(best[0])}.{int(best[1])}"
    assert top["value"] == pytest.approx(score["attn_end_to_io"].max())
    for cls, rule in ioi_classes.RULES.items():
        hit = np.logical_and.reduce([score[s] >= t for s, t in rule])
        heads = [f"{int(layer)}.{int(head)}" for layer, head in score.index[hit]]
        got = classes["found"][cls] + (classes["found"].get("backup name mover", []) if cls == "name mover" else [])
        assert sorted(got) == sorted(heads), cls
