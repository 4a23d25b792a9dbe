"""The NVMe tier: one file per partition under ``<nvme_path>/<run_id>/server-<i>/``, moved
through page-aligned staging buffers with O_DIRECT where the filesystem takes it.

Writes are crash-consistent: a partition is written to ``<file>.tmp`` and renamed over
the file, so the file always holds either the previous good state or the new one, never
a mix, and a version's inode is never changed afterwards (what lets a checkpoint hard-link
it); a failed write (disk full, I/O error) removes the temporary file and leaves the last
good one readable. O_DIRECT writes are not fsynced: the live files need to outlive the
server process, not the machine (after any failure the run restarts from its last
checkpoint and the tier folder is swept), and an fsync and a directory fsync per partition
and step cost ~2-3 ms each here, most of the NVMe tier's update time at small partitions.
A checkpoint fsyncs every file it links (:func:`.preserve.link_or_pin`) before its
manifest is written. Buffered writes are fsynced, since only clean pages can be dropped
from the page cache. Every read checks the file's size,
header and checksums (:mod:`.fileformat`) and refuses a torn or corrupted file with a
:class:`CorruptPartitionError` naming it.

O_DIRECT: ``direct_io="auto"`` probes each path at start-up (an aligned write and read
of a probe file) and falls back to buffered I/O where the filesystem refuses it (ramfs,
some overlay and network filesystems), and again at run time if an O_DIRECT request is
ever refused; ``"on"`` makes a refusal an error, ``"off"`` never asks. Buffered I/O drops
the file's pages from the page cache after each transfer, so the tier does not hold a
second copy of the state in memory behind the budget's back.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from contextlib import suppress
from dataclasses import dataclass

import torch

from cargohold.services.core.checksum import crc32c
from cargohold.services.core.durable import fsync_file, replace_atomically, replace_durably
from cargohold.services.core.errors import TierError, TierSpaceError
from cargohold.services.core.private_files import create_file, open_file, private_folders
from cargohold.services.tiers.fileformat import (
    ARRAYS,
    BLOCK,
    HEADER_BYTES,
    FileLayout,
    PartitionHeader,
    check_size,
    check_updates,
    corrupt_error,
    gradient_file_bytes,
    unpack_header,
)
from cargohold.services.tiers.folders import lock_folder, remove_folder
from cargohold.services.tiers.io_pool import AlignedBuffer, BufferPool, IoPool
from cargohold.services.tiers.planner import Bandwidth
from cargohold.services.tiers.residency import PartitionKey, Residency
from cargohold.services.tiers.source import Moments
from cargohold.services.tiers.tier import Partition, Staged, TierObserver

logger = logging.getLogger(__name__)

REQUEST_BYTES = 64 << 20
"""Largest single read or write request; a partition moves in few, large, sequential ones."""
PROBE_BYTES = 8 << 20
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
"""A write failed because the filesystem (or the user's quota) is full."""


@dataclass(slots=True)
class TierPath:
    """One configured NVMe path and what the start-up probe found."""

    root: str
    direct: bool
    device: int
    bandwidth: Bandwidth
    read_bytes: int = 0
    read_seconds: float = 0.0
    write_bytes: int = 0
    write_seconds: float = 0.0

    def measured(self) -> Bandwidth:
        """Bandwidth seen in real transfers once there are some, the probe's until then."""
        read = self.read_bytes / self.read_seconds if self.read_bytes >= PROBE_BYTES and self.read_seconds else 0.0
        write = self.write_bytes / self.write_seconds if self.write_bytes >= PROBE_BYTES and self.write_seconds else 0.0
        return Bandwidth(read or self.bandwidth.read_bytes_per_s, write or self.bandwidth.write_bytes_per_s)

    def read_into(self, path: str, view: memoryview) -> int:
        """Read ``path`` (a file under this root) into ``view``; where O_DIRECT is refused
        at run time, from then on buffered. Returns the bytes read."""
        try:
            return read_file_into(path, view, self.direct)
        except OSError as error:
            if not self.refused_direct(error):
                raise
            return read_file_into(path, view, False)

    def write_whole(self, path: str, view: memoryview) -> None:
        """Write ``view`` as the whole of ``path`` (no rename: scratch files), falling back
        to buffered I/O as :meth:`read_into` does."""
        try:
            write_file(path, view, self.direct)
        except OSError as error:
            if not self.refused_direct(error):
                raise
            write_file(path, view, False)

    def refused_direct(self, error: OSError) -> bool:
        """Whether ``error`` is an O_DIRECT refusal; if so, this path is buffered from now on."""
        if not (self.direct and error.errno == errno.EINVAL):
            return False
        logger.warning("%s refused an O_DIRECT request (%s); using buffered I/O there", self.root, error.strerror)
        self.direct = False
        return True


NVME_KEY = "state_server.tier.nvme_paths"
"""The config key naming the tier's paths, in its errors."""


def probe_path(root: str, direct_io: str, probe_bytes: int = PROBE_BYTES, *, key: str = NVME_KEY) -> TierPath:
    """Create ``root`` if needed, check it takes an aligned write and read (O_DIRECT unless
    ``direct_io`` is "off"), and measure both. Raises TierError naming the path and the
    config ``key`` that set it."""
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as error:
        raise TierError(f"{key}: cannot create {root}: {error.strerror}") from error
    usage = shutil.disk_usage(root)
    if usage.total:  # ramfs and the like report no capacity at all
        probe_bytes = max(BLOCK, min(probe_bytes, usage.free // 4) // BLOCK * BLOCK)  # never fill the disk
    buffer = AlignedBuffer(probe_bytes)
    buffer.tensor.fill_(0x5A)
    probe = os.path.join(root, f".cargohold-probe-{os.getpid()}-{threading.get_ident()}")
    direct = direct_io != "off"
    try:
        while True:
            try:
                started = time.perf_counter()
                write_file(probe, buffer.view, direct)
                fsync_file(probe, drop_cache=not direct)
                written = time.perf_counter() - started
                started = time.perf_counter()
                got = read_file_into(probe, buffer.view, direct)
                read = time.perf_counter() - started
                break
            except OSError as error:
                if direct and error.errno == errno.EINVAL:
                    if direct_io == "on":
                        raise TierError(
                            f"{key}: {root} refuses O_DIRECT ({error.strerror}); set "
                            f"tuning.{key.rpartition('.')[0]}.direct_io to auto or off"
                        ) from error
                    logger.info("%s refuses O_DIRECT; using buffered I/O there", root)
                    direct = False
                    continue
                kind = TierSpaceError if error.errno in SPACE_ERRNOS else TierError
                raise kind(f"{key}: cannot write and read {root}: {error.strerror}") from error
        if got != probe_bytes:
            raise TierError(f"{key}: {root} returned {got} of {probe_bytes} probe bytes")
    except BaseException:
        with suppress(OSError):  # on a read-only disk this fails too; the first error is the one to report
            unlink_if_present(probe)
        raise
    finally:
        buffer.close()
    unlink_if_present(probe)
    return TierPath(
        root=root,
        direct=direct,
        device=os.stat(root).st_dev,
        bandwidth=Bandwidth(probe_bytes / max(read, 1e-9), probe_bytes / max(written, 1e-9)),
    )


def _buffer_of(staged: Staged) -> AlignedBuffer:
    """The buffer holding ``staged`` in its file layout (``staged.handle``)."""
    assert isinstance(staged.handle, AlignedBuffer), "a partition staged without its buffer"
    return staged.handle


class NvmeTier:
    """Partition files on one or several paths, moved through a shared buffer pool."""

    residency = Residency.NVME
    keeps_files = True
    capacity_bytes: int | None = None

    def __init__(
        self, paths: Sequence[TierPath], *, server_index: int, io: IoPool, buffers: BufferPool, observer: TierObserver
    ) -> None:
        self.paths = list(paths)
        self.server_index = server_index
        self._io = io
        self._buffers = buffers
        self._observer = observer
        self._runs: dict[str, list[int]] = {}
        """Runs this tier holds files of, with the descriptors of their folders' locks."""
        self._lock = threading.Lock()

    # --- files ------------------------------------------------------------------------
    def directory(self, run_id: str, path_index: int) -> str:
        return os.path.join(self.paths[path_index].root, run_id, f"server-{self.server_index}")

    def file_of(self, key: PartitionKey, path_index: int) -> str:
        return os.path.join(
            self.directory(key.run_id, path_index), f"shard-{key.segment_id:06d}.part-{key.index:05d}.bin"
        )

    def prepare_run(self, run_id: str) -> None:
        """Create the run's directories; refuse a run id that cannot name one."""
        if not _RUN_ID.fullmatch(run_id):
            raise TierError(
                f"run id {run_id!r} cannot name a directory under state_server.tier.nvme_paths; "
                "use up to 128 letters, digits, '.', '_' or '-'"
            )
        with self._lock:
            if run_id in self._runs:
                return
            locks: list[int] = []
            try:
                for path in self.paths:
                    folder = private_folders(path.root, run_id, f"server-{self.server_index}", key=NVME_KEY)
                    locks.append(lock_folder(folder))
            except BaseException:
                for fd in locks:
                    os.close(fd)
                raise
            self._runs[run_id] = locks

    def check_room(self, parts: Sequence[Partition], gradient_itemsize: int, what: str) -> None:
        """Refuse, before anything is written, when new partitions' files and their staged
        gradients' beside them, plus room for a full set of writes in flight, exceed a
        filesystem's free space."""
        need: dict[int, int] = {}
        root_of: dict[int, str] = {}
        for part in parts:
            device = self.paths[part.path_index].device
            nbytes = part.layout.file_bytes + gradient_file_bytes(part.span.numel, gradient_itemsize)
            need[device] = need.get(device, 0) + nbytes
            root_of.setdefault(device, self.paths[part.path_index].root)
        for device, nbytes in need.items():
            usage = shutil.disk_usage(root_of[device])
            if usage.total == 0:
                continue  # a filesystem without a stated capacity (ramfs): nothing to check against
            nbytes += self._buffers.count * self._buffers.nbytes
            check_free_space(root_of[device], nbytes, usage.free, what)

    @property
    def memory_bytes(self) -> int:
        return self._buffers.allocated_bytes  # the staging buffers allocated so far

    def prepare(self, run_id: str, parts: Sequence[Partition], path_index: Mapping[PartitionKey, int]) -> None:
        """Create the run's folders and name each partition's file on its planned path
        (every partition has one, since any may move here later)."""
        self.prepare_run(run_id)
        for part in parts:
            part.path_index = path_index[part.key]
            part.path = self.file_of(part.key, part.path_index)

    def reserve(self, partition: Partition) -> bool:
        return True  # the space was checked (check_room) before anything is written

    def buffer(self, partition: Partition) -> AlignedBuffer:
        raise TierError(f"{partition.key} is kept in a file, not a buffer")

    def close(self) -> None:
        """Delete this server's partition files of every run it held."""
        with self._lock:
            runs, self._runs = dict(self._runs), {}
        for run_id, locks in runs.items():
            for index, fd in enumerate(locks):
                try:
                    remove_folder(self.directory(run_id, index))
                finally:
                    os.close(fd)  # only once the folder it guarded is gone

    # --- Tier ----------------------------------------------------------------------
    def stage(self, partition: Partition, *, block: bool) -> Staged | None:
        got = self._buffers.acquire((partition.key, partition.updates), block=block)
        if got is None:
            return None
        buffer, warm = got
        arrays = buffer.arrays(partition.layout)
        if warm:
            return Staged(partition, arrays, warm=True, handle=buffer)
        updates = partition.updates
        ready = self._io.submit(lambda: self._read(partition, buffer, updates, master_only=False))
        return Staged(partition, arrays, ready=ready, handle=buffer)

    def commit(self, staged: Staged, update: int) -> Future[None]:
        return self._write_async(staged.partition, _buffer_of(staged), update, release=True)

    def discard(self, staged: Staged, *, intact: bool) -> None:
        try:
            staged.ready.result()
        except Exception:
            intact = False
        self._buffers.release(_buffer_of(staged), (staged.partition.key, staged.partition.updates) if intact else None)

    def drop(self, partition: Partition) -> None:
        self._buffers.forget(partition.key)
        unlink_if_present(partition.path)

    # --- moves in and out of the tier ---------------------------------------------------
    def load(self, partition: Partition, master: torch.Tensor, moments: Moments | None = None) -> Future[None]:
        """Write a new partition file at ``partition.updates``: ``master`` and the moments
        (zero unless given, as when restoring a checkpoint; fp32 ones encoded into the
        partition's stored form)."""
        buffer, _ = self._buffers.acquire(None, block=True)
        layout = partition.layout
        buffer.tensor[: layout.file_bytes].zero_()
        try:
            buffer.arrays(layout).load_(master, moments)
        except BaseException:
            self._buffers.release(buffer)
            raise
        return self._write_async(partition, buffer, partition.updates, release=True)

    def receive(self, partition: Partition, staged: Staged, updates: int) -> Future[None] | None:
        """Write a partition staged elsewhere (a RAM partition's own buffer) as its file
        after ``updates`` updates (a demotion)."""
        return self._write_async(partition, _buffer_of(staged), updates, release=False)

    def read_master_into(self, partition: Partition, out: torch.Tensor) -> None:
        """Copy (and cast) the stored master weights into ``out``; a warm buffer saves the read."""
        buffer, warm = self._buffers.acquire((partition.key, partition.updates), block=True)
        intact = warm
        try:
            if not warm:
                updates = partition.updates
                self._io.submit(lambda: self._read(partition, buffer, updates, master_only=True)).result()
            out.copy_(buffer.arrays(partition.layout).master)
        finally:
            self._buffers.release(buffer, (partition.key, partition.updates) if intact else None)

    # --- I/O jobs (run on the I/O pool) -------------------------------------------------
    def _write_async(self, partition: Partition, buffer: AlignedBuffer, updates: int, *, release: bool) -> Future[None]:
        def job() -> None:
            ok = False
            try:
                self._write(partition, buffer, updates)
                ok = True
            finally:
                if release:
                    self._buffers.release(buffer, (partition.key, updates) if ok else None)

        return self._io.submit(job)

    def _write(self, partition: Partition, buffer: AlignedBuffer, updates: int) -> None:
        layout = partition.layout
        target = partition.path
        tier_path = self.paths[partition.path_index]
        started = time.perf_counter()
        try:
            try:
                write_partition_file(
                    target,
                    buffer,
                    partition.key,
                    layout,
                    updates,
                    direct=tier_path.direct,
                    durable=not tier_path.direct,  # a checkpoint fsyncs what it links
                )
            except OSError as error:
                if not tier_path.refused_direct(error):
                    raise
                write_partition_file(target, buffer, partition.key, layout, updates, direct=False)
        except OSError as error:
            kind = TierSpaceError if error.errno in SPACE_ERRNOS else TierError
            raise kind(
                f"writing partition file {target} ({partition.key}) after update {updates} failed: "
                f"{error.strerror}; the last good file is kept"
                + (f"; free space or add paths to {NVME_KEY}" if kind is TierSpaceError else "")
            ) from error
        seconds = time.perf_counter() - started
        tier_path.write_bytes += layout.file_bytes
        tier_path.write_seconds += seconds
        self._observer.record_tier_io("write", layout.file_bytes, seconds)

    def _read(self, partition: Partition, buffer: AlignedBuffer, updates: int, *, master_only: bool) -> None:
        layout = partition.layout
        path = partition.path
        arrays = 1 if master_only else len(ARRAYS)
        nbytes = layout.offset(1) if master_only else layout.file_bytes
        tier_path = self.paths[partition.path_index]
        started = time.perf_counter()
        try:
            check_size(os.stat(path).st_size, path=path, key=partition.key, numel=layout.numel, dtype=layout.dtype)
            got = tier_path.read_into(path, buffer.view[:nbytes])
        except FileNotFoundError as error:
            raise corrupt_error(path, partition.key, "the file is missing") from error
        except OSError as error:
            raise TierError(f"reading partition file {path} ({partition.key}) failed: {error.strerror}") from error
        if got != nbytes:
            raise corrupt_error(path, partition.key, f"read {got} of {nbytes} bytes (truncated)")
        header = unpack_header(buffer.view, path=path, key=partition.key, numel=layout.numel, dtype=layout.dtype)
        check_updates(header, updates, path=path)
        for index in range(arrays):
            start = layout.offset(index)
            if crc32c(buffer.view[start : start + layout.region_bytes_of(index)]) != header.checksums[index]:
                raise corrupt_error(path, partition.key, f"{ARRAYS[index]} checksum mismatch")
        seconds = time.perf_counter() - started
        tier_path.read_bytes += nbytes
        tier_path.read_seconds += seconds
        self._observer.record_tier_io("read", nbytes, seconds)


def check_free_space(root: str, need: int, free: int, what: str) -> None:
    """Raise TierSpaceError when ``need`` bytes do not fit in ``free``; pure, for the tests."""
    if need > free:
        raise TierSpaceError(
            f"state_server.tier.nvme_paths: {root} has {free} bytes free but {what} needs {need} bytes "
            "there (partition files plus room for the writes in flight); free space, add paths to "
            "state_server.tier.nvme_paths or raise state_server.tier.ram_budget_bytes"
        )


def write_partition_file(
    target: str,
    buffer: AlignedBuffer,
    key: PartitionKey,
    layout: FileLayout,
    updates: int,
    *,
    direct: bool,
    durable: bool = True,
) -> PartitionHeader:
    """Write a partition held in ``buffer`` (its file layout; the header block is filled
    here) as its file after ``updates`` updates at ``target`` with
    :func:`~cargohold.services.core.durable.replace_durably`, or without its fsyncs unless
    ``durable`` (:func:`~cargohold.services.core.durable.replace_atomically`). Every version is
    a new file renamed into place and none is ever changed in place, which is what lets a
    checkpoint hard-link one. Raises the OSError, leaving no temporary file and ``target``
    as it was."""
    master, exp_avg, exp_avg_sq = (
        crc32c(buffer.view[layout.offset(i) : layout.offset(i) + layout.region_bytes_of(i)]) for i in range(len(ARRAYS))
    )
    checksums = (master, exp_avg, exp_avg_sq)
    header = PartitionHeader(key=key, numel=layout.numel, updates=updates, checksums=checksums, dtype=layout.dtype)
    buffer.view[:HEADER_BYTES] = header.pack()
    replace = replace_durably(target, drop_cache=not direct) if durable else replace_atomically(target)
    with replace as temporary:
        write_file(temporary, buffer.view[: layout.file_bytes], direct)
    return header


def write_file(path: str, view: memoryview, direct: bool) -> None:
    """Write ``view`` as the whole of a new file (the caller makes it durable)."""
    fd = create_file(path, os.O_DIRECT if direct else 0)
    try:
        offset = 0
        while offset < len(view):
            written = os.pwritev(fd, [view[offset : offset + REQUEST_BYTES]], offset)
            if written <= 0:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            offset += written
    finally:
        os.close(fd)


def read_file_into(path: str, view: memoryview, direct: bool) -> int:
    fd = open_file(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        offset = 0
        while offset < len(view):
            got = os.preadv(fd, [view[offset : offset + REQUEST_BYTES]], offset)
            if got == 0:
                break
            offset += got
        if not direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return offset
    finally:
        os.close(fd)


def unlink_if_present(path: str) -> None:
    """Remove ``path`` if it exists ("" names nothing)."""
    if not path:
        return
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
