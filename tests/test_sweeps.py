"""Sweeps: a killed submitit_local sweep resumes to the same table; failures are summarised."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

SWEEP = [
    "run",
    "-m",
    "hydra/launcher=local",
    "train.steps=150,500,150",
    "train.eval_every=150",
    "task.n_prompts=64",
    "output.n_boot=50",
]


def start_headlab(args, cwd, **kw):
    return subprocess.Popen(
        [sys.executable, "-m", "headlab", *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
        **kw,
    )


def collected_table(sweep: Path) -> pd.DataFrame:
    from headlab.results import collect

    df = collect(sweep).drop(columns=["run_dir", "output.root"])
    return df.sort_values(list(df.columns[:10])).reset_index(drop=True)


def test_killed_sweep_resumes_skipping_finished_jobs_and_matches_an_uninterrupted_one(tmp_path):
    sweep = tmp_path / "sweep"
    args = [*SWEEP, f"output.root={tmp_path}", f"hydra.sweep.dir={sweep}"]
    proc = start_headlab(args, tmp_path, start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and not (
        (sweep / "0" / "meta.json").is_file() and (sweep / "2" / "meta.json").is_file()
    ):
        time.sleep(0.5)
    assert not (sweep / "1" / "meta.json").is_file(), "job 2 finished before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not list((sweep / "1").glob("results.*"))  # no half-written table

    proc = start_headlab(args, tmp_path)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr
    assert "1 done, 2 skipped, 0 failed" in stdout
    status = {d: json.loads((sweep / d / "status.json").read_text())["status"] for d in "012"}
    assert status == {"0": "skipped", "1": "done", "2": "skipped"}

    # the killed job's rows equal those of the same job run alone, uninterrupted, in a fresh root
    clean, alone = tmp_path / "clean", [a.replace("150,500,150", "500") for a in SWEEP]
    proc = start_headlab([*alone, f"output.root={tmp_path / 'fresh'}", f"hydra.sweep.dir={clean}"], tmp_path)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr
    whole = collected_table(sweep)
    resumed = whole[whole["train.steps"].astype(str) == "500"].reset_index(drop=True)
    assert len(resumed) and len(resumed) * 3 == len(whole)
    pd.testing.assert_frame_equal(resumed, collected_table(clean), check_dtype=False)


def test_failed_job_is_summarised_and_the_sweep_exits_nonzero(tmp_path):
    args = [
        "run",
        "-m",
        "model.n_ctx=64,16",
        "train.steps=50",
        "task.n_prompts=32",
        "output.n_boot=10",
        f"output.root={tmp_path}",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    ]
    stdout, stderr = start_headlab(args, tmp_path).communicate(timeout=600)
    assert "1 done, 0 skipped, 1 failed" in stdout
    failed = [ln for ln in stderr.splitlines() if ln.startswith("failed:")]
    assert len(failed) == 1 and "sweep/1" in failed[0] and "needs n_ctx >= 27" in failed[0] and ".log" in failed[0]


def test_jobs_that_need_the_same_model_train_it_once(tmp_path):
    """submitit_local starts both jobs at once; the one holding the checkpoint's lock trains, the other
    waits and reuses the model it wrote."""
    sweep = tmp_path / "sweep"
    args = ["run", "-m", "hydra/launcher=local", "ablate.method=zero,mean", "train.steps=200", "task.n_prompts=32"]
    args += ["output.n_boot=10", f"output.root={tmp_path}", f"hydra.sweep.dir={sweep}"]
    stdout, stderr = start_headlab(args, tmp_path).communicate(timeout=600)
    assert "2 done, 0 skipped, 0 failed" in stdout, stderr
    logs = "".join(p.read_text() for p in sweep.glob("*/*.log"))
    assert logs.count("started at step 0 of 200") == 1 and logs.count("reused the trained model") == 1, logs
    assert len(list((tmp_path / "checkpoints").glob("*/model.safetensors"))) == 1
