"""The seam every tier implements (:class:`Tier`), the records it trades in, and the
observer the tiers report their I/O to (the state server's metrics satisfy it).

A tier is one place a partition's state can live (RAM, NVMe files); the storage holds its
tiers in a list, fastest first, and asks each what is particular to it (whether it keeps
files, its capacity) rather than naming them."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from cargohold.services.core.state_precision import (
    PIECE_ELEMENTS,
    StateDtype,
    StoredMoment,
    decode,
    decode_range,
    encode_range_,
)
from cargohold.services.tiers.fileformat import FileLayout
from cargohold.services.tiers.partitions import PartitionSpan
from cargohold.services.tiers.residency import PartitionKey, Residency

if TYPE_CHECKING:
    from cargohold.services.tiers.io_pool import AlignedBuffer
    from cargohold.services.tiers.nvme import TierPath
    from cargohold.services.tiers.source import Moments


def _done() -> Future[None]:
    future: Future[None] = Future()
    future.set_result(None)
    return future


DONE = _done()
"""A future that has already completed: what a tier that updates in place commits with.
Shared, since a completed future never changes."""


@dataclass(slots=True, eq=False)
class Partition:
    """What the server knows of one partition: where it is and how many updates it holds."""

    key: PartitionKey
    span: PartitionSpan
    residency: Residency
    """Where it is now; the plan may want it elsewhere (it moves after its next update)."""
    updates: int = 0
    """The number of updates its stored state includes (its file's header holds it too)."""
    path: str = ""
    """Its file when on (or destined for) the NVMe tier; empty without one."""
    path_index: int = 0
    """Which configured NVMe path ``path`` is on."""
    saving: threading.Event | None = None
    """Set while a checkpoint still has to write this (RAM) partition out: its next update
    waits for the event."""
    state_dtype: StateDtype = "float32"
    """How its moments are stored (``optim.state_dtype``)."""
    planned: Residency = Residency.RAM
    """Where the server's tier plan wants it (set whenever the plan changes)."""
    layout: FileLayout = field(init=False)
    """Its file layout, which its buffers share."""

    def __post_init__(self) -> None:
        self.layout = FileLayout(self.span.numel, self.state_dtype)


@dataclass(frozen=True, slots=True)
class PartitionArrays:
    """Views of one partition's state, each ``numel`` long: fp32 master weights and the
    moments in their stored form (fp32 views themselves for ``float32``)."""

    master: torch.Tensor
    exp_avg: StoredMoment
    exp_avg_sq: StoredMoment

    def copy_(self, other: PartitionArrays) -> None:
        """Copy another partition's arrays of the same size and kind, as they are stored."""
        self.master.copy_(other.master)
        for mine, theirs in ((self.exp_avg, other.exp_avg), (self.exp_avg_sq, other.exp_avg_sq)):
            mine.values.copy_(theirs.values)
            mine.scales.copy_(theirs.scales)

    def load_(
        self,
        master: torch.Tensor,
        moments: tuple[torch.Tensor, torch.Tensor] | tuple[StoredMoment, StoredMoment] | None,
    ) -> None:  # the moments: a StateSource's (:mod:`.source`)
        """Set the state from fp32 ``master`` and ``moments`` (None: zeros): fp32 ones are
        encoded into the stored form (a piece at a time), stored ones of this kind copied."""
        self.master.copy_(master)
        for stored, values in zip((self.exp_avg, self.exp_avg_sq), moments or (None, None)):
            if values is None:
                stored.values.zero_()
                stored.scales.zero_()
            elif isinstance(values, StoredMoment):
                stored.values.copy_(values.values)
                stored.scales.copy_(values.scales)
            elif stored.dtype == "float32":
                stored.values.copy_(values)
            else:
                for start in range(0, stored.numel, PIECE_ELEMENTS):
                    encode_range_(stored, start, values[start : start + PIECE_ELEMENTS].clone())

    def decoded(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """New fp32 copies of the master weights and the decoded moments."""
        return self.master.clone(), decode(self.exp_avg), decode(self.exp_avg_sq)

    def decode_moments_into(self, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        """Write the decoded fp32 moments into ``exp_avg`` and ``exp_avg_sq`` (numel each)."""
        for stored, out in ((self.exp_avg, exp_avg), (self.exp_avg_sq, exp_avg_sq)):
            for start in range(0, stored.numel, PIECE_ELEMENTS):
                decode_range(stored, start, out[start : start + PIECE_ELEMENTS])


@dataclass(slots=True, eq=False)
class Staged:
    """A partition made addressable for one update or read.

    ``arrays`` may be used once ``ready`` has completed without error.
    """

    partition: Partition
    arrays: PartitionArrays
    ready: Future[None] = DONE
    warm: bool = False
    """The bytes were already in memory: no read was needed."""
    prefetched: bool = False
    """Staged ahead of the update that uses it (set by the pipeline)."""
    handle: object = None
    """The buffer holding ``arrays`` in the partition's file layout (the RAM tier's own,
    or the NVMe tier's staging buffer)."""


class StagingTier(Protocol):
    """What an update's stream (:mod:`.stream`) asks of a tier: the pipeline stages a
    partition, the kernel updates its arrays in place, then the tier commits them (or
    discards them unchanged)."""

    @property
    def keeps_files(self) -> bool:
        """Whether it keeps each partition as an immutable file (``Partition.path``) staged
        through the shared staging buffers: a checkpoint hard-links that file, and a
        staged gradient goes to a file beside it. Otherwise the partition's bytes stay in
        memory (:meth:`Tier.buffer`), updated in place."""
        ...

    def stage(self, partition: Partition, *, block: bool) -> Staged | None:
        """Make the partition's arrays addressable, reading them in if needed. With
        ``block=False`` returns None instead of waiting for memory to stage into."""
        ...

    def commit(self, staged: Staged, update: int) -> Future[None]:
        """Keep the updated arrays as the state after ``update``; the future completes when they
        are durable in this tier. Releases the staging."""
        ...

    def discard(self, staged: Staged, *, intact: bool) -> None:
        """Release the staging without keeping changes; ``intact`` says the arrays still
        equal the stored state (a read that was not modified)."""
        ...


class Tier(StagingTier, Protocol):
    """One storage tier: what a stream asks of it, and what registration, moves between
    tiers, reads and checkpoints do. What differs between tiers is asked of them here,
    never tested by name."""

    residency: Residency
    """The tier's value in the one residency enum (what the plan and the reports say)."""
    capacity_bytes: int | None
    """What the planner may place in it (partitions in their file layout and the gradients
    staged beside them); None: no limit. The last tier of a storage has none."""

    @property
    def memory_bytes(self) -> int:
        """Host (or device) memory it holds now."""
        ...

    @property
    def paths(self) -> Sequence[TierPath]:
        """The disk paths it keeps files on (none for a memory tier)."""
        ...

    # --- registration --------------------------------------------------------------
    def prepare(self, run_id: str, parts: Sequence[Partition], path_index: Mapping[PartitionKey, int]) -> None:
        """Get ready for a new segment's partitions (whichever tier they start in): a tier
        that keeps files names each one's file (``path_index``: the plan's disk path)."""
        ...

    def reserve(self, partition: Partition) -> bool:
        """Take a new partition in (its state written later by :meth:`load`); False, with
        nothing changed, when there is no room now."""
        ...

    def check_room(self, parts: Sequence[Partition], gradient_itemsize: int, what: str) -> None:
        """Refuse (TierSpaceError naming ``what``), before any is written, new partitions
        and their staged gradients that the tier's storage cannot hold."""
        ...

    def load(self, partition: Partition, master: torch.Tensor, moments: Moments | None) -> Future[None]:
        """Set a reserved partition's first state (zero moments for None)."""
        ...

    def receive(self, partition: Partition, staged: Staged, updates: int) -> Future[None] | None:
        """Take in a partition another tier staged (``staged.handle`` in its file layout)
        as its state after ``updates``; None, with nothing changed, when there is no room
        now. The future fails when the partition could not be kept here."""
        ...

    def drop(self, partition: Partition) -> None:
        """Forget the partition and free what it held in this tier."""
        ...

    # --- reads ---------------------------------------------------------------------
    def read_master_into(self, partition: Partition, out: torch.Tensor) -> None:
        """Copy (and cast) the stored master weights into ``out``."""
        ...

    def buffer(self, partition: Partition) -> AlignedBuffer:
        """The memory holding a partition in its file layout, which a checkpoint writes
        out; only a tier that keeps no files has one."""
        ...

    def close(self) -> None:
        """Delete what the tier holds outside this process (its files)."""
        ...


class TierObserver(Protocol):
    """Where the tiers report their I/O (the state server's metrics)."""

    def record_tier_io(self, op: str, nbytes: int, seconds: float) -> None: ...

    def set_tier_queue_depth(self, depth: int) -> None: ...

    def record_prefetch(self, hit: bool) -> None: ...

    def add_tier_io_wait(self, seconds: float) -> None: ...

    def set_tier_plan(self, partitions: dict[str, int], predicted_io_seconds: float) -> None: ...


class NullObserver:
    """An observer that records nothing (tests, benchmarks, RAM-only registries)."""

    def record_tier_io(self, op: str, nbytes: int, seconds: float) -> None:
        pass

    def set_tier_queue_depth(self, depth: int) -> None:
        pass

    def record_prefetch(self, hit: bool) -> None:
        pass

    def add_tier_io_wait(self, seconds: float) -> None:
        pass

    def set_tier_plan(self, partitions: dict[str, int], predicted_io_seconds: float) -> None:
        pass
