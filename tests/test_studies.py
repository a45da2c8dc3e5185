"""Studies by name (`study=`): one registry, the short forms that name a study and the refusal when
they disagree, a run's hash over what its study reads (and the hashes of runs and checkpoints written
before studies had names, pinned), `headlab list study`, and a study added from outside the package."""

from __future__ import annotations

import json
import shutil
import sys
import types
from dataclasses import dataclass

import pandas as pd
import pytest

import headlab
from conftest import ROOT, error_line, run_headlab
from headlab import results
from headlab.composition import compose, group_options
from headlab.config import config_hash, run_info
from headlab.studies import Study, registry
from headlab.studies.runner import already_done
from headlab.studies.summary import console
from headlab.train.obtain import checkpoint_dir

# Computed with the code of main before studies had names (commit 2af2301); they must never move, or
# every finished run dir and trained checkpoint of a user is silently redone.
LEGACY_DEFAULT_RUN = "09d4a5ecae80"
LEGACY_SINKS_RUN = "50b70dad69a2"
DEMO_CHECKPOINT = "toy-attn-1l-counting-seed0-f13a6c3686bb"
TOY_2L_CHECKPOINT = "toy-attn-2l-counting-seed0-cafaf04af620"


def test_hashes_of_runs_and_checkpoints_from_before_studies_had_names_hold():
    assert config_hash(compose([])) == LEGACY_DEFAULT_RUN
    assert config_hash(compose(["scores=sinks"])) == LEGACY_SINKS_RUN
    assert config_hash(compose(["study=sinks"])) == LEGACY_SINKS_RUN  # the long form is the same config
    assert checkpoint_dir(compose([])).name == DEMO_CHECKPOINT
    assert checkpoint_dir(compose(["model=toy-attn-2l", "train.steps=300"])).name == TOY_2L_CHECKPOINT
    assert checkpoint_dir(compose(["study=circuit", "scores=none"])).name == DEMO_CHECKPOINT


def _finished(run_dir, stored_hash):
    """A complete run dir whose meta.json holds `stored_hash`."""
    table = results.conform(pd.DataFrame([{**run_info(compose([])), "intervention": "none", "method": "none",
                                           "metric": "label_acc", "value": 1.0, "n": 2}]))  # fmt: skip
    results.write(table, run_dir, {"config_hash": stored_hash})


def test_a_run_dir_written_with_the_legacy_hash_is_still_skipped(tmp_path):
    _finished(tmp_path / "old", LEGACY_DEFAULT_RUN)
    assert already_done(compose([]), tmp_path / "old")
    assert not already_done(compose(["ablate.method=mean"]), tmp_path / "old")
    # the legacy hash knows no study: a study the short forms do not choose is not taken for the sweep
    assert not already_done(compose(["study=train"]), tmp_path / "old")
    result = headlab.run(f"hydra.run.dir={tmp_path / 'old'}")
    assert result.skipped and result.run_dir == tmp_path / "old"


def test_a_study_hash_covers_what_it_reads_only(tmp_path):
    sinks, sweep = registry.get("sinks"), registry.get("sweep")
    plain, mean = compose(["scores=sinks"]), compose(["scores=sinks", "ablate.method=mean"])
    assert sinks.hash(plain) == sinks.hash(mean)
    assert sinks.hash(plain) != sinks.hash(compose(["scores=sinks", "scores.epsilon=0.5"]))
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
    assert compose(["study=circuit"]).circuit.method.value == "eap_ig"


@pytest.mark.parametrize(
    "args,named",
    [
        (["circuit=eap", "scores=sinks"], ("circuit=eap", "scores=sinks")),
        (["study=sinks", "circuit=eap"], ("study=sinks", "circuit=eap")),
        (["study=sweep", "scores=composition"], ("study=sweep", "scores=composition")),
        (["study=composition", "scores=sinks"], ("study=composition", "scores=sinks")),
        (["ablate=circuits", "task=markov"], ("ablate=circuits", "task=markov")),
        # a sweep: refused at the door, before Hydra starts any job, where only one job disagrees
        (["-m", "seed=0,1", "scores=none,sinks", "circuit=eap"], ("circuit=eap", "scores=sinks")),
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
    with pytest.raises(headlab.UsageError, match="unknown study 'nope'; choose from: atlas, circuit, composition"):
        headlab.study(model, task, "nope")


def test_list_study_names_each_study_with_its_line(tmp_path):
    proc = run_headlab("list", "study", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for study in registry.builtin():
        line = next(ln for ln in proc.stdout.splitlines() if ln.split()[:1] == [study.name])
        assert study.description[:40] in line
    assert set(group_options("study")) == {s.name for s in registry.builtin()}


# ---------------------------------------------------------------- the README's "Adding a study", kept true


@dataclass
class TallyOptions:
    copies: int = 2
    label: str = "tally"


def tally(ctx):
    """One row per copy: the task's prompt count, from the config alone (no model)."""
    opts = ctx.options
    rows = [
        {**run_info(ctx.cfg), "intervention": "none", "method": opts.label, "metric": f"copy{i}", "value": 1.0 * i}
        for i in range(opts.copies)
    ]
    ctx.meta["copies"] = opts.copies
    return results.conform(pd.DataFrame(rows).assign(n=ctx.cfg.task.n_prompts))


def tally_summary(table, max_rows):
    console.print(f"tally of {len(table)} rows: {', '.join(table['metric'][:max_rows])}", highlight=False)


@pytest.fixture(params=["BUILTIN", "register"])
def tally_study(request, tmp_path, monkeypatch):
    """The tally study added as the README says: its module's name in registry.BUILTIN (the module put
    where headlab.studies.tally would be), or from outside the package with register()."""
    configs = tmp_path / "configs"
    shutil.copytree(ROOT / "configs", configs)
    (configs / "study" / "tally.yaml").write_text(
        "# @package _global_\nstudy:\n  name: tally\n  options:\n    copies: 2\n    label: tally\n"
    )
    monkeypatch.setenv("HEADLAB_CONFIG_DIR", str(configs))
    monkeypatch.setattr(registry, "REGISTERED", {})
    group_options.cache_clear()
    study = Study(
        name="tally",
        description="counts to copies",
        run=tally,
        summary=tally_summary,
        reads=("task",),
        schema=TallyOptions,
    )  # fmt: skip
    if request.param == "register":
        registry.register(study)
    else:
        module = types.ModuleType("headlab.studies.tally")
        module.STUDY = study  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "headlab.studies.tally", module)
        monkeypatch.setattr(registry, "BUILTIN", (*registry.BUILTIN, "tally"))
    yield study
    group_options.cache_clear()


def test_a_study_added_outside_the_package_runs_through_the_cli(tally_study, tmp_path):
    proc = run_headlab("run", "study=tally", "study.options.copies=3", f"hydra.run.dir={tmp_path / 'r'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "tally of 3 rows: copy0, copy1, copy2" in proc.stdout
    table = pd.read_parquet(tmp_path / "r" / "results.parquet")
    assert list(table["value"]) == [0.0, 1.0, 2.0] and set(table["method"]) == {"tally"}
    meta = json.loads((tmp_path / "r" / "meta.json").read_text())
    assert (
        meta["study"] == "tally"
        and meta["copies"] == 3
        and meta["config_hash"] == tally_study.hash(compose(["study=tally", "study.options.copies=3"]))
    )
    again = run_headlab("run", "study=tally", "study.options.copies=3", "ablate.method=mean",
                        f"hydra.run.dir={tmp_path / 'r'}", cwd=tmp_path)  # fmt: skip
    assert again.returncode == 0 and "skipped" in again.stdout  # it reads the task only
    bad = run_headlab("run", "study=tally", "study.options.copies=many", f"output.root={tmp_path}", cwd=tmp_path)
    assert bad.returncode == 2 and "study=tally" in error_line(bad) and "copies" in error_line(bad)
    listed = run_headlab("list", "study", cwd=tmp_path)
    assert "counts to copies" in listed.stdout


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


def test_options_added_later_keep_old_hashes_at_their_neutral_value():
    # circuit.ig_steps_from=1 and scores.fold_norms=false are what headlab computed before they existed
    for base, added, other in (
        (["circuit=eap_ig"], "circuit.ig_steps_from=1", "circuit.ig_steps_from=0"),
        (["scores=composition"], "scores.fold_norms=false", "scores.fold_norms=true"),
    ):
        before = config_hash(compose(base))
        assert config_hash(compose([*base, added])) == before
        assert config_hash(compose([*base, other])) != before
