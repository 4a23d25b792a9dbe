"""One segment's update streamed through memory, a partition at a time: while the consumer
(the segment state's AdamW loop) updates partition k, the following ones are read in, as
far ahead as free staging buffers allow and as soon as a write-back frees one, and k-1 is
written back behind it. The number of buffers sets the depth: two give double buffering,
three let a read, an update and a write overlap. :class:`~.storage.TieredStorage` says
which tier each partition is staged from and kept in.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

import torch

from cargohold.services.tiers.partitions import PartitionSpan
from cargohold.services.tiers.residency import Residency
from cargohold.services.tiers.tier import Partition, PartitionArrays, Staged, StagingTier, TierObserver


@dataclass(frozen=True, slots=True)
class PartitionUpdate:
    """One partition of a segment in memory for its update: what the AdamW call needs."""

    span: PartitionSpan
    """Where it lies in the segment (elements ``start:stop``) and its fragments there."""
    state: PartitionArrays
    """Its fp32 master weights and its moments in their stored form, updated in place."""
    gradient: torch.Tensor
    """Its piece of the segment's gradient, in the wire dtype."""
    owned: bool
    """The update may scale ``gradient`` in place (no one reads it afterwards)."""


@dataclass(slots=True)
class StreamReport:
    """What one streamed update did, for metrics and the benchmark."""

    partitions: int = 0
    prefetch_hits: int = 0
    """Disk partitions already read (or being read) when the update reached them."""
    prefetch_misses: int = 0
    io_wait_seconds: float = 0.0
    """Time the update stood still waiting for a buffer, a read or the final writes."""
    resumed: bool = False
    """Some partitions were already at the update: this finished an interrupted one."""


def stream_partitions(
    order: Sequence[Partition],
    *,
    tiers: Mapping[Residency, StagingTier],
    piece_of: Callable[[Partition], tuple[torch.Tensor, bool]],
    finish: Callable[[Partition, Staged], Future[None]],
    observer: TierObserver,
    report: StreamReport,
) -> Generator[PartitionUpdate]:
    """Each partition of ``order`` in memory with its gradient piece (``piece_of``: the
    piece, and whether it may be scaled in place), staged from the tier of its residency
    in ``tiers``, for the consumer to update; finished
    (``finish``) when the consumer asks for the next. While one is updated, the next are
    read in as far as free buffers allow, and finished ones are written back behind it.
    Ends once all are durable.

    On the first failure (a corrupt read, a failed write) it stops, lets the I/O in
    flight finish, and raises that error; closed early (the consumer's update raised),
    it does the same and ends quietly. Partitions already finished keep their new
    state, the rest keep their old one.
    """
    staged: dict[int, Staged] = {}
    issued = 0
    writes: list[Future[None]] = []
    failure: BaseException | None = None

    def prefetch() -> None:
        nonlocal issued
        while issued < len(order):
            partition = order[issued]
            ahead = tiers[partition.residency].stage(partition, block=False)
            if ahead is None:
                return  # no free buffer now; try again after the next update
            ahead.prefetched = True
            staged[issued] = ahead
            issued += 1

    try:
        for position, partition in enumerate(order):
            failed = next((w.exception() for w in writes if w.done() and w.exception() is not None), None)
            if failed is not None:
                raise failed  # a write-back failed (disk full?): stop updating, keep the rest as it was
            store = tiers[partition.residency]
            if position >= issued:
                # Nothing staged ahead is held now, so waiting for a buffer cannot deadlock:
                # every buffer in use is being read or written and will come back.
                waited = time.perf_counter()
                current = store.stage(partition, block=True)
                assert current is not None, "stage(block=True) waits for a buffer"
                report.io_wait_seconds += time.perf_counter() - waited
                staged[position] = current
                issued = position + 1
            prefetch()
            current = staged.pop(position)
            if store.keeps_files:  # staged through a buffer: a read may have been waited for
                _count_prefetch(current, report, observer)
            try:
                _wait_ready(current, writes, prefetch, report)
                piece, owned = piece_of(partition)
                yield PartitionUpdate(partition.span, current.arrays, piece, owned)
            except BaseException:  # GeneratorExit too: the consumer's update raised
                store.discard(current, intact=False)
                raise
            writes.append(finish(partition, current))
            report.partitions += 1
    except BaseException as error:
        failure = error
        for ahead in staged.values():
            tiers[ahead.partition.residency].discard(ahead, intact=True)
    finally:
        waited = time.perf_counter()
        for write in writes:
            try:
                write.result()
            except BaseException as error:
                failure = failure or error
        report.io_wait_seconds += time.perf_counter() - waited
        observer.add_tier_io_wait(report.io_wait_seconds)
    if failure is not None:
        raise failure


def _count_prefetch(staged: Staged, report: StreamReport, observer: TierObserver) -> None:
    """Whether a disk partition was already read (or being read) when the update reached it."""
    hit = staged.warm or staged.prefetched
    report.prefetch_hits += hit
    report.prefetch_misses += not hit
    observer.record_prefetch(hit)


def _wait_ready(staged: Staged, writes: list[Future[None]], prefetch: Callable[[], None], report: StreamReport) -> None:
    """Wait for ``staged``'s read; a write-back that ends meanwhile frees a buffer, which is
    read ahead into at once, so the disk is not left idle until this read and update are over."""
    waited = time.perf_counter()
    while not staged.ready.done():
        wait([staged.ready, *(w for w in writes if not w.done())], return_when=FIRST_COMPLETED)
        prefetch()
    staged.ready.result()
    report.io_wait_seconds += time.perf_counter() - waited
