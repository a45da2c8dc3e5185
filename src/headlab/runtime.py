"""Process- and device-level settings for fast sweeps: chunk budgets, the allocator, torch's threads."""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
KEEP_MAPPED_BYTES = 1 << 30
# a block holds a few activations as wide as its widest (the MLP's hidden units, the input and output of
# the stacked copies, the attention's scores) at once: a chunk's budget is this fraction of its memory
LIVE_ACTIVATIONS = 4


def chunk_budget_mb(device: torch.device, chunk_mb: float, gpu_memory_share: float) -> float:
    """How large the widest activation of one chunk of stacked interventions may be: `chunk_mb` on a
    CPU, where batches that stay in its caches run fastest; on a GPU, `gpu_memory_share` of its free
    memory now (after the clean caches), over LIVE_ACTIVATIONS, and never less than chunk_mb."""
    if device.type != "cuda":
        return chunk_mb
    free, _total = torch.cuda.mem_get_info(device)
    return gpu_chunk_mb(free / 2**20, chunk_mb, gpu_memory_share)


def gpu_chunk_mb(free_mb: float, chunk_mb: float, gpu_memory_share: float) -> float:
    """A chunk's budget on a GPU with `free_mb` free: `gpu_memory_share` of it over LIVE_ACTIVATIONS, never
    less than chunk_mb (chunk_budget_mb's, and the plan's: planning.on_device)."""
    return max(chunk_mb, gpu_memory_share * free_mb / LIVE_ACTIVATIONS)


def tune_allocator() -> bool:
    """Keep large buffers in glibc's heap instead of fresh mmaps.

    A sweep allocates and frees the same large activations (stacked copies x tokens x d_mlp) block after
    block; above glibc's mmap threshold each one is mapped and zeroed anew, and the page faults cost
    as much as the matrix products. Set by every run (studies/context.apply_runtime), from the shell or
    from Python, for the rest of the process: the heap then keeps freed buffers, which can raise a run's peak
    (the Llama-3.2-1B shape's EAP-IG: 5.2 -> 6.0 GB) as it shortens the sweeps. Returns False where the C
    library is not glibc.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, KEEP_MAPPED_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, KEEP_MAPPED_BYTES))


# a core counts as busy while other processes use at least this share of it: torch's threads wait for
# their slowest one, so a thread that shares its core slows the whole pass (20x seen on two busy cores)
BUSY_SHARE = 0.25
LOAD_SAMPLE_S = 0.1  # how long the cores' use is watched before a run (and each of its phases) picks its threads
IDLE = "idle cores"  # the source of a choice made from the cores' use, made again at each phase


@dataclass(frozen=True)
class Threads:
    """How many torch threads a run uses, and why."""

    threads: int
    cores: int  # the cores this process may run on (affinity, cgroup quota)
    busy: int  # of them, busy with other work when the run started (-1: not measured)
    source: str  # threads=N, SLURM, submitit_local, OMP_NUM_THREADS, or idle cores

    def line(self) -> str:
        seen = f", {self.busy} busy" if self.busy >= 0 else ""
        return f"threads: {self.threads} ({self.source}; {self.cores} cores{seen})"

    def as_meta(self) -> dict[str, int | str]:
        """The fields by name (meta.json's `threads`; Threads(**it) reads it back)."""
        return dataclasses.asdict(self)


def allowed_cores() -> list[int]:
    """The cores this process may run on, no more than its cgroup's CPU quota allows at once."""
    try:
        cores = sorted(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows: no affinity
        cores = list(range(os.cpu_count() or 1))
    return cores[: max(1, math.ceil(cgroup_quota() or len(cores)))]


def cgroup_quota(path: Path = Path("/sys/fs/cgroup/cpu.max")) -> float | None:
    """CPUs' worth of time the cgroup (v2) allows per period; None: no quota, or no cgroup v2."""
    try:
        quota, period = path.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def busy_cores(use: list[float], busy_share: float = BUSY_SHARE, mine: float = 0.0) -> int:
    """How many of these cores other work holds, from each one's use in percent, less `mine` (this
    process's own use, in percent of one core): the use summed, so a process that the scheduler moves
    between two cores counts once, a core counted from busy_share of it."""
    return min(len(use), max(0, math.floor((sum(use) - mine) / 100 + 1 - busy_share)))


def choose_threads(requested: int = 0, sample_s: float = LOAD_SAMPLE_S) -> Threads:
    """`requested` (> 0) wins; else what a launcher allots a job that shares the machine (SLURM's
    cpus-per-task, 1 per submitit_local job) or OMP_NUM_THREADS; else one thread per idle core this
    process may use, the cores' use watched for `sample_s` seconds (at least one thread)."""
    cores = allowed_cores()
    for threads, source in (
        (requested, "threads="),
        (_env_int("SLURM_CPUS_PER_TASK"), "SLURM_CPUS_PER_TASK"),
        (1 if os.environ.get("SUBMITIT_LOCAL_JOB_ID") else 0, "submitit_local"),
        (_env_int("OMP_NUM_THREADS"), "OMP_NUM_THREADS"),
    ):
        if threads > 0:
            return Threads(threads, len(cores), -1, source)
    own = psutil.Process()
    before = sum(own.cpu_times()[:2])
    use = psutil.cpu_percent(interval=sample_s, percpu=True)
    # this process's own threads (a phase's last spinning ones) are no other work
    mine = 100 * (sum(own.cpu_times()[:2]) - before) / sample_s
    busy = busy_cores([use[c] for c in cores if c < len(use)], mine=mine)
    return Threads(max(1, len(cores) - busy), len(cores), busy, IDLE)


def _env_int(name: str) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else 0
