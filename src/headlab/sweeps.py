"""Sweeps: per-job status files, thread caps for side-by-side jobs, and the end-of-sweep summary.

Each job writes <job dir>/status.json (done | skipped | failed, with the last error line and the log
path) from a Hydra callback that runs where the job runs (this process, a submitit subprocess or a
SLURM node), so the summary is read from the sweep dir alone, whatever launcher ran it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

STATUS = "status.json"
_last_sweep_dir: Path | None = None


def job_threads() -> int:
    """Threads for a job that shares the machine: SLURM's allocation, 1 under submitit_local, else 0."""
    if os.environ.get("SLURM_CPUS_PER_TASK"):
        return int(os.environ["SLURM_CPUS_PER_TASK"])
    return 1 if os.environ.get("SUBMITIT_LOCAL_JOB_ID") else 0


class SweepStatus(Callback):
    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        global _last_sweep_dir
        _last_sweep_dir = Path(config.hydra.sweep.dir).resolve()

    def on_job_end(self, config: Any, job_return: Any, **kwargs: Any) -> None:
        from hydra.core.utils import JobStatus

        from .io import atomic_write_bytes

        run_dir = Path(config.hydra.runtime.output_dir)
        if job_return.status == JobStatus.COMPLETED:
            status = {"status": job_return._return_value or "done"}
        else:
            error = job_return._return_value
            line = (str(error).strip().splitlines() or [type(error).__name__])[-1]
            status = {"status": "failed", "error": f"{type(error).__name__}: {line}"}
        logs = sorted(run_dir.glob("*.log"))
        status["log"] = str(logs[0]) if logs else None
        status["overrides"] = list(job_return.overrides or [])
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(run_dir / STATUS, json.dumps(status).encode())


def last_sweep_dir() -> Path | None:
    return _last_sweep_dir


def summarize(sweep_dir: Path) -> dict[str, list[dict]]:
    """Jobs of a sweep dir by status; a job dir without status.json (killed, lost) counts as failed."""
    out: dict[str, list[dict]] = {"done": [], "skipped": [], "failed": []}
    jobs = sorted((p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    for job in jobs:
        path = job / STATUS
        status = json.loads(path.read_text()) if path.is_file() else {"status": "failed", "error": "no status: killed?"}
        status["dir"] = str(job)
        out.setdefault(status["status"], []).append(status)
    return out
