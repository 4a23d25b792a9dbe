"""Ownership of the folders a run writes on the launcher's machine: ``checkpoint.dir`` and
``export_dir`` are claimed for the whole run (restarts included), so that two live runs
never write, replace or prune in one folder, nor one inside the other's.

A claim is an exclusive ``flock`` on the folder itself (no lock file is left in it), and
a shared one on every folder above it, all held by the launcher process until the run
ends, however it ends: the kernel drops them with the process. So a second run is refused
before any actor starts (:class:`~cargohold.services.core.errors.ConfigError`, exit status 2),
deleting nothing, when it names a claimed folder, a folder inside one (the exclusive lock
refuses its shared one: a live run's pruning would delete an export in its step folder),
or a folder above one (the shared locks refuse its exclusive one). Runs side by side
under one parent share its shared lock. A folder the claim had to create is removed
again at release if the run left it empty. The tier folders under
``state_server.tier.nvme_paths`` are claimed the same way by each state server
(:mod:`cargohold.services.tiers.nvme`), on a ``.lock`` file in each.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from cargohold.cluster.schema.train import TrainConfig
from cargohold.services.core.errors import ConfigError

SEARCH_LIMIT = 10_000
"""Folders looked through, at most, to name a live run's claimed folder inside a refused one."""


class FolderClaim:
    """The locks of one claimed folder; :meth:`release` ends them."""

    def __init__(self, path: Path, key: str) -> None:
        self.path = path
        self._fds: list[int] = []
        created = not path.exists()
        try:
            self._hold_folders_above(key)
            try:
                path.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError as error:
                raise ConfigError(f"{key} {str(path)!r} cannot be used: {error.strerror}") from error
            self._fds.append(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                raise ConfigError(_held_message(path, key)) from error
        except BaseException:
            self._close()
            raise
        self._created = created

    def _hold_folders_above(self, key: str) -> None:
        """A shared lock on each existing folder above :attr:`path`; refused where another
        live run holds one of them (its exclusive lock: it claimed that folder)."""
        existing = self.path.parent
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        above = Path(os.path.realpath(existing))
        for folder in (above, *above.parents):
            try:
                fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError:
                continue  # not this user's to read: it cannot be a claim of this user's runs
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError as error:
                os.close(fd)
                raise ConfigError(
                    f"{key} {str(self.path)!r} lies inside {str(folder)!r}, which another live run has claimed "
                    "(its checkpoint.dir or export_dir): that run's pruning and export may delete or replace what "
                    "this run writes there; give this run a folder outside it"
                ) from error
            self._fds.append(fd)

    def release(self) -> None:
        """Unlock; remove the folder if this claim created it and it is still empty."""
        if not self._fds:
            return
        if self._created:
            with contextlib.suppress(OSError):  # not empty: the run's output stays
                os.rmdir(self.path)
        self._close()

    def _close(self) -> None:
        for fd in reversed(self._fds):
            os.close(fd)
        self._fds = []


def _held_message(path: Path, key: str) -> str:
    """Why ``path``'s exclusive lock was refused: another live run claimed the folder
    itself (it holds the exclusive lock), or a folder inside it (the shared ones)."""
    inside = None if _refuses_shared_lock(str(path)) else _claimed_inside(path)
    if inside is None:
        return (
            f"{key} {str(path)!r} is in use by another live run (it holds the folder's lock, or one of a folder "
            "inside it); give each run its own folder, or wait for that run to end"
        )
    return (
        f"{key} {str(path)!r} contains {str(inside)!r}, which another live run has claimed (its checkpoint.dir "
        "or export_dir); give each run its own folder (side by side under one parent is fine), or wait for that "
        "run to end"
    )


def _claimed_inside(path: Path) -> Path | None:
    """The folder inside ``path`` whose exclusive lock another process holds: the first
    that refuses a shared lock; None where none of the first :data:`SEARCH_LIMIT` does."""
    for seen, (folder, children, _) in enumerate(os.walk(path)):
        if seen and _refuses_shared_lock(folder):
            return Path(folder)
        if seen >= SEARCH_LIMIT:
            break
        children.sort()
    return None


def _refuses_shared_lock(folder: str) -> bool:
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


@contextlib.contextmanager
def claimed_folders(config: TrainConfig) -> Iterator[None]:
    """Hold ``checkpoint.dir`` and ``export_dir`` (those set) for the body's duration;
    refuses with a ConfigError naming the key when another live run holds one, a folder
    above one, or a folder inside one."""
    claims: list[FolderClaim] = []
    try:
        for key, path in (("checkpoint.dir", config.checkpoint.dir), ("export_dir", config.export_dir)):
            if path:
                claims.append(FolderClaim(Path(path).expanduser().absolute(), key))
        yield
    finally:
        for claim in reversed(claims):
            claim.release()
