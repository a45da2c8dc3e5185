"""The command line: bad input gives one line and its exit code; runs write complete run dirs."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from conftest import error_line, run_headlab
from headlab import results

FAST = ["train.steps=300", "train.eval_every=150", "task.n_prompts=64", "output.n_boot=100"]


# the command itself, in this process (a multirun in a subprocess); other test modules import these
headlab = run_headlab
_error_line = error_line


@pytest.mark.parametrize(
    "args,needle",
    [
        (["model=nope"], "unknown model 'nope'; choose from: gemma3-270m, gpt2, gpt2-ioi, hf,"),
        (["task=nope"], "unknown task 'nope'; choose from: counting"),
        (
            ["ablate=everything"],
            "unknown ablate 'everything'; choose from: circuits, components, heads, keep_heads, layers, none,",
        ),
        (["ablate.method=median"], "invalid configuration"),
        (["model.n_layerz=3"], "n_layerz"),
        (["seed=abc"], "invalid configuration"),
        (["ablate.method=zero,median", "-m"], "median"),
        (["model=toy-attn-1l,nope", "-m"], "unknown model 'nope'"),
    ],
)
def test_bad_overrides_exit_2_with_one_line(args, needle, tmp_path):
    proc = headlab("run", *args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert needle in _error_line(proc)
    assert not (tmp_path / "outputs").exists()


def test_unloadable_model_and_unknown_group_fail_cleanly(tmp_path):
    proc = headlab("run", "model=hf", f"model.path={tmp_path / 'missing'}", f"output.root={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 1
    assert "cannot load local directory" in _error_line(proc) or "cannot load hub model" in _error_line(proc)
    assert not list(tmp_path.rglob("results.parquet"))
    proc = headlab("list", "nope", cwd=tmp_path)
    assert proc.returncode == 2 and "unknown group 'nope'" in _error_line(proc)


def test_corrupt_checkpoint_fails_with_one_line(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{ not json")
    proc = headlab("run", f"model.path={tmp_path / 'ckpt'}", f"output.root={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 1 and "corrupt checkpoint config" in _error_line(proc)


def test_help_and_list(tmp_path):
    for command in ([], ["run"], ["train"], ["list"], ["collect"]):
        proc = headlab(*command, "--help", cwd=tmp_path)
        assert proc.returncode == 0 and "Usage" in proc.stdout
    proc = headlab("list", "model", cwd=tmp_path)
    assert proc.returncode == 0 and "toy-attn-1l" in proc.stdout and "base_model" not in proc.stdout


def test_run_trains_sweeps_writes_then_reuses_the_checkpoint(tmp_path):
    proc = headlab("run", *FAST, f"output.root={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "ablate_head" in proc.stdout and "label_acc" in proc.stdout
    run_dir = next(tmp_path.glob("runs/*/*"))
    assert results.is_complete(run_dir) and (run_dir / ".hydra" / "config.yaml").is_file()
    df = pd.read_parquet(run_dir / "results.parquet")
    assert list(df.columns) == results.LEADING
    assert len(df) == (1 + 4) * 4  # clean + 4 heads, 4 metrics
    meta = json.loads((run_dir / "meta.json").read_text())
    assert {"load_model", "build_task", "sweep", "tidy"} <= set(meta["seconds"])
    assert meta["packages"]["torch"].startswith("2.") and len(meta["config_hash"]) == 12
    assert meta["threads"]["threads"] >= 1 and f"threads: {meta['threads']['threads']} (" in proc.stdout
    checkpoints = list(tmp_path.glob("checkpoints/*/model.safetensors"))
    assert len(checkpoints) == 1
    stamp = checkpoints[0].stat().st_mtime_ns
    proc = headlab(
        "run",
        *FAST,
        "task.n_prompts=32",
        "ablate=layers",
        "ablate.method=mean",
        f"output.root={tmp_path}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert checkpoints[0].stat().st_mtime_ns == stamp  # same model config: reused, not retrained


def test_multirun_one_dir_per_job_and_collect(demo_root, tmp_path):
    sweep = tmp_path / "sweep"
    args = ["task.n_prompts=64", "output.n_boot=100", f"output.root={demo_root}", f"hydra.sweep.dir={sweep}"]
    proc = headlab("run", "-m", "ablate.method=zero,mean", *args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "2 done, 0 skipped, 0 failed" in proc.stdout
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1"]
    proc = headlab("collect", str(sweep), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    merged = pd.read_parquet(sweep / "collected.parquet")
    assert set(merged["ablate.method"]) == {"zero", "mean"}
    assert set(merged.loc[merged["intervention"] == "ablate_head", "method"]) == {"zero", "mean"}
    assert list(merged.columns[:15]) == results.LEADING


def test_train_command_writes_the_training_curve(tmp_path):
    proc = headlab("train", "train.steps=100", "train.eval_every=50", f"output.root={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    df = pd.read_parquet(next(tmp_path.glob("runs/*/*/results.parquet")))
    assert sorted(df["step"].unique()) == [50, 100] and "label_acc" in set(df["metric"])
