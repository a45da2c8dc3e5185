"""Process- and device-level settings for fast sweeps."""

from __future__ import annotations

import ctypes
import ctypes.util

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
    return max(chunk_mb, gpu_memory_share * free / 2**20 / LIVE_ACTIVATIONS)


def tune_allocator() -> bool:
    """Keep large buffers in glibc's heap instead of fresh mmaps.

    A sweep allocates and frees the same large activations (stacked copies x tokens x d_mlp) block after
    block; above glibc's mmap threshold each one is mapped and zeroed anew, and the page faults cost
    as much as the matrix products. Returns False where the C library is not glibc.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, KEEP_MAPPED_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, KEEP_MAPPED_BYTES))
