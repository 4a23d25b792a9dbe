"""The folders a run's processes keep their files in (a state server's ``server-<i>``, a
worker's ``worker-<r>``, under ``<root>/<run_id>/``): each claimed with a lock while its
process lives, and swept by the launcher after a process was killed.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import time
from collections.abc import Sequence

from cargohold.services.core.errors import TierError
from cargohold.services.core.private_files import open_file

logger = logging.getLogger(__name__)


SWEEP_GRACE_S = 10.0
"""How long the sweep waits for a killed server's process to end (and so release its
folder's lock) before it takes the folder for another live run's."""


def remove_tier_folders(roots: Sequence[str], run_id: str, folder: str, *, grace_s: float = SWEEP_GRACE_S) -> None:
    """The launcher's sweep after an actor of ``run_id`` was killed: delete its tier folder
    (``server-<i>`` for a state server's partitions, ``worker-<r>`` for a worker's weights)
    under each root, but only once it can take the folder's lock (:data:`LOCK_NAME`),
    waiting up to ``grace_s`` for a killed actor to be gone. A folder a live actor holds
    past that (another run started with the same run id and tier path) is not this run's
    to delete: it is left, with a warning."""
    for root in roots:
        directory = os.path.join(root, run_id, folder)
        fd = _take_for_sweep(directory, grace_s)
        if fd is None:
            continue
        try:
            remove_folder(directory)
        finally:
            os.close(fd)


def _take_for_sweep(directory: str, grace_s: float) -> int | None:
    """The descriptor holding ``directory``'s lock, or None: no such folder, or a live
    server still holds it after ``grace_s``."""
    deadline = time.monotonic() + grace_s
    while True:
        try:
            return lock_folder(directory)
        except FileNotFoundError:
            return None  # never made, or already removed
        except TierError:
            if time.monotonic() >= deadline:
                logger.warning("not removing %s: a live process holds it (another run, same run id)", directory)
                return None
            time.sleep(0.1)


def remove_folder(directory: str) -> None:
    """Delete a tier folder (a server's partitions, a worker's weights), and its run's
    folder where nothing else is left in it. The caller holds the folder's lock."""
    shutil.rmtree(directory, ignore_errors=True)
    try:
        os.rmdir(os.path.dirname(directory))
    except OSError:
        pass  # another server's files are still there


LOCK_NAME = ".lock"
"""In each tier folder (a server's, a worker's): held (flock) while its process uses it, and
by the launcher's sweep while it removes one."""


def lock_folder(directory: str) -> int:
    """Take the folder for this process: another live process using it (two runs with one
    run id, or two servers with one index) is refused, a dead one's lock is gone.
    FileNotFoundError where ``directory`` does not exist."""
    path = os.path.join(directory, LOCK_NAME)
    try:
        fd = open_file(path, os.O_RDWR | os.O_CREAT)
    except FileNotFoundError:
        raise
    except OSError as error:
        raise TierError(f"cannot take {directory}: {error.strerror}") from error
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        os.close(fd)
        raise TierError(
            f"{directory} is in use by another live process (two runs with the same run id, or "
            "two servers or workers with the same index?); give each run its own run_id"
        ) from error
    return fd
