"""Page-locking host memory in place, so a GPU copies to and from it by DMA.

A worker's exchange buffers are where its reduced gradients land and its updated weights
come from. When a state server shares the node they are a sealed memfd the server maps
(services/transport/shm.py), so the server reads the gradients and writes the weights
there itself. On a GPU worker that region is registered with CUDA (``cudaHostRegister``),
which pins it where it is: the device-to-host copy of a gradient lands where the server
reads it, and the weights go back host-to-device from where the server wrote them, with
no bounce through a second, pinned buffer. One path for CPU and GPU workers; the GPU one
only adds the registration.

Where memory cannot be pinned (no CUDA, a locked-memory limit, a driver that refuses the
mapping) the buffers stay pageable: every copy still works, but synchronously, so the
caller warns once and counts it (:class:`PageLockRefused` says why).
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


class PageLockRefused(Exception):
    """Host memory that could not be page-locked; ``reason`` is one of :data:`PAGE_LOCK_REASONS`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass
class PageLock:
    """A registration of existing host memory with CUDA; :meth:`release` it before the
    memory is unmapped."""

    pointer: int
    nbytes: int
    released: bool = False

    def release(self) -> None:
        if not self.released:
            torch.cuda.cudart().cudaHostUnregister(self.pointer)
            self.released = True


def page_lock(memory: torch.Tensor) -> PageLock:
    """Register ``memory`` (contiguous host bytes) with CUDA; PageLockRefused if it cannot be."""
    _require_cuda()
    pointer, nbytes = memory.data_ptr(), memory.numel() * memory.element_size()
    cudart = torch.cuda.cudart()
    status = cudart.cudaHostRegister(pointer, nbytes, 0)  # cudaHostRegisterDefault
    if int(status) != 0:
        clear_last_cuda_error()
        raise PageLockRefused(
            "cuda_error",
            f"cudaHostRegister of {nbytes} bytes failed with CUDA error {int(status)} "
            "(a locked-memory limit, ulimit -l, is the usual cause)",
        )
    return PageLock(pointer, nbytes)


def clear_last_cuda_error() -> None:
    """Reset this thread's last CUDA runtime error after a failure we handled.

    A failed runtime call stays the thread's last error, and torch checks each kernel
    launch with ``cudaGetLastError``: the next launch would raise the refused
    registration as its own, misleading, error. torch binds no ``cudaGetLastError``, so
    it is called here on the libcudart torch loaded (found in this process's mappings:
    the same library, so the same per-thread state)."""
    path = cudart_path(Path("/proc/self/maps").read_text())
    if path is None:
        logger.warning("no libcudart is mapped in this process: the last CUDA error could not be cleared")
        return
    ctypes.CDLL(path).cudaGetLastError()


def cudart_path(maps: str) -> str | None:
    """The CUDA runtime library mapped in a process, from its ``/proc/<pid>/maps``."""
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and Path(fields[5]).name.startswith("libcudart.so"):
            return fields[5]
    return None


def pinned_empty(nbytes: int) -> torch.Tensor:
    """New page-locked host bytes; PageLockRefused where the allocator cannot pin them."""
    _require_cuda()
    try:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    except RuntimeError as error:
        raise PageLockRefused("pin_failed", f"pinned allocation of {nbytes} bytes failed: {error}") from error


def _require_cuda() -> None:
    if not torch.cuda.is_available():
        raise PageLockRefused("no_cuda", "this process has no CUDA device (or torch was built without CUDA)")
