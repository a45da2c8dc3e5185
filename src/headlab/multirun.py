"""Sweeps: per-job status files and the end-of-sweep summary (runtime.choose_threads caps side-by-side jobs).

Each job writes <job dir>/status.json (done | skipped | failed, with the last error line and the log
path) from a Hydra callback that runs where the job runs (this process, a submitit subprocess or a
SLURM node), so the summary is read from the sweep dir alone, whatever launcher ran it.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

STATUS = "status.json"
# sinfo asks slurmctld; a controller that is down makes it retry for its MessageTimeout (10 s by default)
# and more, so a sweep that cannot be submitted is refused after this long
CLUSTER_TIMEOUT_S = 5.0
_last_sweep_dir: Path | None = None


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


def check_cluster(launcher: str, cluster: str) -> None:
    """The sweep's scheduler answers (`cluster`: "slurm" for a SLURM launcher, "" for one that runs here),
    else one line naming the launcher and what failed, before a job is submitted or a dir made."""
    from .errors import UsageError

    if cluster != "slurm":
        return
    where = f"hydra/launcher={launcher}: the SLURM controller cannot be reached"
    try:
        probe = subprocess.run(
            ["sinfo", "--noheader", "--format=%P"], capture_output=True, text=True, timeout=CLUSTER_TIMEOUT_S
        )
    except FileNotFoundError:
        raise UsageError(f"{where}: sinfo is not on PATH (no SLURM client here)") from None
    except subprocess.TimeoutExpired:
        raise UsageError(f"{where}: sinfo did not answer within {CLUSTER_TIMEOUT_S:g} s") from None
    except OSError as e:
        raise UsageError(f"{where}: sinfo cannot run ({e.strerror or e})") from None
    if probe.returncode != 0:
        said = (probe.stderr.strip().splitlines() or [f"exit code {probe.returncode}"])[-1]
        raise UsageError(f"{where}: sinfo failed: {said[:100]}")


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
