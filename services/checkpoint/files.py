"""Opening a checkpoint's files: regular files inside its folder, nothing else.

A checkpoint's manifest and payload files are opened without following a symbolic link
(``O_NOFOLLOW``: a link could send the read anywhere outside the folder) and without
blocking (``O_NONBLOCK``: opening a FIFO for reading would wait for a writer forever),
and the open file must be a regular file (``fstat``). The same check by name
(:func:`check_regular`, ``lstat``) lets ``latest`` skip such a checkpoint before any
read.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from cargohold.services.core.errors import CorruptCheckpointError
from cargohold.services.core.private_files import open_file

_KINDS = (
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def open_regular(path: Path) -> int:
    """A read-only descriptor of the regular file ``path`` (opened as every file a run
    touches is: services/core/private_files.py). A file of another kind is refused with
    CorruptCheckpointError naming it; the open's own OSErrors propagate
    (FileNotFoundError: the file is missing)."""
    try:
        return open_file(str(path))
    except OSError as error:
        if error.errno == errno.ELOOP:  # a link, or not a regular file
            raise not_regular(path, os.lstat(path).st_mode) from None
        raise


def check_regular(path: Path) -> os.stat_result:
    """``path``'s own status (a link is not followed), refused unless a regular file."""
    status = os.lstat(path)
    if not stat.S_ISREG(status.st_mode):
        raise not_regular(path, status.st_mode)
    return status


def not_regular(path: Path, mode: int) -> CorruptCheckpointError:
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    return CorruptCheckpointError(
        f"checkpoint file {path} is {kind}, not a regular file: a checkpoint's files are read only from its own folder"
    )
