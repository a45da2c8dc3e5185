"""Sweeps on a real SLURM cluster: scripts/slurm-local.sh brings up a one-node cluster with accounting
(munged, MariaDB, slurmdbd, slurmctld, slurmd) for these tests and stops what it started afterwards.
Skipped, with the script's reason, where no cluster can be started (not root, no apt)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pandas as pd
import pytest

from conftest import ROOT
from test_sweeps import collected_table, start_headlab

SCRIPT = ROOT / "scripts" / "slurm-local.sh"
SLURM = ["hydra/launcher=slurm_cpu", "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=2"]


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


def _sweep(demo_root: Path, sweep: Path, *extra: str) -> list[str]:
    return [
        "run",
        "-m",
        *extra,
        "ablate.method=zero,mean",
        "seed=0,1",
        "task.n_prompts=32",
        "output.n_boot=20",
        "threads=1",
        f"output.root={demo_root}",
        f"hydra.sweep.dir={sweep}",
    ]


def test_a_sweep_through_slurmctld_collects_the_table_the_basic_launcher_gives(cluster, demo_root, tmp_path):
    out, err = start_headlab(_sweep(demo_root, tmp_path / "slurm", *SLURM), tmp_path).communicate(timeout=600)
    assert "4 done, 0 skipped, 0 failed" in out, err
    assert "Bypassing sacct" not in err  # accounting answers: submitit polls job states as on a real cluster
    jobs = subprocess.run(["sacct", "-n", "-X", "-o", "JobID,State"], capture_output=True, text=True).stdout
    assert jobs.count("COMPLETED") >= 4  # slurmdbd recorded the jobs
    out, err = start_headlab(_sweep(demo_root, tmp_path / "basic"), tmp_path).communicate(timeout=600)
    assert "4 done, 0 skipped, 0 failed" in out, err
    slurm, basic = collected_table(tmp_path / "slurm"), collected_table(tmp_path / "basic")
    assert len(slurm) == len(basic) > 0
    pd.testing.assert_frame_equal(slurm, basic)


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
