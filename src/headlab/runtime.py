"""Process-level settings for fast CPU sweeps."""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
KEEP_MAPPED_BYTES = 1 << 30


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
