"""How a worker's process gets host memory for the buffers a step frees and allocates again.

On a CPU (and for a GPU worker's host copies) every unit's gathered weights, its gradients
and its activations are fresh tensors each step, most of them above glibc's mmap
threshold (128 KiB, raised as large blocks are freed, up to 32 MiB): each is mapped,
faulted in page by page, and unmapped again when freed, and what the heap frees at its top
goes back to the kernel (trimmed) to be faulted in again by the next step. On the demo
model that is ~0.2 CPU-s of system time per worker and step, a sixth of the step's CPU
(`docs/benchmarks.md`, against DeepSpeed). :func:`retain_freed_memory` tells glibc's
allocator to serve buffers up to ``RETAINED_BYTES`` from the heap and never to trim it, so
a step reuses the pages the previous one freed. The price is resident memory: the heap
stays at the step's high-water mark (plus fragmentation) instead of shrinking between
steps. Other C libraries (no ``mallopt``) are left as they are.
"""

from __future__ import annotations

import ctypes
import logging

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameters (malloc.h)."""
RETAINED_BYTES = 1 << 30
"""Buffers up to this size come from the heap (``mallopt`` takes an int: at most 2 GiB)."""


def retain_freed_memory() -> bool:
    """Keep freed host memory in this process's heap for reuse (glibc); returns whether the
    allocator took the setting."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        logger.info("no mallopt in this C library: freed host memory is returned as usual")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, RETAINED_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, RETAINED_BYTES))
