"""Where a partition of optimizer state lives: the one residency enum, and the key that
names a partition."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Residency(enum.Enum):
    """The tier holding a partition's fp32 master weights and Adam moments, one member per
    tier class, fastest first (the stream order follows it)."""

    RAM = "ram"
    NVME = "nvme"


@dataclass(frozen=True, slots=True, order=True)
class PartitionKey:
    """One partition: piece ``index`` of segment ``segment_id`` of run ``run_id``."""

    run_id: str
    segment_id: int
    index: int

    def __str__(self) -> str:
        return f"partition {self.index} of segment {self.segment_id} of run {self.run_id!r}"
