"""Writing a file so that a crash leaves either its previous content or the new one,
never a mix: the one helper every writer of a file that must survive uses (checkpoint
manifests and payload files, the NVMe tier's partition files, the Prometheus file_sd
list, exported weights).

The new content goes to ``<target>.tmp``, which is fsynced and renamed over ``target``;
the rename is only durable once the directory itself is fsynced too. A failure before
the rename removes the temporary file and leaves ``target`` as it was. Whatever is at the
temporary name beforehand (a crashed writer's file, a symbolic link planted there) is
removed first, so the writer creates a new file (services/core/private_files.py).
:func:`replace_atomically` is the same without the fsyncs: a file that only has to
survive its writer's death, not the machine's (the NVMe tier's live files, which a
restart never reads; a checkpoint fsyncs those it keeps).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

TEMP_SUFFIX = ".tmp"
"""Appended to a target's name for its content in progress."""


@contextmanager
def replace_durably(
    target: str | os.PathLike[str], *, sync_directory: bool = True, drop_cache: bool = False
) -> Iterator[str]:
    """Yield the temporary path to write ``target``'s new content to (any way: a
    descriptor, a library's ``save(path)``); once the block ends, fsync it, rename it
    over ``target`` and fsync the directory.

    ``sync_directory=False`` leaves the directory's fsync to a caller that renames
    several files into it and fsyncs it once. ``drop_cache`` drops the file's pages from
    the page cache after the fsync (the NVMe tier: no second copy of the state in RAM).
    An error inside the block or in the fsync or rename removes the temporary file and
    propagates, ``target`` untouched; one in the directory's fsync propagates with
    ``target`` already holding the new content.
    """
    target = os.fspath(target)
    temporary = target + TEMP_SUFFIX
    _remove(temporary)  # a link left at its name would send the write to the link's target
    try:
        yield temporary
        fsync_file(temporary, drop_cache=drop_cache)
        os.replace(temporary, target)
    except BaseException:
        _remove(temporary)
        raise
    if sync_directory:
        fsync_directory(os.path.dirname(target) or ".")


@contextmanager
def replace_atomically(target: str | os.PathLike[str]) -> Iterator[str]:
    """Yield the temporary path to write ``target``'s new content to; once the block
    ends, rename it over ``target``. Whoever reads ``target`` finds the old content or
    the new, never a mix, and the inode a name pointed to is never changed (a hard link
    keeps it), but nothing is flushed: after a power loss either may be gone. An error
    removes the temporary file, ``target`` untouched."""
    target = os.fspath(target)
    temporary = target + TEMP_SUFFIX
    _remove(temporary)  # as in replace_durably
    try:
        yield temporary
        os.replace(temporary, target)
    except BaseException:
        _remove(temporary)
        raise


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def fsync_file(path: str | os.PathLike[str], *, drop_cache: bool = False) -> None:
    """Flush a file's data and size to the disk (whichever descriptor wrote them)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
        if drop_cache:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def fsync_directory(path: str | os.PathLike[str]) -> None:
    """Make the entries renamed into (or out of) a directory durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
