"""Shared-memory regions for the co-located fast path.

When a worker and a state server run on the same node, the worker's gradient shard and
weight shard live in files under /dev/shm. A push then names (path, byte offset) instead
of streaming chunks, and the server reads the gradient straight from the mapping; a fetch
names where the server should write the weights, which the worker's weight shard already
is. gRPC still carries the call (run, step, shard): only the payload skips serialisation.

The server opens only files it may: under SHM_ROOT, named with SHM_PREFIX, no symlinks,
large enough for the request.
"""

from __future__ import annotations

import mmap
import os
import threading
from pathlib import Path

import torch

from cargohold.services.errors import InvalidTensorError

SHM_ROOT = Path("/dev/shm")
SHM_PREFIX = "cargohold-"


class SharedRegion:
    """A file in /dev/shm mapped into this process, viewed as a tensor of bytes."""

    def __init__(self, path: Path, size: int, *, create: bool) -> None:
        self.path = path
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0) | os.O_NOFOLLOW
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self.size = os.fstat(fd).st_size
            self._map = mmap.mmap(fd, self.size) if self.size else None
        finally:
            os.close(fd)
        self.owner = create
        self.bytes = (
            torch.frombuffer(self._map, dtype=torch.uint8) if self._map is not None
            else torch.empty(0, dtype=torch.uint8)
        )

    @classmethod
    def create(cls, name: str, size: int) -> SharedRegion:
        """A new region of ``size`` bytes named ``SHM_PREFIX + name``."""
        return cls(SHM_ROOT / f"{SHM_PREFIX}{name}", size, create=True)

    def tensor(self, dtype: torch.dtype, byte_offset: int, numel: int) -> torch.Tensor:
        """A view of ``numel`` elements of ``dtype`` starting at ``byte_offset``."""
        nbytes = numel * dtype.itemsize
        if byte_offset < 0 or byte_offset + nbytes > self.size or byte_offset % dtype.itemsize:
            raise InvalidTensorError(
                f"shared memory {self.path}: {numel} x {dtype} at byte {byte_offset} does not fit "
                f"its {self.size} bytes (or is misaligned)"
            )
        return self.bytes[byte_offset : byte_offset + nbytes].view(dtype)

    def close(self) -> None:
        """Unmap; the creator also removes the file."""
        self.bytes = torch.empty(0, dtype=torch.uint8)
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a tensor view still exports the buffer; the OS frees it at exit
                pass
        if self.owner:
            self.path.unlink(missing_ok=True)


class RegionCache:
    """The server side: regions opened on demand by path, validated, kept open."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._regions: dict[str, SharedRegion] = {}

    def open(self, path: str) -> SharedRegion:
        resolved = Path(path)
        if resolved.parent != SHM_ROOT or not resolved.name.startswith(SHM_PREFIX) or ".." in resolved.parts:
            raise InvalidTensorError(
                f"shared memory path {path!r} is not allowed; it must be {SHM_ROOT}/{SHM_PREFIX}*"
            )
        with self._lock:
            region = self._regions.get(path)
            if region is None:
                try:
                    region = SharedRegion(resolved, 0, create=False)
                except OSError as error:
                    raise InvalidTensorError(f"cannot open shared memory {path!r}: {error.strerror}") from error
                self._regions[path] = region
            return region

    def close(self) -> None:
        with self._lock:
            for region in self._regions.values():
                region.close()
            self._regions.clear()
