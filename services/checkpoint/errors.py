"""The CheckpointErrors the package raises for failed I/O and damaged files."""

from __future__ import annotations

import errno
from pathlib import Path

from cargohold.services.core.errors import CheckpointError, CorruptCheckpointError


def free_space_hint(error: OSError) -> str:
    """What to do, appended to the message of a write that ran out of space."""
    return (
        "; free space there or lower the number of checkpoints kept"
        if error.errno in (errno.ENOSPC, errno.EDQUOT)
        else ""
    )


def os_error(action: str, path: Path, error: OSError) -> CheckpointError:
    reason = error.strerror or str(error)
    return CheckpointError(f"{action} {path} failed: {reason}{free_space_hint(error)}")


def corrupt(path: Path, reason: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"checkpoint file {path} is corrupt: {reason}")
