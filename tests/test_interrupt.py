"""Ctrl-C and a scheduler's SIGTERM stop a running sweep with one line, exit 128 + the signal, nothing written."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

# the installed console script, as a user runs it: `python -m headlab` would skip its entry point
HEADLAB = Path(sys.executable).parent / "headlab"
# a few training steps, prompts that build quickly, and 16 heads to sweep: seconds of sweeping past the
# moment the test signals, on two cores or twenty
LONG_RUN = [
    "model.n_heads=16",
    "model.d_head=4",
    "train.steps=5",
    "train.eval_every=5",
    "train.eval_prompts=64",
    "task.n_prompts=4000",
    "output.n_boot=10",
]


def _start(args: list[str], cwd: Path) -> tuple[subprocess.Popen, Path]:
    stderr = cwd / "stderr.txt"
    # files, not pipes: Hydra's log lines would fill a pipe nobody reads while the test waits
    with (cwd / "stdout.txt").open("w") as out, stderr.open("w") as err:
        # as a terminal starts it: an ignored SIGINT is inherited, and a pytest worker that has run other
        # tests may ignore it (headlab keeps an ignored SIGINT ignored, as `headlab ... &` in a script needs)
        proc = subprocess.Popen(
            [str(HEADLAB), *args],
            cwd=cwd,
            stdout=out,
            stderr=err,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    return proc, stderr


def _wait_for(proc: subprocess.Popen, stderr: Path, ready: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 60
    while not ready():
        assert proc.poll() is None, f"ended (exit {proc.returncode}) before {what}: {stderr.read_text()}"
        assert time.monotonic() < deadline, f"no {what} within 60 s"
        time.sleep(0.1)


def _interrupt(proc: subprocess.Popen, signum: int) -> float:
    sent = time.monotonic()
    proc.send_signal(signum)
    proc.wait(timeout=30)
    return time.monotonic() - sent


def _sweeping(root: Path) -> Callable[[], bool]:
    """The multirun job's log names the sweep's chunks once the sweep itself has begun."""
    return lambda: any("sweep: clean caches" in log.read_text() for log in root.glob("multirun/*/*/0/*.log"))


def _trained(root: Path) -> Callable[[], bool]:
    """A single run logs nothing off a terminal: its model's checkpoint is the sign that it reached the
    sweep's side of the run (loading, building the task, sweeping)."""
    return lambda: any(root.glob("checkpoints/*/model.safetensors"))


@pytest.mark.parametrize(
    "multirun,signum,line",
    [
        (False, signal.SIGINT, "aborted: interrupted (SIGINT)"),
        (True, signal.SIGTERM, "aborted: terminated (SIGTERM)"),
    ],
    ids=["run-SIGINT", "multirun-SIGTERM"],
)
def test_a_signal_ends_a_running_sweep_with_one_line_and_its_exit_code(tmp_path, multirun, signum, line):
    args = ["run", *(["-m", "seed=0,1"] if multirun else []), *LONG_RUN, f"output.root={tmp_path}"]
    proc, stderr = _start(args, tmp_path)
    try:
        _wait_for(proc, stderr, (_sweeping if multirun else _trained)(tmp_path), "a running sweep")
        if not multirun:
            time.sleep(0.5)  # into the model's loading and the sweep, past the checkpoint's last write
        took = _interrupt(proc, signum)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signum, stderr.read_text()
    assert stderr.read_text() == line + "\n"
    assert took < 10, f"took {took:.1f} s to stop"
    assert not list(tmp_path.rglob("results.parquet")) and not list(tmp_path.rglob("meta.json"))
    assert not list(tmp_path.rglob("status.json")), "an interrupted job is neither done nor failed"
