"""Making renames survive a crash: the directory entry is only durable once the
directory itself is fsynced (temp file, fsync, rename, then this)."""

from __future__ import annotations

import os


def fsync_directory(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
