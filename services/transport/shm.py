"""Shared memory for the co-located fast path.

When a worker and a state server run on the same node, the worker's exchange buffers live
in a *sealed memfd*: anonymous memory (``memfd_create``) that can no longer shrink or grow
once made. A push then names (path, byte offset) instead of streaming chunks, and the
server reads the gradient straight from the mapping; a fetch names where the server writes
the weights. gRPC still carries the call (run, step, shard): only the payload skips
serialisation.

The path is ``/proc/<worker pid>/fd/<fd>``. The server opens it and accepts only a memfd
named for the call's run (``cargohold-<run id>-...``), owned by the server's own user and
sealed against shrinking and growing. So a client cannot:

* crash the server: a mapped file that shrinks makes its readers fault (SIGBUS); a
  sealed memfd cannot shrink;
* point it at other memory: not another run's buffers, another user's, nor any file;
* leave memory behind: a memfd has no name on a filesystem, and its memory goes with the
  last process that holds it (the server forgets a region when its worker is gone).

Regions are cached by inode, not by path: a path that comes to name another file is
opened and checked afresh.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import re
import stat
import threading

import torch

from cargohold.services.errors import InvalidTensorError

MEMFD_PREFIX = "cargohold-"
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
"""What a region must be sealed against: any change of its size."""
_PROC_FD = re.compile(r"/proc/(\d+)/fd/(\d+)")


def available() -> bool:
    """Whether this host has sealed memfds (Linux)."""
    return hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS")


class SharedRegion:
    """A sealed memfd mapped into this process, viewed as a tensor of bytes."""

    def __init__(self, fd: int, path: str, *, owner: bool) -> None:
        self.path = path
        """What another process opens: ``/proc/<pid>/fd/<fd>`` of the creator."""
        self.size = os.fstat(fd).st_size
        self._map = mmap.mmap(fd, self.size) if self.size else None
        self._fd = fd if owner else None
        if not owner:
            os.close(fd)  # the mapping keeps the memory
        self.owner = owner
        self.bytes = (
            torch.frombuffer(self._map, dtype=torch.uint8)
            if self._map is not None
            else torch.empty(0, dtype=torch.uint8)
        )

    @classmethod
    def create(cls, name: str, size: int) -> SharedRegion:
        """A new region of ``size`` bytes named ``MEMFD_PREFIX + name`` (``name`` starts
        with the run id), sealed at that size."""
        fd = os.memfd_create(f"{MEMFD_PREFIX}{name}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS | fcntl.F_SEAL_SEAL)
            return cls(fd, f"/proc/{os.getpid()}/fd/{fd}", owner=True)
        except BaseException:
            os.close(fd)
            raise

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
        """Unmap (and, for the creator, close the memfd: the memory goes once no one maps it)."""
        self.bytes = torch.empty(0, dtype=torch.uint8)
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a tensor view still exports the buffer; the OS frees it at exit
                pass
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class RegionCache:
    """The server side: regions opened on demand, checked, kept while their creator lives."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._regions: dict[tuple[int, int], tuple[int, SharedRegion]] = {}
        """(st_dev, st_ino) -> (creator's pid, region)."""

    def open(self, path: str, run_id: str) -> SharedRegion:
        """The region ``path`` names, if it is a sealed memfd of run ``run_id`` owned by
        this user; InvalidTensorError otherwise."""
        match = _PROC_FD.fullmatch(path)
        if match is None:
            raise InvalidTensorError(
                f"shared memory path {path!r} is not allowed; it must be /proc/<pid>/fd/<fd> of a worker's sealed memfd"
            )
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as error:
            raise InvalidTensorError(f"cannot open shared memory {path!r}: {error.strerror}") from error
        try:
            key = self._check(fd, path, run_id)
        except BaseException:
            os.close(fd)
            raise
        with self._lock:
            self._forget_dead()
            cached = self._regions.get(key)
            if cached is not None:
                os.close(fd)
                return cached[1]
            region = SharedRegion(fd, path, owner=False)
            self._regions[key] = (int(match.group(1)), region)
            return region

    @staticmethod
    def _check(fd: int, path: str, run_id: str) -> tuple[int, int]:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            raise InvalidTensorError(f"shared memory {path!r} is not a memfd of this server's user")
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            seals = 0  # not a memfd
        if seals & SEALS != SEALS:
            raise InvalidTensorError(f"shared memory {path!r} is not a memfd sealed against resizing")
        name = os.readlink(f"/proc/self/fd/{fd}")  # what was opened, whatever the path names now
        if not name.startswith(f"/memfd:{MEMFD_PREFIX}{run_id}-"):
            raise InvalidTensorError(f"shared memory {path!r} ({name}) does not belong to run {run_id!r}")
        return info.st_dev, info.st_ino

    def _forget_dead(self) -> None:
        """Unmap the regions of workers that are gone: their memory is freed then."""
        for key, (pid, region) in list(self._regions.items()):
            if not os.path.exists(f"/proc/{pid}"):
                region.close()
                del self._regions[key]

    def close(self) -> None:
        with self._lock:
            for _, region in self._regions.values():
                region.close()
            self._regions.clear()
