"""The checks every section's values share: numbers in range, folders that can be made."""

from __future__ import annotations

import math
from pathlib import Path

from cargohold.services.core.errors import ConfigError


def positive(key: str, value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{key} must be a finite number > 0, got {value}")


def non_negative(key: str, value: float) -> None:
    if not (value >= 0 and math.isfinite(value)):
        raise ConfigError(f"{key} must be a finite number >= 0, got {value}")


def check_output_folder(key: str, path: str) -> None:
    """Refuse a folder that can never be created: it, or a folder above it, is a file."""
    for candidate in (Path(path).expanduser().absolute(), *Path(path).expanduser().absolute().parents):
        if candidate.exists():
            if not candidate.is_dir():
                raise ConfigError(f"{key} {path!r} cannot be a folder: {candidate} is a file")
            return
