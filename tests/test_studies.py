"""Studies by name (`study=`): one registry, the short forms that name a study and the refusal when
they disagree, a run's hash over what its study reads (and the hashes of runs and checkpoints written
before studies had names, pinned), `headlab list study`, and a study added from outside the package."""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys

import pandas as pd
import pytest

import headlab
from conftest import ROOT, error_line, run_headlab
from headlab import config, results
from headlab.config import run_info
from headlab.door import compose, group_options
from headlab.studies import registry
from headlab.studies.runner import already_done
from headlab.train.obtain import checkpoint_dir


def test_the_cache_key_is_the_study_its_options_model_task_and_version(monkeypatch):
    sweep = registry.get("sweep")
    key, checkpoint = sweep.hash(compose([])), checkpoint_dir(compose([]))
    assert sweep.hash(compose(["study=sweep"])) == key  # the long form is the same config
    assert registry.get("sinks").hash(compose(["scores=sinks"])) == registry.get("sinks").hash(compose(["study=sinks"]))
    monkeypatch.setattr(config, "CACHE_VERSION", config.CACHE_VERSION + 1)  # a meaning changed: all is redone once
    assert sweep.hash(compose([])) != key and checkpoint_dir(compose([])) != checkpoint


def _finished(run_dir, stored_hash):
    """A complete run dir whose meta.json holds `stored_hash`."""
    table = results.conform(pd.DataFrame([{**run_info(compose([])), "intervention": "none", "method": "none",
                                           "metric": "label_acc", "value": 1.0, "n": 2}]))  # fmt: skip
    results.write(table, run_dir, {"config_hash": stored_hash})


def test_a_study_hash_covers_what_it_reads_only(tmp_path):
    sinks, sweep = registry.get("sinks"), registry.get("sweep")
    plain, mean = compose(["scores=sinks"]), compose(["scores=sinks", "ablate.method=mean"])
    assert sinks.hash(plain) == sinks.hash(mean)
    assert sinks.hash(plain) != sinks.hash(compose(["scores=sinks", "study.epsilon=0.5"]))
    assert sinks.hash(plain) == sinks.hash(compose(["scores=sinks", "scores.epsilon=0.3"]))  # 0.1's spelling
    assert sweep.hash(compose([])) != sweep.hash(compose(["ablate.method=mean"]))
    assert sweep.hash(compose([])) == sweep.hash(compose(["sae.layer=1"]))  # the sweep fits no SAE
    _finished(tmp_path / "s", sinks.hash(plain))
    assert already_done(compose(["scores=sinks", "ablate.method=mean"]), tmp_path / "s")
    assert not already_done(compose(["scores=sinks", "seed=1"]), tmp_path / "s")
    assert not already_done(compose(["scores=composition"]), tmp_path / "s")


@pytest.mark.parametrize(
    "overrides,study",
    [
        ([], "sweep"),
        (["scores=sinks"], "sinks"),
        (["study=sinks"], "sinks"),
        (["circuit=eap"], "circuit"),
        (["study=circuit", "circuit=eap"], "circuit"),
        (["ablate=circuits"], "recall_reasoning"),
        (["study=pathnet"], "pathnet"),
        (["task=markov"], "pathnet"),
        (["experiment=recall_reasoning"], "recall_reasoning"),
        (["experiment=ioi_circuit"], "sweep"),
    ],
)
def test_the_study_a_config_names(overrides, study):
    cfg = compose(overrides)
    assert registry.resolve(cfg, registry.named_study(overrides)).name == study
    assert cfg.study.name == study


def test_study_circuit_alone_runs_eap_ig():
    cfg = compose(["study=circuit"])
    assert cfg.study.method == "eap_ig" and cfg.study.ig_steps_from is None  # each method's authors' k


@pytest.mark.parametrize(
    "args,named",
    [
        (["circuit=eap", "scores=sinks"], ("circuit=eap", "scores=sinks")),
        (["study=sinks", "circuit=eap"], ("study=sinks", "circuit=eap")),
        (["study=sweep", "scores=composition"], ("study=sweep", "scores=composition")),
        (["study=composition", "scores=sinks"], ("study=composition", "scores=sinks")),
        (["ablate=circuits", "task=markov"], ("ablate=circuits", "task=markov")),
        # a sweep: refused at the door, before Hydra starts any job, where only one job disagrees
        (["-m", "seed=0,1", "study=sweep,sinks", "circuit=eap"], ("circuit=eap", "study=sweep,sinks")),
    ],
)
def test_disagreeing_study_names_are_refused_in_one_line_with_exit_2(args, named, tmp_path):
    proc = run_headlab("run", *args, f"output.root={tmp_path / 'out'}", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    line = error_line(proc)
    assert all(n in line for n in named) and len(line) < 200, line
    assert not (tmp_path / "out").exists() and not (tmp_path / "outputs").exists()


def test_the_sweep_of_the_api_does_not_become_the_pathnet_study(toy):
    _, model, _ = toy
    with pytest.raises(headlab.UsageError, match=r"study=sweep cannot run with task=markov"):
        headlab.sweep(model, headlab.load_task("markov"))
    with pytest.raises(headlab.UsageError, match=r"study=sweep cannot run with ablate=circuits"):
        headlab.sweep(model, headlab.load_task("counting", n_prompts=16), ablate="circuits")


@pytest.fixture(scope="module")
def toy(demo_root):
    return demo_root, headlab.load_model("toy-attn-1l", root=str(demo_root)), headlab.load_task("counting")


def test_study_runs_any_study_and_the_old_calls_are_its_short_forms(toy):
    _, model, task = toy
    common = dict(n_prompts=32, n_boot=20)
    by_name = headlab.study(model, task, "sinks", epsilon=0.5, **common)
    pd.testing.assert_frame_equal(by_name, headlab.scores(model, task, kind="sinks", epsilon=0.5, **common))
    assert set(by_name["method"]) == {"score"}
    swept = headlab.study(model, task, "sweep", ablate="layers", method="mean", **common)
    pd.testing.assert_frame_equal(swept, headlab.sweep(model, task, ablate="layers", method="mean", **common))
    assert set(swept["intervention"]) == {"none", "ablate_layer"} and set(swept["method"]) == {"none", "mean"}
    known = "atlas, audit, circuit, composition"
    with pytest.raises(headlab.UsageError, match=f"unknown study 'nope'; choose from: {known}"):
        headlab.study(model, task, "nope")


def test_list_study_names_each_study_with_its_line(tmp_path):
    proc = run_headlab("list", "study", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for study in registry.builtin():
        line = next(ln for ln in proc.stdout.splitlines() if ln.split()[:1] == [study.name])
        assert study.description[:40] in line
    assert set(group_options("study")) == {s.name for s in registry.builtin()}


# ---------------------------------------------------------------- the docs' "Adding a study", kept true


# The docs' "Adding a study" (docs/extending/study.md): its module (its options, its run and its Study record,
# registered) and its YAML, run as the page holds them; no file of headlab's is edited.
ADDING_A_STUDY = (ROOT / "docs" / "extending" / "study.md").read_text()
TALLY_MODULE, TALLY_YAML = (
    re.search(rf"```{lang}\n(.*?)\n```", ADDING_A_STUDY, re.S)[1] + "\n"  # type: ignore[index]
    for lang in ("python", "yaml")
)


@pytest.fixture
def tally_study(tmp_path, monkeypatch):
    """The tally study added as the docs say, in two files outside headlab: its module (on the path,
    named by HEADLAB_PLUGINS for a `headlab` process) and its YAML (in a config dir of the user's)."""
    configs, plugins = tmp_path / "configs", tmp_path / "plugins"
    shutil.copytree(ROOT / "configs", configs)
    (configs / "study" / "tally.yaml").write_text(TALLY_YAML)
    plugins.mkdir()
    (plugins / "tally_study.py").write_text(TALLY_MODULE)
    monkeypatch.setenv("HEADLAB_CONFIG_DIR", str(configs))
    monkeypatch.setattr(registry, "REGISTERED", {})
    monkeypatch.syspath_prepend(str(plugins))
    sys.modules.pop("tally_study", None)
    group_options.cache_clear()
    yield importlib.import_module("tally_study").STUDY
    sys.modules.pop("tally_study", None)
    group_options.cache_clear()


def test_a_study_added_outside_the_package_runs_through_the_cli(tally_study, tmp_path):
    proc = run_headlab("run", "study=tally", "study.copies=3", f"hydra.run.dir={tmp_path / 'r'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "tally of 3 rows: copy0, copy1, copy2" in proc.stdout
    table = pd.read_parquet(tmp_path / "r" / "results.parquet")
    assert list(table["value"]) == [0.0, 1.0, 2.0] and set(table["method"]) == {"tally"}
    meta = json.loads((tmp_path / "r" / "meta.json").read_text())
    assert (
        meta["study"] == "tally"
        and meta["copies"] == 3
        and meta["config_hash"] == tally_study.hash(compose(["study=tally", "study.copies=3"]))
    )
    again = run_headlab("run", "study=tally", "study.copies=3", "ablate.method=mean",
                        f"hydra.run.dir={tmp_path / 'r'}", cwd=tmp_path)  # fmt: skip
    assert again.returncode == 0 and "skipped" in again.stdout  # it reads the task only
    bad = run_headlab("run", "study=tally", "study.copies=many", f"output.root={tmp_path}", cwd=tmp_path)
    assert bad.returncode == 2 and "study.copies" in error_line(bad)
    low = run_headlab("run", "study=tally", "study.copies=0", f"output.root={tmp_path}", cwd=tmp_path)
    assert low.returncode == 2 and "study.copies=0: expected an integer >= 1" in error_line(low)
    listed = run_headlab("list", "study", cwd=tmp_path)
    assert "counts to copies" in listed.stdout
    short = compose(["tally=mine", "tally.copies=5"]).study  # its record's short form: the door names no study
    assert (short.name, short.label, short.copies) == ("tally", "mine", 5)
    env = {**os.environ, "HEADLAB_PLUGINS": "tally_study", "PYTHONPATH": str(tmp_path / "plugins")}
    own = subprocess.run(
        [sys.executable, "-m", "headlab", "run", "study=tally", f"hydra.run.dir={tmp_path / 'p'}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert own.returncode == 0 and "tally of 2 rows" in own.stdout, own.stderr[-2000:]


def test_a_study_added_outside_the_package_runs_through_the_api(tally_study, toy):
    _, model, task = toy
    table = headlab.study(model, task, "tally", copies=4, label="mine", n_prompts=16)
    assert list(table["metric"]) == ["copy0", "copy1", "copy2", "copy3"] and set(table["method"]) == {"mine"}
    assert set(table["n"]) == {16}


def test_each_study_prints_its_own_summary(capsys):
    base = {"experiment": "e", "model": "m", "task": "t", "seed": 0, "n": 8}
    edges = [{**base, "intervention": "edge", "method": "eap", "metric": "logit_diff", "edge": e, "value": v,
              "in_circuit": v > 0.3} for e, v in (("a0->m0", 0.5), ("a1->logits", -0.1))]  # fmt: skip
    numbers = {"cpr": 0.9, "cmd": 0.1, "target_edges": 3, "target_faithfulness": 0.85, "clean": 2.0, "corrupted": 0.5}
    circuit = [{**base, "intervention": "circuit", "method": "eap", "metric": k, "value": numbers[k]} for k in numbers]
    registry.get("circuit").summary(pd.DataFrame(edges + circuit), 1)
    shown = " ".join(capsys.readouterr().out.split())  # titles wrap at the table's width
    assert "a0->m0" in shown and "a1->logits" not in shown and "1 of 2 edges" in shown
    assert "eap: CPR 0.900, CMD 0.100; 3 edges recover 0.850" in shown
    curve = [{**base, "intervention": "none", "method": "train", "step": s, "metric": "label_acc", "value": s / 200}
             for s in (50, 100)]  # fmt: skip
    registry.get("train").summary(pd.DataFrame(curve), 24)
    shown = " ".join(capsys.readouterr().out.split())  # titles wrap at the table's width
    assert "m on t: step 100" in shown and "0.5000" in shown and "0.2500" not in shown
    sweep = [{**base, "intervention": i, "method": "zero", "layer": l, "head": 0, "metric": "acc", "value": v}
             for i, l, v in (("none", None, 0.9), ("ablate_head", 0, 0.2), ("ablate_head", 1, 0.85))]  # fmt: skip
    registry.get("sweep").summary(pd.DataFrame(sweep), 1)
    shown = " ".join(capsys.readouterr().out.split())  # titles wrap at the table's width
    assert "1 of 2 interventions, largest change in acc" in shown and "0.200" in shown and "0.850" not in shown
    # scores per head (every row intervention none): the heads that score highest, in 100 columns, no name cut
    scores = [
        {**base, "intervention": "none", "method": "score", "layer": l, "head": h, "metric": m, "value": v}
        for l in range(6)
        for h in range(5)
        for m, v in (("gu_first_token_attention", (7 * l + 3 * h) % 10 / 10), ("sink_ratio_first_token", 0.5))
    ]
    registry.get("sinks").summary(pd.DataFrame(scores), 4)
    out = capsys.readouterr().out
    shown = " ".join(out.split())
    assert "the 4 of 30 heads with the largest gu_first_token_attention" in shown
    assert "…" not in out and max(map(len, out.splitlines())) <= 100
    assert shown.count(" 0.900 ") == 2 and " 0.100 " not in shown  # the 2 heads at 0.9, then two at 0.8
