"""Sweeps on a real SLURM cluster: scripts/slurm-local.sh brings up a one-node cluster with accounting
(munged, MariaDB, slurmdbd, slurmctld, slurmd) for these tests and stops what it started afterwards.
Skipped, with the script's reason, where no cluster can be started (not root, no apt)."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pandas as pd
import pytest

from conftest import ROOT
from test_sweeps import collected_table, start_headlab

SCRIPT = ROOT / "scripts" / "slurm-local.sh"
SLURM = ["hydra/launcher=slurm_cpu", "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=2"]
# a one-minute limit; the warning signal (USR2, on which submitit requeues or gives up) 5 s before it, which
# SLURM's 30-second scheduler tick delivers 25 to 55 s after the job starts
LIMITED = [*SLURM, "hydra.launcher.timeout_min=1", "hydra.launcher.signal_delay_s=5"]
# four trainings: 4000 steps outlast the limit, 1500 are cancelled (or requeued) mid-way, 300 and 200 finish
TRAININGS = [
    *["train.steps=4000,1500,300,200", "train.checkpoint_every=100", "train.eval_every=100"],
    *["task.n_prompts=32", "output.n_boot=20", "threads=1"],
]


@pytest.fixture(scope="module")
def cluster():
    was_up = subprocess.run([SCRIPT, "status"], capture_output=True).returncode == 0
    if not was_up:
        started = subprocess.run([SCRIPT, "up"], capture_output=True, text=True, timeout=900)
        if started.returncode != 0:
            lines = started.stderr.strip().splitlines() or ["no reason given"]
            pytest.skip(f"no SLURM cluster: {lines[-1]}")
    yield
    if not was_up:  # leave the machine as the suite found it
        subprocess.run([SCRIPT, "down"], capture_output=True, timeout=300)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """TRAININGS straight through under the basic launcher, run in the background while SLURM works."""
    root = tmp_path_factory.mktemp("uninterrupted")
    proc = start_headlab(["run", "-m", *TRAININGS, f"output.root={root}", f"hydra.sweep.dir={root / 'sweep'}"], root)

    def table() -> pd.DataFrame:
        out, err = proc.communicate(timeout=900)
        assert "4 done, 0 skipped, 0 failed" in out, err
        return collected_table(root / "sweep")

    yield table
    proc.kill()


def _slurm_job(name: str, index: int) -> str:
    """The SLURM id of job `index` of the array named `name` once it runs ("" before); a one-job array has
    no task suffix."""
    ids = subprocess.run(["squeue", "-h", "-n", name, "-t", "R", "-o", "%i"], capture_output=True, text=True).stdout
    return next((i for i in ids.split() if i.endswith(f"_{index}") or "_" not in i), "")


def _checkpointed(job_dir: Path) -> bool:
    """The job has begun training and written a checkpoint (its log names the checkpoint directory)."""
    logs = "".join(p.read_text() for p in job_dir.glob("*.log"))
    found = re.search(r"started at step 0 of \d+ in (\S+)", logs)
    return bool(found) and (Path(found.group(1)) / "state" / "state.json").is_file()


def _wait_until(condition, seconds: float, what: str) -> None:
    deadline = time.time() + seconds
    while not condition():
        assert time.time() < deadline, f"waited {seconds} s for {what}"
        time.sleep(0.5)


def test_a_failing_slurm_job_is_named_with_its_log_and_the_sweep_exits_nonzero(cluster, tmp_path):
    args = [
        *["run", "-m", *SLURM, "threads=1", "model.n_ctx=64,16", "train.steps=50", "task.n_prompts=32"],
        *["output.n_boot=10", f"output.root={tmp_path}", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
    ]
    proc = start_headlab(args, tmp_path)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode != 0
    assert "1 done, 0 skipped, 1 failed" in out, err
    failed = [ln for ln in err.splitlines() if ln.startswith("failed:")]
    assert len(failed) == 1 and "needs n_ctx >= 27" in failed[0] and ".log" in failed[0]


def test_cancelled_and_timed_out_jobs_leave_no_table_and_a_rerun_redoes_exactly_them(cluster, uninterrupted, tmp_path):
    sweep, name = tmp_path / "sweep", f"headlab-cancel-{tmp_path.name}"
    args = [*TRAININGS, f"output.root={tmp_path}", f"hydra.sweep.dir={sweep}", f"hydra.launcher.name={name}"]
    proc = start_headlab(["run", "-m", *LIMITED, "hydra.launcher.max_num_timeout=0", *args], tmp_path)
    _wait_until(lambda: _checkpointed(sweep / "1") and _slurm_job(name, 1), 300, "job 1 to checkpoint")
    subprocess.run(["scancel", _slurm_job(name, 1)], check=True)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode != 0
    assert "2 done, 0 skipped, 2 failed" in out, err
    assert "Bypassing sacct" not in err  # accounting answers: submitit polls job states as on a real cluster
    status = {d: json.loads((sweep / d / "status.json").read_text()) for d in "0123"}
    # job 0 reached its time limit: submitit's handler names it "timed-out" when its signal came in time,
    # the launcher names slurm's state TIMEOUT when slurm killed it first; either way no result, no table
    assert any(word in status["0"]["error"] for word in ("timed-out", "TIMEOUT")), status
    assert "CANCELLED" in status["1"]["error"], status
    assert all(status[d]["log"] and Path(status[d]["log"]).is_file() for d in "01")
    assert not list((sweep / "0").glob("results.*")) and not list((sweep / "1").glob("results.*"))

    # the same sweep again, with room to finish: exactly the two interrupted jobs run, from their checkpoints
    proc = start_headlab(["run", "-m", *SLURM, "hydra.launcher.timeout_min=10", *args], tmp_path)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0 and "2 done, 2 skipped, 0 failed" in out, err
    status = {d: json.loads((sweep / d / "status.json").read_text())["status"] for d in "0123"}
    assert status == {"0": "done", "1": "done", "2": "skipped", "3": "skipped"}
    jobs = subprocess.run(
        ["sacct", "-n", "-X", "-S", "now-2hours", "-o", "JobName%80,State"], capture_output=True, text=True
    ).stdout
    assert sum(name in line and "COMPLETED" in line for line in jobs.splitlines()) >= 4  # slurmdbd recorded them
    for d in "01":
        resumed = re.findall(r"resumed at step (\d+) of", "".join(p.read_text() for p in (sweep / d).glob("*.log")))
        assert resumed and int(resumed[-1]) > 0, f"job {d} trained from scratch"
    # the sweep through slurmctld, interrupted and resumed, collects the table of the basic launcher's
    pd.testing.assert_frame_equal(collected_table(sweep), uninterrupted())


def test_a_requeued_training_job_resumes_from_its_checkpoint(cluster, uninterrupted, tmp_path):
    sweep, name = tmp_path / "sweep", f"headlab-requeue-{tmp_path.name}"
    one = [a.replace("4000,1500,300,200", "1500") for a in TRAININGS]
    # two minutes: SLURM's own warning (25-55 s into a one-minute limit) could reach the resumed job after it
    # wrote its table, and its requeue would then find the run done ("skipped")
    limit = [*SLURM, "hydra.launcher.timeout_min=2", "hydra.launcher.signal_delay_s=5"]
    args = [*limit, "hydra.launcher.max_num_timeout=2", f"hydra.launcher.name={name}", *one]
    proc = start_headlab(["run", "-m", *args, f"output.root={tmp_path}", f"hydra.sweep.dir={sweep}"], tmp_path)
    _wait_until(lambda: _checkpointed(sweep / "0") and _slurm_job(name, 0), 300, "the job to checkpoint")
    # the signal SLURM sends ahead of a time limit: submitit requeues the job, SLURM starts it again
    subprocess.run(["scancel", "--signal=USR2", _slurm_job(name, 0)], check=True)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0 and "1 done, 0 skipped, 0 failed" in out, err
    submitit_logs = "".join(p.read_text() for p in (sweep / ".submitit").rglob("*_log.*"))
    assert "Requeued job" in submitit_logs
    resumed = re.findall(r"resumed at step (\d+) of", "".join(p.read_text() for p in (sweep / "0").glob("*.log")))
    assert resumed and int(resumed[-1]) > 0
    reference = uninterrupted()
    reference = reference[reference["train.steps"].astype(str) == "1500"].reset_index(drop=True)
    pd.testing.assert_frame_equal(collected_table(sweep), reference, check_dtype=False)
