"""What a state server reports about its tiers (``GetStats``): shared by the storage
that fills it in and the gRPC client and codec that carry it, so that neither side
imports the other."""

from __future__ import annotations

from dataclasses import dataclass

from cargohold.services.tiers.planner import Bandwidth
from cargohold.services.tiers.residency import PartitionKey, Residency


@dataclass(frozen=True, slots=True)
class PartitionRow:
    """One partition as the stats report it."""

    key: PartitionKey
    offset: int
    numel: int
    planned: Residency
    actual: Residency
    order: int
    """Position in its segment's stream at the next update."""
    updates: int
    """The updates its stored state includes (the wire's ``step``)."""
    path: str


@dataclass(frozen=True, slots=True)
class TierSummary:
    """The plan's totals and the disk facts it was made from."""

    enabled: bool
    ram_budget_bytes: int
    """0 when there is no budget."""
    staging_bytes: int
    buffer_count: int
    ram_used_bytes: int
    """Memory held now: resident partitions plus the staging buffers allocated so far."""
    planned_ram_bytes: int
    planned_nvme_bytes: int
    predicted_io_seconds: float
    paths: tuple[str, ...]
    direct_io: tuple[bool, ...]
    bandwidth: tuple[Bandwidth, ...]
