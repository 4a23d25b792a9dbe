"""Shared memory for the co-located fast path.

When a worker and a state server run on the same node, the worker's exchange buffers live
in a *sealed memfd*: anonymous memory (``memfd_create``) that can no longer shrink or grow
once made. A push then names (path, byte offset) instead of streaming chunks, and the
server reads the gradient straight from the mapping; a fetch names where the server writes
the weights. gRPC still carries the call (run, update, segment): only the payload skips
serialisation.

The path is ``/proc/<worker pid>/fd/<fd>``. The server opens it and accepts only a memfd
named for the call's run (``cargohold-<run id>:...``: a run id has no ``:``, so run
``run-a`` never matches ``run-a-2``'s buffers), owned by the server's own user, sealed
against shrinking and growing and not against writing, of ordinary pages (not hugetlb),
and within :class:`MappingLimits`. So a client cannot:

* crash the server: a mapped file that shrinks makes its readers fault (SIGBUS); a
  sealed memfd cannot shrink;
* point it at other memory: not another run's buffers, another user's, nor any file;
* fill the server's address space or its count of mappings: a buffer, a client's
  buffers and all of them together are bounded (:class:`MappingLimits`);
* leave memory behind: a memfd has no name on a filesystem, and its memory goes with the
  last process that holds it; the server unmaps a region within a second of its worker
  closing it or exiting (a thread looks), not at the next call.

A memfd the server cannot use (write-sealed, hugetlb, one the kernel refuses to map) is
refused with InvalidTensorError (INVALID_ARGUMENT), as any other bad reference.

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
from dataclasses import dataclass

import torch

from cargohold.services.core.errors import ConfigError, InvalidTensorError, ServerBusyError

MEMFD_PREFIX = "cargohold-"
RUN_END = ":"
"""Ends the run id in a region's name; run ids have none (cluster/schema/train.py RUN_ID)."""
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
"""What a region must be sealed against: any change of its size."""
F_SEAL_FUTURE_WRITE = 0x10
"""Linux's seal against new writable mappings (not in Python's fcntl before 3.12)."""
WRITE_SEALS = fcntl.F_SEAL_WRITE | F_SEAL_FUTURE_WRITE
"""Seals that forbid the server's writable mapping: a region must have neither."""
WATCH_INTERVAL_S = 1.0
"""How often the server looks whether the workers still hold the regions it maps."""
_PROC_FD = re.compile(r"/proc/(\d+)/fd/(\d+)")


def region_name(run_id: str, label: str) -> str:
    """The name :meth:`SharedRegion.create` takes for a region of run ``run_id``."""
    return f"{run_id}{RUN_END}{label}"


@dataclass(frozen=True, slots=True, kw_only=True)
class MappingLimits:
    """What the workers' shared memory may take of a state server's address space.

    A worker maps one region (its exchange buffers), sized by its own slice of the whole
    model, which a server does not know: so the bounds come from the host, whose RAM
    must hold every byte of a legitimate region (a memfd's pages are RAM once written).
    A region, or a client's regions, beyond them is refused before it is mapped."""

    region_bytes: int
    """Largest region (INVALID_ARGUMENT beyond it)."""
    client_bytes: int
    """All the regions one client process has mapped (RESOURCE_EXHAUSTED beyond it)."""
    total_bytes: int
    """All the regions mapped at once (RESOURCE_EXHAUSTED beyond it)."""
    client_regions: int = 8
    """Regions one client process has mapped; a worker needs one."""
    total_regions: int = 1024
    """Regions mapped at once (each is one of the kernel's vm.max_map_count mappings)."""

    def __post_init__(self) -> None:
        for name in ("region_bytes", "client_bytes", "total_bytes", "client_regions", "total_regions"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"mapping limit {name} must be positive, got {getattr(self, name)!r}")

    @classmethod
    def for_host(cls) -> MappingLimits:
        """Half the host's RAM for a region and for a client, the RAM in all."""
        ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return cls(region_bytes=ram // 2, client_bytes=ram // 2, total_bytes=ram)


def available() -> bool:
    """Whether this host has sealed memfds (Linux)."""
    return hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS")


class SharedRegion:
    """A sealed memfd mapped into this process, viewed as a tensor of bytes."""

    def __init__(self, fd: int, path: str, *, owner: bool) -> None:
        """Map ``fd`` (the region keeps it when ``owner``, else closes it once mapped; the
        caller closes it if this raises)."""
        self.path = path
        """What another process opens: ``/proc/<pid>/fd/<fd>`` of the creator."""
        self.size = os.fstat(fd).st_size
        try:
            self._map = mmap.mmap(fd, self.size) if self.size else None
        except OSError as error:  # hugetlb pages none are reserved for, a seal, a limit
            raise InvalidTensorError(f"shared memory {path!r} cannot be mapped: {error.strerror}") from error
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
        """A new region of ``size`` bytes named ``MEMFD_PREFIX + name`` (``name`` from
        :func:`region_name`), sealed at that size."""
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


def check_sealed_memfd(fd: int, path: str, who: str) -> tuple[os.stat_result, int]:
    """The status and seals of ``fd`` (opened from ``path``), refused unless it is a memfd
    of this process's user sealed against resizing: what a state server asks of a worker's
    exchange buffers and a worker of a peer's collectives region (``who``: this process,
    for the message)."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
        raise InvalidTensorError(f"shared memory {path!r} is not a memfd of this {who}'s user")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0  # not a memfd
    if seals & SEALS != SEALS:
        raise InvalidTensorError(f"shared memory {path!r} is not a memfd sealed against resizing")
    return info, seals


class RegionCache:
    """The server side: regions opened on demand, checked, kept while their creator holds
    them (a thread looks every ``WATCH_INTERVAL_S``), within ``limits``."""

    def __init__(self, limits: MappingLimits | None = None) -> None:
        self.limits = limits or MappingLimits.for_host()
        self._lock = threading.Lock()
        self._regions: dict[tuple[int, int], tuple[int, SharedRegion]] = {}
        """(st_dev, st_ino) -> (creator's pid, region)."""
        self._closing = threading.Event()
        self._watcher: threading.Thread | None = None

    @property
    def mapped(self) -> int:
        """Regions mapped now."""
        with self._lock:
            return len(self._regions)

    def open(self, path: str, run_id: str) -> SharedRegion:
        """The region ``path`` names, if it is a sealed memfd of run ``run_id`` owned by
        this user and within the limits; InvalidTensorError (ServerBusyError past a
        client's or the server's bound) otherwise."""
        match = _PROC_FD.fullmatch(path)
        if match is None:
            raise InvalidTensorError(
                f"shared memory path {path!r} is not allowed; it must be /proc/<pid>/fd/<fd> of a worker's sealed memfd"
            )
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as error:
            raise InvalidTensorError(f"cannot open shared memory {path!r}: {error.strerror}") from error
        pid = int(match.group(1))
        try:
            key, size = self._check(fd, path, run_id)
            with self._lock:
                # A hit is the very file mapped: the mapping keeps its inode from reuse.
                cached = self._regions.get(key)
                if cached is not None:
                    return cached[1]
                self._forget_released()  # before counting what a new region would add
                self._admit(pid, size, path)
                region = SharedRegion(fd, path, owner=False)
                fd = -1  # closed by the region once mapped
                self._regions[key] = (pid, region)
                self._watch()
                return region
        finally:
            if fd >= 0:
                os.close(fd)

    def _check(self, fd: int, path: str, run_id: str) -> tuple[tuple[int, int], int]:
        """(key, size) of a region the server may map."""
        info, seals = check_sealed_memfd(fd, path, "server")
        if seals & WRITE_SEALS:
            raise InvalidTensorError(f"shared memory {path!r} is sealed against writing; the server writes weights")
        if info.st_blksize != mmap.PAGESIZE:
            raise InvalidTensorError(
                f"shared memory {path!r} has {info.st_blksize}-byte pages (hugetlb); only ordinary memfds are mapped"
            )
        name = os.readlink(f"/proc/self/fd/{fd}")  # what was opened, whatever the path names now
        if not name.startswith(f"/memfd:{MEMFD_PREFIX}{run_id}{RUN_END}"):
            raise InvalidTensorError(f"shared memory {path!r} ({name}) does not belong to run {run_id!r}")
        if info.st_size > self.limits.region_bytes:
            raise InvalidTensorError(
                f"shared memory {path!r} has {info.st_size} bytes; a region may have at most "
                f"{self.limits.region_bytes} (half this host's RAM)"
            )
        return (info.st_dev, info.st_ino), info.st_size

    def _admit(self, pid: int, size: int, path: str) -> None:
        """Refuse a region that would take a client, or the server, past its bound."""
        mine = [region.size for owner, region in self._regions.values() if owner == pid]
        every = [region.size for _, region in self._regions.values()]
        limits = self.limits
        for what, count, nbytes, max_count, max_bytes in (
            (f"process {pid}", len(mine), sum(mine), limits.client_regions, limits.client_bytes),
            ("this state server", len(every), sum(every), limits.total_regions, limits.total_bytes),
        ):
            if count + 1 > max_count or nbytes + size > max_bytes:
                raise ServerBusyError(
                    f"shared memory {path!r} ({size} bytes) refused: {what} already maps {count} regions "
                    f"of {nbytes} bytes, at most {max_count} and {max_bytes} bytes"
                )

    def _forget_released(self) -> None:
        """Unmap the regions whose workers no longer hold them (closed or exited): their
        memory is freed then."""
        for key, (_, region) in list(self._regions.items()):
            try:
                info = os.stat(region.path)
                held = (info.st_dev, info.st_ino) == key
            except OSError:
                held = False
            if not held:
                region.close()
                del self._regions[key]

    def _watch(self) -> None:
        """Start the thread that unmaps released regions between calls (once)."""
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch_loop, name="state-server-shm-watch", daemon=True)
            self._watcher.start()

    def _watch_loop(self) -> None:
        while not self._closing.wait(WATCH_INTERVAL_S):
            with self._lock:
                self._forget_released()

    def close(self) -> None:
        self._closing.set()
        if self._watcher is not None:
            self._watcher.join()
        with self._lock:
            for _, region in self._regions.values():
                region.close()
            self._regions.clear()
