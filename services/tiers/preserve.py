"""Putting a partition's file into another directory (a checkpoint's) without copying
what is already on disk, and without holding training up for what is not.

A partition file on the NVMe tier is immutable: every new version is written to a
temporary name and renamed over the old one (:func:`.nvme.write_partition_file`), so the
inode a name points to at a given step never changes afterwards. A hard link to it
therefore keeps that step's state for as long as the link exists, whatever the tier does
next, and costs no bytes and no time (the tier writes its live files without fsync: the
checkpoint's writer fsyncs the linked ones in the background, before the manifest).
Where a link is refused (another filesystem, EXDEV; a filesystem without hard links; too
many links) the file is copied instead, from
a descriptor opened before training goes on, so the copy can run in the background and
still read exactly the version that was current: ``os.copy_file_range`` lets the kernel
copy (or reflink, where the filesystem shares extents) without passing the bytes through
this process, with a plain read/write loop as the fallback.

Before a file is linked or copied its header is read and checked (partition, size,
step), so a checkpoint never records a file that is not the state it claims to be.

A partition resident in RAM changes in place at its next update, so it must be written
out first; :class:`PendingWrite` does that in the background too, and the update of that
partition waits on its ``done`` event (set however the write ends). Training stalls only
if it reaches a partition before its write did. Without a RAM budget (no NVMe tier) the
partition is copied at once instead and the copy written in the background: training
never waits for the disk, at the price of the copy's memory.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from cargohold.services.core.durable import replace_durably
from cargohold.services.core.private_files import create_file, open_file
from cargohold.services.tiers.fileformat import (
    HEADER_BYTES,
    FileLayout,
    PartitionHeader,
    check_size,
    check_updates,
    corrupt_error,
    unpack_header,
)
from cargohold.services.tiers.io_pool import AlignedBuffer
from cargohold.services.tiers.nvme import unlink_if_present, write_partition_file
from cargohold.services.tiers.residency import PartitionKey, Residency
from cargohold.services.tiers.tier import Partition, Tier

LINK_REFUSED = frozenset({errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP})
"""errnos of ``link`` that mean "not here", answered by copying."""
_COPY_CHUNK = 64 << 20
_KERNEL_COPY_REFUSED = frozenset(
    {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF}
)


@dataclass(slots=True)
class PendingCopy:
    """A file to copy later from ``source_fd``, a descriptor of the version to keep."""

    source_fd: int
    source: str
    target: str
    nbytes: int

    def run(self) -> None:
        """Copy to ``target`` durably (the caller fsyncs the directory once for all
        files). Closes the source; raises the OSError naming ``target``, leaving no
        temporary file."""
        try:
            with replace_durably(self.target, sync_directory=False) as temporary:
                out = create_file(temporary)
                try:
                    _copy_range(self.source_fd, out, self.nbytes)
                finally:
                    os.close(out)
        except OSError as error:
            raise OSError(error.errno, error.strerror, self.target) from error
        finally:
            self.cancel()

    def cancel(self) -> None:
        """Give up the copy and close the source (idempotent)."""
        if self.source_fd >= 0:
            os.close(self.source_fd)
            self.source_fd = -1


@dataclass(slots=True)
class PendingWrite:
    """A RAM-resident partition to write as a partition file: in place before its next
    update, or from a copy (:meth:`.storage.TieredStorage.preserve` says which)."""

    buffer: AlignedBuffer
    key: PartitionKey
    layout: FileLayout
    updates: int
    target: str
    done: threading.Event
    """Set once the write has ended, well or not: the next update of a partition written
    in place waits on it."""

    def run(self) -> PartitionHeader:
        """Write (buffered, crash-consistently) and return the header written; raises
        the OSError naming the file."""
        try:
            return write_partition_file(self.target, self.buffer, self.key, self.layout, self.updates, direct=False)
        except OSError as error:
            raise OSError(error.errno, error.strerror, self.target) from error
        finally:
            self.done.set()

    def cancel(self) -> None:
        """Give up the write; the partition may be updated again (idempotent)."""
        self.done.set()


def link_or_pin(
    source: str, target: str, *, key: PartitionKey, layout: FileLayout, updates: int
) -> tuple[PartitionHeader, PendingCopy | None]:
    """Hard-link the file of ``key`` after ``updates`` updates to ``target``, or, where the filesystem
    refuses, return a :class:`PendingCopy` holding the version open. Raises
    CorruptPartitionError when the file is not that partition after that many updates, and the
    OSError of any other failure."""
    fd = open_file(source)
    try:
        header = _check(fd, source, key, layout, updates)
        try:
            os.link(source, target)
        except OSError as error:
            if error.errno not in LINK_REFUSED:
                raise
            copy, fd = PendingCopy(fd, source, target, layout.file_bytes), -1
            return header, copy
        if not os.path.samestat(os.fstat(fd), os.stat(target)):  # replaced between open and link
            unlink_if_present(target)
            raise corrupt_error(source, key, "it was replaced while being linked into a checkpoint")
        return header, None
    finally:
        if fd >= 0:
            os.close(fd)


def _check(fd: int, path: str, key: PartitionKey, layout: FileLayout, updates: int) -> PartitionHeader:
    check_size(os.fstat(fd).st_size, path=path, key=key, numel=layout.numel, dtype=layout.dtype)
    header = unpack_header(os.pread(fd, HEADER_BYTES, 0), path=path, key=key, numel=layout.numel, dtype=layout.dtype)
    check_updates(header, updates, path=path)
    return header


def _copy_range(source: int, target: int, nbytes: int) -> None:
    offset = 0
    kernel = True
    while offset < nbytes:
        want = min(_COPY_CHUNK, nbytes - offset)
        if kernel:
            try:
                done = os.copy_file_range(source, target, want, offset, offset)
            except OSError as error:
                if error.errno not in _KERNEL_COPY_REFUSED:
                    raise
                kernel = False
                continue
        else:
            chunk = os.pread(source, want, offset)
            done = os.pwrite(target, chunk, offset) if chunk else 0
        if done <= 0:
            raise OSError(errno.EIO, f"the file ended after {offset} of {nbytes} bytes")
        offset += done


@dataclass(frozen=True, slots=True)
class PreservedPartition:
    """A partition file :meth:`TieredStorage.preserve` put into a directory."""

    key: PartitionKey
    name: str
    start: int
    """First element of the partition within its segment."""
    stop: int
    nbytes: int
    checksum: int | None
    """The header's CRC-32C, which covers the checksums of the arrays (see
    :meth:`.fileformat.PartitionHeader.checksum`); for a RAM partition, that of the
    header its pending write returns."""
    pending: PendingCopy | PendingWrite | None
    """The copy or write still to run; None for a hard link."""

    @property
    def how(self) -> str:
        """ "linked", "copied" or "written"."""
        return {type(None): "linked", PendingCopy: "copied", PendingWrite: "written"}[type(self.pending)]


def preserve_partitions(
    parts: Sequence[Partition],
    tiers: Mapping[Residency, Tier],
    directory: str,
    name_of: Callable[[PartitionKey], str],
) -> list[PreservedPartition]:
    """Put each of ``parts`` into ``directory`` as a partition file named ``name_of(key)``
    (see :meth:`.storage.TieredStorage.preserve`): the file of a partition in a tier that
    keeps files (``tiers[residency]``) linked or pinned for a copy, a partition in memory
    given a :class:`PendingWrite` of its buffer itself when its tier has a capacity (a
    copy would break it; its next update waits for the write), else of a copy taken now.
    Raises OSError or a TierError, having cancelled its jobs."""
    preserved: list[PreservedPartition] = []
    try:
        for part in parts:
            name = name_of(part.key)
            target = os.path.join(directory, name)
            layout = part.layout
            checksum: int | None = None
            pending: PendingCopy | PendingWrite | None = None
            tier = tiers[part.residency]
            if not tier.keeps_files and tier.capacity_bytes is not None:
                part.saving = threading.Event()
                pending = PendingWrite(tier.buffer(part), part.key, layout, part.updates, target, part.saving)
            elif not tier.keeps_files:
                pending = PendingWrite(
                    tier.buffer(part).clone(), part.key, layout, part.updates, target, threading.Event()
                )
            else:
                try:
                    header, pending = link_or_pin(part.path, target, key=part.key, layout=layout, updates=part.updates)
                except OSError as error:  # name the file whatever call failed
                    raise OSError(error.errno, error.strerror, target) from error
                checksum = header.checksum()
            preserved.append(
                PreservedPartition(
                    key=part.key,
                    name=name,
                    start=part.span.start,
                    stop=part.span.stop,
                    nbytes=layout.file_bytes,
                    checksum=checksum,
                    pending=pending,
                )
            )
    except BaseException:
        for done in preserved:
            if done.pending is not None:
                done.pending.cancel()
        raise
    return preserved
