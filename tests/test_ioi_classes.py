"""study=ioi_classes: Wang et al.'s head classes by path patching, round by round from the logits back."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

import headlab
from conftest import error_line, run_headlab
from headlab.analysis.ioi_classes import CLASS_METHOD, classify
from headlab.figures import FIGURES
from headlab.figures import ioi_classes as class_figure
from headlab.models.hf import load_hf

SCORES = ("attn_end_to_io", "attn_end_to_s2", "prev_token_score", "duplicate_token_score", "induction_score")


def test_each_class_follows_its_stated_rule_and_a_head_keeps_its_first_class():
    shape = (4, 3)
    scores = {name: np.zeros(shape) for name in SCORES}
    scores["attn_end_to_io"][3, 0] = scores["attn_end_to_io"][3, 1] = scores["attn_end_to_io"][2, 2] = 0.6
    scores["attn_end_to_s2"][2, 0] = 0.5
    scores["induction_score"][1, 0] = 0.7
    scores["duplicate_token_score"][1, 1] = 0.4
    scores["prev_token_score"][0, 2] = 0.9
    clean = 4.0  # tau 0.05: a class needs an effect of 0.2 either way
    nan = np.full(shape, np.nan)
    logits, q = nan.copy(), nan.copy()
    logits[3, 0], logits[3, 1], logits[2, 2], logits[2, 0] = -1.0, -0.19, 0.5, -0.9
    q[2, 0], q[1, 1] = -0.4, -0.3
    v = nan.copy()
    v[1, 0], v[1, 1], v[0, 2], v[2, 0] = -0.3, -0.25, -0.05, -0.5  # 2.0 is an S-inhibition head already
    k = nan.copy()
    k[0, 2], k[0, 1] = -0.3, -0.3
    found = classify({"logits": logits, "q": q, "v": v, "k": k}, scores, clean, tau=0.05)
    # 3.1 falls short of 0.2; 2.0 has the effect but attends S2, not IO
    assert found["name mover"] == ["3.0"]
    assert found["negative name mover"] == ["2.2"]
    assert found["S-inhibition"] == ["2.0"]  # 1.1 lowers the queries too but attends neither name
    assert found["induction"] == ["1.0"]
    assert found["duplicate token"] == ["1.1"]
    assert found["previous token"] == ["0.2"]  # 0.1's previous-token score is no higher than its others
    assert "S-inhibition" not in classify({"logits": logits}, scores, clean, tau=0.05)


@pytest.fixture(scope="module")
def tiny_gpt2(tiny_hf_dir, gpt2_tokenizer):
    model = load_hf(str(tiny_hf_dir("gpt2")), need_tokenizer=False)
    model.tokenizer = gpt2_tokenizer
    return model


def _grid(rows: pd.DataFrame, shape: tuple[int, int], clean: float) -> np.ndarray:
    m = np.full(shape, np.nan)
    for r in rows.itertuples():
        m[int(r.layer), int(r.head)] = r.value - clean
    return m


def test_the_study_patches_into_the_class_it_found_and_its_rows_hold_the_rules(tiny_gpt2):
    tau = 0.01
    table = headlab.study(tiny_gpt2, headlab.load_task("ioi"), "ioi_classes", n_prompts=24, tau=tau, n_boot=20)
    shape = (tiny_gpt2.n_layers, tiny_gpt2.n_heads)
    ld = table[table["metric"] == "logit_diff"]
    clean = float(ld[(ld["intervention"] == "none") & (ld["method"] == "none")]["value"].iloc[0])
    path = ld[ld["intervention"] == "path_patch"]
    effects = {"logits": _grid(path[path["receivers"] == "logits"], shape, clean)}
    for site in ("q", "v", "k"):
        if (path["site"] == site).any():
            effects[site] = _grid(path[path["site"] == site], shape, clean)
    scores = {
        name: table[(table["method"] == "score") & (table["metric"] == name)]
        .pivot_table(index="layer", columns="head", values="value")
        .to_numpy()
        for name in SCORES
    }
    expected = {cls: heads for cls, heads in classify(effects, scores, clean, tau).items() if heads}
    assert expected.get("name mover"), "the random model should have a name mover at tau 0.01"
    assert class_figure.procedure_classes(table) == expected
    # round 2 entered exactly the name movers' queries, from every head below the last of them
    into_q = path[path["site"] == "q"]
    assert set(into_q["receivers"]) == {
        " ".join(classify({"logits": effects["logits"]}, scores, clean, tau)["name mover"])
    }
    last = max(int(h.split(".")[0]) for h in expected["name mover"])
    assert set(into_q["layer"]) == set(range(last))
    rows = table[table["method"] == CLASS_METHOD]
    for r in rows[rows["group"] == "name mover"].itertuples():
        assert r.value == pytest.approx(effects["logits"][int(r.layer), int(r.head)])


def test_figures_draw_the_classes_and_the_circuit_diagram(tiny_gpt2, tmp_path):
    table = headlab.study(tiny_gpt2, headlab.load_task("ioi"), "ioi_classes", n_prompts=16, tau=0.01, n_boot=20)
    numbers = FIGURES["ioi"](table, tmp_path)
    classes = numbers["head_classes"]
    assert classes["procedure"].startswith("path patching")
    assert classes["found"] == class_figure.procedure_classes(table)
    assert (tmp_path / "ioi_circuit.png").stat().st_size > 10_000
    assert "ioi_circuit.png" in numbers["figures"]
    json.dumps(numbers)


def test_a_task_without_abc_prompts_or_a_bad_tau_is_refused_in_one_line(tmp_path):
    bad = run_headlab("run", "study=ioi_classes", "study.tau=2", f"output.root={tmp_path}", cwd=tmp_path)
    assert bad.returncode == 2 and "tau" in error_line(bad) and len(error_line(bad)) < 200
    assert not list(tmp_path.rglob("results.parquet"))
