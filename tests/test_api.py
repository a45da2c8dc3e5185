"""The Python API: the same tables as the CLI, the same one-line errors, nothing written by a sweep."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest

import headlab
from headlab import results

RUN_FAST = ["task.n_prompts=64", "output.n_boot=100"]


@pytest.fixture(scope="module")
def toy(demo_root):
    return (
        demo_root,
        headlab.load_model("toy-attn-1l", root=str(demo_root)),
        headlab.load_task("counting", n_prompts=64),
    )


def test_a_fresh_process_sweeps_the_same_table_headlab_run_writes(demo_root, tmp_path):
    """The demo model is trained already (demo_root): both processes load it from there."""
    script = textwrap.dedent(f"""
        import headlab
        m = headlab.load_model("toy-attn-1l", root={str(demo_root)!r})
        t = headlab.sweep(m, headlab.load_task("counting", n_prompts=64), ablate="heads", n_boot=100)
        t.to_parquet({str(tmp_path / "api.parquet")!r})
    """)

    def files() -> list[Path]:  # a load takes the checkpoint's lock file: it is no output
        return sorted(p for p in demo_root.rglob("*") if p.suffix != ".lock")

    before = files()  # other tests of this worker may have run there already
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert files() == before, "a sweep writes nothing"
    args = ["task.n_prompts=64", "output.n_boot=100", f"output.root={demo_root}", f"hydra.run.dir={tmp_path / 'run'}"]
    proc = subprocess.run([sys.executable, "-m", "headlab", "run", *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    written = pd.read_parquet(tmp_path / "run" / "results.parquet")
    swept = pd.read_parquet(tmp_path / "api.parquet")
    assert list(swept.columns) == results.LEADING and len(swept) == (1 + 4) * 4
    pd.testing.assert_frame_equal(swept, written)


def test_run_writes_a_run_dir_and_reuses_it(toy, tmp_path):
    root, _, _ = toy
    overrides = [*RUN_FAST, f"output.root={root}", f"hydra.run.dir={tmp_path / 'run'}", "ablate=layers"]
    first = headlab.run(*overrides)
    assert not first.skipped and first.run_dir == tmp_path / "run"
    assert results.is_complete(first.run_dir) and (first.run_dir / ".hydra" / "config.yaml").is_file()
    assert set(first.table["intervention"]) == {"none", "ablate_layer"}
    assert first.config.ablate.sweep.value == "layers"
    again = headlab.run(*overrides)
    assert again.skipped
    pd.testing.assert_frame_equal(again.table, first.table, check_like=True)


def test_a_run_stopped_between_its_table_and_its_figures_draws_them_when_run_again(toy, tmp_path):
    root, _, _ = toy
    overrides = [*RUN_FAST, f"output.root={root}", f"hydra.run.dir={tmp_path / 'run'}"]
    first = headlab.run(*overrides)
    drawn = sorted(p.name for p in (first.run_dir / "figures").iterdir())
    assert "numbers.json" in drawn and any(n.endswith(".png") for n in drawn)
    assert results.read_meta(first.run_dir)["figures"] == ["heads"]
    # as a SLURM time limit or a kill right after results.write leaves it: the table complete, no figures
    shutil.rmtree(first.run_dir / "figures")
    meta = results.read_meta(first.run_dir)
    del meta["figures"]
    (first.run_dir / results.META).write_text(json.dumps(meta))
    again = headlab.run(*overrides)
    assert again.skipped and sorted(p.name for p in (first.run_dir / "figures").iterdir()) == drawn
    assert results.read_meta(first.run_dir)["figures"] == ["heads"]
    pd.testing.assert_frame_equal(again.table, first.table, check_like=True)
    with pytest.raises(headlab.UsageError, match="unknown figure set 'nope'"):  # refused in one line, as before a run
        headlab.run(*overrides, "output.figures=nope")


def test_a_run_composes_its_config_once(toy, tmp_path, monkeypatch):
    from headlab import door

    root, _, _ = toy
    composed = []
    compose_raw = door.compose_raw
    monkeypatch.setattr(door, "compose_raw", lambda *a, **k: composed.append(a) or compose_raw(*a, **k))
    headlab.run(*RUN_FAST, f"output.root={root}", f"hydra.run.dir={tmp_path / 'run'}", "ablate=layers")
    assert len(composed) == 1


def test_sweep_options_reach_the_config(toy):
    _, model, task = toy
    table = headlab.sweep(model, task, ablate="none", patch="activation", n_prompts=32, n_boot=0, per_prompt=True)
    patched = table[table["intervention"] == "patch_head"]
    assert set(patched["method"]) == {"activation"} and patched["layer"].notna().all()
    assert table["ci_low"].isna().all()  # n_boot=0: no bootstrap
    assert table.loc[table["prompt_id"].notna(), "prompt_id"].max() == 31
    mean = headlab.sweep(model, task, ablate="heads", method="mean", n_boot=10)
    assert set(mean.loc[mean["intervention"] == "ablate_head", "method"]) == {"mean"}


def test_the_api_raises_the_cli_errors(toy):
    _, model, task = toy
    with pytest.raises(headlab.UsageError, match=r"^unknown task 'nope'; choose from: counting, ioi"):
        headlab.load_task("nope")
    with pytest.raises(headlab.UsageError, match=r"^unknown model 'nope'; choose from:"):
        headlab.compose("model=nope")
    with pytest.raises(headlab.UsageError, match=r"^invalid configuration"):
        headlab.sweep(model, task, method="median")
    with pytest.raises(headlab.UsageError, match=r"^invalid configuration.*no_such_option"):
        headlab.sweep(model, task, no_such_option=1)
    with pytest.raises(
        headlab.UsageError,
        match=r"^option 'steps' is ambiguous; write one of: study__steps, train__steps, sae__steps",
    ):
        headlab.sweep(model, task, steps=10)
    with pytest.raises(headlab.HeadlabError, match=r"cannot load local directory"):
        headlab.load_model("/no/such/model/dir")


def test_compose_is_typed():
    cfg = headlab.compose("model=toy-attn-2l", "task=ioi", "ablate.method=mean")
    assert type(cfg).__name__ == "Config" and type(cfg.task).__name__ == "IOIConfig"
    assert cfg.model.n_layers == 2 and cfg.ablate.method.value == "mean"


def test_a_pretrained_model_loads_by_path_and_the_task_it_is_swept_on_decides(tiny_hf_dir, demo_root):
    model = headlab.load_model(str(tiny_hf_dir("gpt2")))  # no task named: any pretrained model loads
    assert (model.n_layers, model.n_heads) == (3, 4) and model.config.kind.value == "hf"
    with pytest.raises(headlab.UsageError, match="task counting has its own 7-token vocabulary"):
        headlab.sweep(model, headlab.load_task("counting"))
    with pytest.raises(headlab.UsageError, match="task counting has its own 7-token vocabulary"):
        headlab.load_model(str(tiny_hf_dir("gpt2")), task="counting")
