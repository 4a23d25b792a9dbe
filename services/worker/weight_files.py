"""A worker's weights on NVMe: one file per unit holding the worker's range of that unit
(its chunks at their chunk places, padding included) in the compute dtype, under
``<worker.weights_nvme_path>/<run_id>/worker-<rank>/``.

The files are a cache of what the state servers hold, not state of their own: they are
written at registration, after every update and after a restore (the servers' weights
fetched), so a file is scratch like a staged gradient's ``.grad`` file: written whole
(no rename, no fsync), its CRC-32C kept in memory and checked on every read, and a crash
loses nothing that the servers or a checkpoint do not hold. A file found truncated,
corrupted or missing is a :class:`CorruptPartitionError` naming it.

The I/O is the NVMe tier's: page-aligned staging buffers, O_DIRECT where the path takes it
(probed at start-up, with the same fallback to buffered I/O at run time), and the folder
claimed with the tier folders' ``.lock`` for the worker's life.
"""

from __future__ import annotations

import os
import shutil
import threading
from typing import Protocol

import torch

from cargohold.services.core.checksum import crc32c
from cargohold.services.core.errors import ConfigError, TierError, TierSpaceError
from cargohold.services.core.private_files import private_folders
from cargohold.services.tiers.fileformat import BLOCK, corrupt_error, round_up
from cargohold.services.tiers.folders import lock_folder, remove_folder
from cargohold.services.tiers.io_pool import AlignedBuffer, BufferPool
from cargohold.services.tiers.nvme import SPACE_ERRNOS, TierPath, probe_path

WEIGHTS_KEY = "worker.weights_nvme_path"
READ_BUFFERS = 2
"""Aligned buffers of the largest file that reads and writes go through: one read while
another unit's update is written."""


def check_weights_root(root: str, direct_io: str = "auto") -> None:
    """Before any worker starts, on the machine they will run on: ``root`` takes a write
    and a read of a probe file, as each worker's start-up checks its folder
    (:func:`probe_path`: ``root`` made if missing). A file, a read-only filesystem, or one
    that holds no files (``/proc``) is a ConfigError naming the key and the reason."""
    try:
        probe_path(root, direct_io, BLOCK, key=WEIGHTS_KEY)
    except TierError as error:
        raise ConfigError(str(error)) from error


class WeightObserver(Protocol):
    """Where the weight files and window report (the worker's metrics)."""

    def record_weight_io(self, op: str, nbytes: int) -> None: ...

    def add_weight_wait(self, seconds: float) -> None: ...


class NullWeightObserver:
    def record_weight_io(self, op: str, nbytes: int) -> None:
        pass

    def add_weight_wait(self, seconds: float) -> None:
        pass


class WeightFiles:
    """The unit files of one worker, moved through ``buffer_count`` aligned buffers of the
    largest file each."""

    def __init__(
        self,
        root: str,
        run_id: str,
        rank: int,
        *,
        largest_bytes: int,
        total_bytes: int,
        buffer_count: int = READ_BUFFERS,
        direct_io: str = "auto",
        observer: WeightObserver | None = None,
    ) -> None:
        """``total_bytes``: what all the unit files will take; refused with a
        :class:`TierSpaceError` now when the filesystem has less free."""
        self.folder = private_folders(root, run_id, f"worker-{rank}", key=WEIGHTS_KEY)
        self._lock_fd = lock_folder(self.folder)
        try:
            self._path: TierPath = probe_path(self.folder, direct_io, key=WEIGHTS_KEY)
        except BaseException:
            os.close(self._lock_fd)
            raise
        usage = shutil.disk_usage(self.folder)
        if usage.total and round_up(total_bytes) > usage.free:  # ramfs and the like state no capacity
            os.close(self._lock_fd)
            raise TierSpaceError(
                f"{WEIGHTS_KEY}: {self.folder} has {usage.free} bytes free but this worker's weight files need "
                f"{round_up(total_bytes)}; free space there or point {WEIGHTS_KEY} at a larger drive"
            )
        self.buffers = BufferPool(buffer_count, round_up(max(largest_bytes, 1)))
        self._crcs: dict[int, tuple[int, int]] = {}
        """Unit -> (bytes, CRC-32C) of its file as last written."""
        self._lock = threading.Lock()
        self.observer = observer or NullWeightObserver()

    def file_of(self, unit: int) -> str:
        return os.path.join(self.folder, f"unit-{unit:05d}.weights")

    def write(self, unit: int, data: torch.Tensor) -> None:
        """Write ``data`` (a contiguous tensor: the unit's range) as the unit's file."""
        nbytes = data.numel() * data.element_size()
        buffer, _ = self.buffers.acquire(None, block=True)
        try:
            buffer.tensor[:nbytes].copy_(data.reshape(-1).view(torch.uint8))
            padded = round_up(nbytes, BLOCK)
            buffer.tensor[nbytes:padded].zero_()
            crc = crc32c(buffer.view[:padded])
            path = self.file_of(unit)
            try:
                self._path.write_whole(path, buffer.view[:padded])
            except OSError as error:
                kind = TierSpaceError if error.errno in SPACE_ERRNOS else TierError
                raise kind(f"{WEIGHTS_KEY}: writing the weights file {path} failed: {error.strerror}") from error
            with self._lock:
                self._crcs[unit] = (padded, crc)
            self.observer.record_weight_io("write", padded)
        finally:
            self.buffers.release(buffer)

    def read(self, unit: int) -> AlignedBuffer:
        """The unit's file in a staging buffer, checked; give it back with :meth:`done`."""
        path = self.file_of(unit)
        with self._lock:
            expected = self._crcs.get(unit)
        if expected is None:
            raise TierError(f"the weights file {path} was never written (unit {unit} is not registered)")
        nbytes, crc = expected
        buffer, _ = self.buffers.acquire(None, block=True)
        try:
            try:
                got = self._path.read_into(path, buffer.view[:nbytes])
            except FileNotFoundError as error:
                raise corrupt_error(path, None, "the weights file is missing") from error
            except OSError as error:
                raise TierError(f"{WEIGHTS_KEY}: reading the weights file {path} failed: {error.strerror}") from error
            if got != nbytes:
                raise corrupt_error(path, None, f"read {got} of {nbytes} bytes (truncated)")
            if crc32c(buffer.view[:nbytes]) != crc:
                raise corrupt_error(path, None, "checksum mismatch (changed on disk since it was written)")
            self.observer.record_weight_io("read", nbytes)
            return buffer
        except BaseException:
            self.buffers.release(buffer)
            raise

    def done(self, buffer: AlignedBuffer) -> None:
        self.buffers.release(buffer)

    def close(self) -> None:
        """Delete the files and the folder, then give up its lock."""
        try:
            remove_folder(self.folder)
        finally:
            os.close(self._lock_fd)
