"""torch's threads are chosen, not defaulted (runtime.choose_threads): an explicit threads=N, a launcher's
allotment or OMP_NUM_THREADS wins; else one thread per core this process may use that other work leaves idle."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from headlab.door import compose
from headlab.runtime import allowed_cores, busy_cores, cgroup_quota, choose_threads
from headlab.studies.context import RunContext

LAUNCHERS = ("SLURM_CPUS_PER_TASK", "SUBMITIT_LOCAL_JOB_ID", "OMP_NUM_THREADS")


@pytest.mark.parametrize(
    "use, busy",
    [
        ([0.0, 0.0], 0),
        ([10.0, 5.0], 0),  # background noise is no busy core
        ([100.0, 0.0], 1),
        ([50.0, 50.0], 1),  # one process the scheduler moves between two cores counts once
        ([30.0, 0.0], 1),  # a quarter of a core or more counts
        ([100.0, 100.0], 2),
        ([100.0, 100.0, 100.0, 90.0], 4),
    ],
)
def test_busy_cores_count_the_summed_use(use, busy):
    assert busy_cores(use) == busy


def test_an_explicit_choice_wins_in_its_order(monkeypatch):
    for name in LAUNCHERS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert (choose_threads(0).threads, choose_threads(0).source) == (3, "OMP_NUM_THREADS")
    monkeypatch.setenv("SUBMITIT_LOCAL_JOB_ID", "7")
    assert (choose_threads(0).threads, choose_threads(0).source) == (1, "submitit_local")
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "4")
    assert (choose_threads(0).threads, choose_threads(0).source) == (4, "SLURM_CPUS_PER_TASK")
    choice = choose_threads(5)
    assert (choice.threads, choice.source, choice.busy) == (5, "threads=", -1)
    assert choice.line() == f"threads: 5 (threads=; {len(allowed_cores())} cores)"


def test_a_quota_in_cpu_max_bounds_the_cores(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_quota(tmp_path / "cpu.max") == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_quota(tmp_path / "cpu.max") is None
    assert cgroup_quota(tmp_path / "missing") is None


@pytest.mark.skipif(len(allowed_cores()) < 2, reason="needs two cores to leave one busy")
def test_a_core_held_by_another_process_gets_no_thread(monkeypatch):
    for name in LAUNCHERS:
        monkeypatch.delenv(name, raising=False)
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        choice = choose_threads(0, sample_s=0.3)
    finally:
        spin.kill()
        spin.wait()
    cores = len(allowed_cores())
    assert choice.source == "idle cores" and choice.busy >= 1 and 1 <= choice.threads <= cores - 1
    assert choice.threads == max(1, cores - choice.busy)


def test_with_nothing_set_a_thread_per_idle_core_at_most(monkeypatch):
    for name in LAUNCHERS:
        monkeypatch.delenv(name, raising=False)
    choice = choose_threads(0)
    assert 1 <= choice.threads <= len(allowed_cores()) == choice.cores
    assert os.cpu_count() is None or choice.cores <= os.cpu_count()


def test_this_process_own_use_is_no_other_work():
    assert busy_cores([100.0, 100.0], mine=100.0) == 1
    assert busy_cores([100.0, 100.0], mine=200.0) == 0
    assert busy_cores([10.0, 0.0], mine=50.0) == 0  # never below none


def test_each_phase_chooses_its_threads_again_where_the_run_chose_from_idle_cores(monkeypatch):
    for name in LAUNCHERS:
        monkeypatch.delenv(name, raising=False)
    before = torch.get_num_threads()
    ctx = RunContext(compose([]), threads=choose_threads(0))
    try:
        with ctx.timed("first"), ctx.timed("first"):
            pass
        with ctx.timed("second"):
            assert torch.get_num_threads() == ctx.meta["threads_by_phase"]["second"]
    finally:
        torch.set_num_threads(before)
    assert set(ctx.meta["threads_by_phase"]) == {"first", "second"}
    assert all(1 <= n <= len(allowed_cores()) for n in ctx.meta["threads_by_phase"].values())
    explicit = RunContext(compose(["threads=1"]), threads=choose_threads(1))
    with explicit.timed("phase"):
        pass
    assert "threads_by_phase" not in explicit.meta  # threads=N is kept for the whole run
