"""hydra-submitit-launcher's launchers, except that a sweep waits for every job and records how each ended.

Upstream collects results in job order and raises at the first job that ended without one (cancelled
with scancel, killed at its time limit, its node lost): the sweep command then returns while later
jobs still run, and the summary counts those as failed. Here every job is awaited first; one that ended
without a result gets a status.json naming its scheduler state and log, so the summary names it and a
rerun of the same command redoes exactly it (finished jobs are skipped by their config hash).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from unittest import mock

from hydra.core.utils import JobReturn, JobStatus
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import (
    LocalLauncher as SubmititLocalLauncher,
)
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import (
    SlurmLauncher as SubmititSlurmLauncher,
)

from headlab.io import atomic_write_bytes
from headlab.multirun import STATUS


class JobEndedWithoutResult(RuntimeError):
    pass


def outcome(job: Any, job_dir: Path) -> JobReturn:
    """The job's JobReturn; a job that left none fails with its scheduler state in its status.json."""
    try:
        return job.results()[0]
    except Exception as error:  # submitit raises several kinds for "no result"
        logs = sorted(job_dir.glob("*.log"))
        log = str(logs[0]) if logs else str(job.paths.stderr)
        message = f"ended without a result, scheduler state {job.state} (job {job.job_id})"
        if job_dir.is_dir() and not (job_dir / STATUS).is_file():
            status = {"status": "failed", "error": message, "log": log}
            atomic_write_bytes(job_dir / STATUS, json.dumps(status).encode())
        reason = JobEndedWithoutResult(f"{message}; log: {log}")
        reason.__cause__ = error
        failed = JobReturn(status=JobStatus.FAILED)
        failed.return_value = reason
        return failed


class WaitForEveryJob:
    """Mixin over a submitit launcher: submit as upstream does, then await every job."""

    config: Any

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        import submitit

        submitted: list[Any] = []
        map_array = submitit.AutoExecutor.map_array

        def keeping_jobs(executor: Any, *args: Any) -> list[Any]:
            jobs = map_array(executor, *args)
            submitted.extend(jobs)
            return jobs

        # upstream's launch submits and then collects; only the collection differs here
        with mock.patch.object(submitit.AutoExecutor, "map_array", keeping_jobs):
            try:
                return super().launch(job_overrides, initial_job_idx)  # type: ignore[misc]
            except Exception:  # some job left no result; the others are awaited below
                if not submitted:
                    raise
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        return [outcome(job, sweep_dir / str(initial_job_idx + i)) for i, job in enumerate(submitted)]


class SlurmLauncher(WaitForEveryJob, SubmititSlurmLauncher):
    pass


class LocalLauncher(WaitForEveryJob, SubmititLocalLauncher):
    pass
