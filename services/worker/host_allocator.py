"""Which C allocator a worker's process runs: the environment that selects it, and a check
of what the process really loaded.

On a CPU (and for a GPU worker's host copies) every unit's gathered weights, its gradients
and its activations are fresh tensors each step, most of them megabytes. glibc's malloc
maps each such buffer and unmaps it when freed, so the kernel zeroes and faults the same
bytes in again every step (1 CPU-s of system time a worker and step on a 100M-parameter
model, even on huge pages); making it keep them instead (a higher mmap threshold, no
trimming) left a heap at its high-water mark of every size a step frees (2.4 against 1.1
GiB a worker). mimalloc (Microsoft's allocator, the ``cmeel-mimalloc`` wheel) reuses freed
blocks by size class across its segments, and with ``MIMALLOC_PURGE_DELAY=-1`` never hands
them back: a step reuses what the last one freed, in 1.3 GiB a worker (docs/benchmarks.md).
``LD_PRELOAD`` puts it under torch, gloo and gRPC alike; it must be set before the process
starts, hence an environment for the worker actors rather than a call in them. ``cargohold
plan`` counts what it keeps (a share of the step's buffers, measured); a run with one host
budget keeps glibc unless told otherwise (:func:`resolve_allocator`), the least memory.
"""

from __future__ import annotations

import logging
import os
from importlib import metadata
from pathlib import Path
from typing import Literal

from cargohold.cluster.schema.run import ClusterConfig
from cargohold.cluster.schema.worker import HostAllocatorSetting, WorkerConfig
from cargohold.services.core.errors import ConfigError

logger = logging.getLogger(__name__)

HostAllocator = Literal["mimalloc", "glibc"]

MIMALLOC_DISTRIBUTION = "cmeel-mimalloc"
MIMALLOC_LIBRARY = "cmeel.prefix/lib/libmimalloc.so"

MIMALLOC_ENV = {"MIMALLOC_PURGE_DELAY": "-1"}
"""Freed memory stays with the process for the next step (the default, 10 ms, returns it to
the kernel between units, to be faulted in again: 0.6-1.0 CPU-s a worker and step at 100M)."""

GLIBC_ENV = {"MALLOC_MMAP_THRESHOLD_": "4194304", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
"""glibc with the least resident memory: glibc raises its mmap threshold each time a large
block is freed, so FSDP2's unit buffers would end up in the heap, which is not given back;
a fixed 4 MiB threshold keeps them mapped and returned after each unit (2.98 against 7.34
bytes of RSS per parameter in ``benchmarks/capacity.py``), and ``glibc.malloc.hugetlb=1``
(glibc 2.35 on) asks for transparent huge pages on those mappings, so each is faulted in 2
MiB at a time (system time 2.8 -> 1.05 CPU-s a worker and step at 100M)."""


def mimalloc_library() -> Path:
    """The installed ``libmimalloc.so``."""
    try:
        distribution = metadata.distribution(MIMALLOC_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        raise ConfigError(
            f"tuning.worker.host_allocator 'mimalloc' needs the {MIMALLOC_DISTRIBUTION} package, which is not "
            "installed (it is one of cargohold's dependencies on Linux); or set tuning.worker.host_allocator: glibc"
        ) from None
    library = Path(str(distribution.locate_file(MIMALLOC_LIBRARY)))
    if not library.is_file():
        raise ConfigError(f"tuning.worker.host_allocator 'mimalloc': {library} is missing from {MIMALLOC_DISTRIBUTION}")
    return library


def resolve_allocator(setting: HostAllocatorSetting, host_budget_bytes: int | None) -> HostAllocator:
    """ "auto": mimalloc, unless the run has one host budget (``cluster.host_memory_bytes``):
    there host memory is what is short, and glibc leaves the least of it."""
    if setting != "auto":
        return setting
    return "glibc" if host_budget_bytes is not None else "mimalloc"


def worker_allocator(worker: WorkerConfig, cluster: ClusterConfig) -> HostAllocator:
    """The allocator the workers run (``tuning.worker.host_allocator`` resolved against
    ``cluster.host_memory_bytes``)."""
    return resolve_allocator(worker.host_allocator, cluster.host_memory_bytes)


def allocator_env(allocator: HostAllocator) -> dict[str, str]:
    """The environment a process must start with to run ``allocator``."""
    if allocator == "mimalloc":
        return {"LD_PRELOAD": str(mimalloc_library()), **MIMALLOC_ENV}
    return dict(GLIBC_ENV)


def loaded_allocator(maps: Path = Path("/proc/self/maps")) -> HostAllocator:
    """The allocator this process runs (``maps``: a process's memory map)."""
    try:
        text = maps.read_text()
    except OSError:
        return "glibc"
    return "mimalloc" if "libmimalloc" in text else "glibc"


def check_loaded_allocator(allocator: HostAllocator) -> None:
    """Warn where this process does not run the configured allocator (a node without the
    library at the driver's path: the loader ignores the preload)."""
    loaded = loaded_allocator()
    if loaded != allocator:
        logger.warning("tuning.worker.host_allocator is %r but this process runs %r", allocator, loaded)


def worker_env(allocator: HostAllocator) -> dict[str, str]:
    """The worker actors' environment: what runs ``allocator``
    (:func:`allocator_env`), except where this process's
    environment sets a variable."""
    return {name: os.environ.get(name, value) for name, value in allocator_env(allocator).items()}
