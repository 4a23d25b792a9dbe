"""The seam every tier implements (:class:`Tier`), the records it trades in, and the
observer the tiers report their I/O to (the state server's metrics satisfy it)."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

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

    @property
    def layout(self) -> FileLayout:
        """Its file layout, which its buffers share."""
        return FileLayout(self.span.numel, self.state_dtype)


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


def _done() -> Future[None]:
    future: Future[None] = Future()
    future.set_result(None)
    return future


@dataclass(slots=True, eq=False)
class Staged:
    """A partition made addressable for one update or read.

    ``arrays`` may be used once ``ready`` has completed without error.
    """

    partition: Partition
    arrays: PartitionArrays
    ready: Future[None] = field(default_factory=_done)
    warm: bool = False
    """The bytes were already in memory: no read was needed."""
    prefetched: bool = False
    """Staged ahead of the update that uses it (set by the pipeline)."""
    handle: object = None
    """The tier's own token (the NVMe tier's buffer)."""


class Tier(Protocol):
    """One storage tier. The pipeline stages a partition, the kernel updates its arrays in
    place, then the tier commits them (or discards them unchanged)."""

    residency: Residency

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

    def drop(self, partition: Partition) -> None:
        """Forget the partition and free what it held in this tier."""
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


def done_future() -> Future[None]:
    """A future that has already completed."""
    return _done()
