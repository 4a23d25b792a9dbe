"""Ownership of the folders a run writes on the launcher's machine: ``checkpoint.dir`` and
``export_dir`` are claimed for the whole run (restarts included), so that two live runs
never write, replace or prune in one folder.

A claim is an exclusive ``flock`` on the folder itself (no lock file is left in it), held
by the launcher process until the run ends, however it ends: the kernel drops it with the
process. A second run naming a claimed folder is refused before any actor starts
(:class:`~cargohold.services.errors.ConfigError`, exit status 2) and deletes nothing. A
folder the claim had to create is removed again at release if the run left it empty.
The tier folders under ``state_server.tier.nvme_paths`` are claimed the same way by each
state server (:mod:`cargohold.services.tiers.nvme`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from cargohold.cluster.config import TrainConfig
from cargohold.services.errors import ConfigError


class FolderClaim:
    """The lock of one claimed folder; :meth:`release` ends it."""

    def __init__(self, path: Path, key: str) -> None:
        self.path = path
        created = not path.exists()
        try:
            path.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as error:
            raise ConfigError(f"{key} {str(path)!r} cannot be used: {error.strerror}") from error
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            os.close(fd)
            raise ConfigError(
                f"{key} {str(path)!r} is in use by another live run (it holds the folder's lock); give each "
                "run its own folder, or wait for that run to end"
            ) from error
        self._fd: int | None = fd
        self._created = created

    def release(self) -> None:
        """Unlock; remove the folder if this claim created it and it is still empty."""
        if self._fd is None:
            return
        if self._created:
            with contextlib.suppress(OSError):  # not empty: the run's output stays
                os.rmdir(self.path)
        os.close(self._fd)
        self._fd = None


@contextlib.contextmanager
def claimed_folders(config: TrainConfig) -> Iterator[None]:
    """Hold ``checkpoint.dir`` and ``export_dir`` (those set) for the body's duration;
    refuses with a ConfigError naming the key when another live run holds one."""
    claims: list[FolderClaim] = []
    try:
        for key, path in (("checkpoint.dir", config.checkpoint.dir), ("export_dir", config.export_dir)):
            if path:
                claims.append(FolderClaim(Path(path).expanduser().absolute(), key))
        yield
    finally:
        for claim in reversed(claims):
            claim.release()
