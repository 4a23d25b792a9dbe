"""The folders and files a run writes, safe under a scratch folder other users share.

A run writes under folders its user names (``state_server.tier.nvme_paths``,
``worker.weights_nvme_path``, ``checkpoint.dir``), often a machine's shared scratch
space, where another local user can create ``<root>/<run_id>/...`` before the run starts
and plant symbolic links at the names the run will write (a partition's temporary file,
a ``.grad`` file, a unit's weight file), so that the run overwrites the links' targets.
So:

- a run's own folders (:func:`private_folders`) are created with mode 0700, and one that
  already exists is adopted only when it is a real directory (not a link), this user's,
  and writable by no one else; otherwise the run is refused naming the folder. Inside
  such a folder no one else can create a name.
- every file the run creates (:func:`create_file`) and reads back (:func:`open_file`) is
  opened with ``O_NOFOLLOW`` and must be a regular file: a link found at its name (an
  earlier run of the same user left it, or the folder was adopted before this check)
  is refused, its target untouched.
"""

from __future__ import annotations

import errno
import os
import stat

from cargohold.services.core.errors import TierError

FOLDER_MODE = 0o700
WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH


def private_folders(root: str, *names: str, key: str) -> str:
    """``root/names[0]/names[1]/...``: ``root`` created if missing (it is the user's to
    choose and may be shared), each name below it created private or adopted only when
    private (see the module's docstring). Returns the deepest folder; raises TierError
    naming the folder and the config ``key`` that set ``root``."""
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as error:
        raise TierError(f"{key}: cannot create {root}: {error.strerror}") from error
    folder = root
    for name in names:
        folder = os.path.join(folder, name)
        try:
            os.mkdir(folder, FOLDER_MODE)
        except FileExistsError:
            check_private(folder, key=key)
        except OSError as error:
            raise TierError(f"{key}: cannot create {folder}: {error.strerror}") from error
    return folder


def check_private(folder: str, *, key: str) -> None:
    """Refuse ``folder`` unless it is a directory (not a link to one), owned by this
    process's user and writable by no one else."""
    status = os.lstat(folder)
    problem = ""
    if stat.S_ISLNK(status.st_mode):
        problem = "is a symbolic link"
    elif not stat.S_ISDIR(status.st_mode):
        problem = "is not a directory"
    elif status.st_uid != os.geteuid():
        problem = f"belongs to user {status.st_uid}, not to this run's user {os.geteuid()}"
    elif status.st_mode & WRITABLE_BY_OTHERS:
        problem = f"is writable by other users (mode {stat.S_IMODE(status.st_mode):o})"
    if problem:
        raise TierError(
            f"{key}: {folder} {problem}; a run writes only in folders it made or its own user's, "
            "writable by no one else (another user could plant links there); remove it or choose another run_id"
        )


def create_file(path: str, flags: int = 0) -> int:
    """A write-only descriptor of ``path`` as a new, empty regular file (0600), whatever
    was there truncated; ``flags`` adds to the open's (``O_DIRECT``). A link or another
    kind of file at ``path`` is an OSError (ELOOP) saying so, nothing written."""
    return _open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags)


def open_file(path: str, flags: int = os.O_RDONLY) -> int:
    """A descriptor of the existing regular file ``path`` (``flags``: the access mode and
    any others); a link or another kind of file is an OSError (ELOOP) saying so."""
    return _open(path, flags)


def _open(path: str, flags: int) -> int:
    try:
        fd = os.open(path, flags | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENXIO):  # a link; a FIFO without a reader, a device without one
            raise planted(path) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise planted(path)
    return fd


def planted(path: str) -> OSError:
    reason = f"{path} is a symbolic link or not a regular file; cargohold writes only its own files"
    return OSError(errno.ELOOP, reason, path)
