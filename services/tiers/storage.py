"""A state server's optimizer state, kept in tiers: RAM, and NVMe files when a RAM budget
is set (:mod:`.tier_list`: the tiers as a list, fastest first, and the moves between
them). It owns the partitions of every segment, re-plans residency when segments
register (and moves partitions to where the new plan wants them), and streams each
update through memory (:mod:`.stream`). The AdamW call itself is the caller's:
:meth:`TieredStorage.update_partitions` yields each partition's state and gradient in
turn, and the segment state's own loop
(:class:`~cargohold.services.segments.segment_state.SegmentState`) updates it.

Without ``ram_budget_bytes`` every segment is one partition in RAM, and an update is the
same single kernel call over the whole segment as without tiers.

The RAM budget is a hard limit on the memory this store holds: resident partitions
(in their 4 KiB-aligned file layout), the gradients staged for them (:mod:`.gradients`)
and the staging buffers are never more than it. Not counted: the gradient a push brings
and the weights a fetch returns (a segment's size in the wire dtype each, bounded by the
calls in flight), which belong to the transport.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from cargohold.cluster.schema.server import TierConfig
from cargohold.services.core.errors import IncompleteUpdateError, TierError
from cargohold.services.core.state_precision import StateDtype, stored_bytes
from cargohold.services.tiers.fileformat import ARRAYS, gradient_file_bytes
from cargohold.services.tiers.gradients import WithGradients
from cargohold.services.tiers.partitions import elements_per_partition, partition_align, split_segment
from cargohold.services.tiers.planner import PartitionDemand, TierPlan, plan_tiers, stream_order
from cargohold.services.tiers.preserve import PreservedPartition, preserve_partitions
from cargohold.services.tiers.report import PartitionRow, TierSummary
from cargohold.services.tiers.residency import PartitionKey, Residency
from cargohold.services.tiers.source import StateSource
from cargohold.services.tiers.stream import PartitionUpdate, StreamReport, stream_partitions
from cargohold.services.tiers.tier import NullObserver, Partition, Staged, StagingTier, TierObserver
from cargohold.services.tiers.tier_list import build_tiers, kept_after


@dataclass(slots=True)
class _Segment:
    """A segment's partitions, in index order, and what its updates need of them."""

    parts: list[Partition]
    gradient_itemsize: int
    """Bytes per element of its staged gradients (its wire dtype)."""
    orders: dict[tuple[tuple[int, Residency], ...], tuple[tuple[Partition, ...], ...]] = field(default_factory=dict)
    """The stream orders of even and odd updates, by where each pending partition is:
    worked out at registration and after moves, looked up by each update."""


class TieredStorage:
    """All partitions of one state server. Thread-safe across segments; the caller (the
    segment state) serialises calls about the same segment."""

    def __init__(
        self,
        config: TierConfig | None = None,
        *,
        server_index: int = 0,
        observer: TierObserver | None = None,
        device: torch.device | None = None,
    ) -> None:
        """``device``: a CUDA device to hold every partition in (a worker's device
        segments; all in memory, no budget); host memory when None."""
        if device is not None and device.type != "cpu" and config is not None and config.ram_budget_bytes is not None:
            raise TierError("partitions on a GPU are all in its memory: no RAM budget, no NVMe tier")
        self.config = config or TierConfig()
        self.device = device if device is not None else torch.device("cpu")
        """Where the partitions' arrays are (and so where an update's gradient must be)."""
        self._observer = observer or NullObserver()
        self._lock = threading.Lock()
        self._segments: dict[tuple[str, int], _Segment] = {}
        self._plan = TierPlan()
        self._tiers = build_tiers(self.config, server_index=server_index, observer=self._observer, device=device)
        self._tier_of = self._tiers.of
        """Each tier by its residency: where a partition is staged from and kept."""
        self._gradients = self._tiers.gradients
        self.staging_bytes = self._tiers.staging_bytes

    @property
    def enabled(self) -> bool:
        """Whether there are tiers below RAM (an NVMe tier, and so a RAM budget)."""
        return len(self._tiers.tiers) > 1

    # --- registration -------------------------------------------------------------------
    def add_segment(
        self,
        run_id: str,
        segment_id: int,
        numel: int,
        fragments: Sequence[tuple[int, int]],
        source: StateSource,
        *,
        updates: int = 0,
        gradient_itemsize: int = 0,
        state_dtype: StateDtype = "float32",
    ) -> None:
        """Create a segment's partitions from ``source`` — fp32 weights with zero moments,
        or a checkpoint's state after ``updates`` updates — re-planning every partition of
        the server. The source is asked for one partition at a time, so a restore never
        holds more than a partition beyond the tiers' own memory. All or nothing.
        ``gradient_itemsize``: bytes per element of the gradients the segment may stage
        (:meth:`stage_gradient`), which the plan counts where they are kept.
        ``state_dtype``: how the segment's moments are stored; ``blockwise8`` partitions
        are cut at multiples of its 256-element blocks."""
        spans = split_segment(numel, fragments, *self._partition_elements(state_dtype))
        parts = [
            Partition(
                PartitionKey(run_id, segment_id, span.index),
                span,
                Residency.RAM,
                updates=updates,
                state_dtype=state_dtype,
            )
            for span in spans
        ]
        with self._lock:
            plan = self._replan(parts, gradient_itemsize)
            for part in parts:
                part.planned = plan.of(part.key)
            self._tiers.fill(
                parts, source, segment_id=segment_id, gradient_itemsize=gradient_itemsize, path_index=plan.path_index
            )
            self._segments[(run_id, segment_id)] = segment = _Segment(parts, gradient_itemsize)
            self._order(segment, parts, updates + 1)
            self._plan = plan
            for segment in self._segments.values():
                for part in segment.parts:
                    part.planned = plan.of(part.key)
        self._report_plan(plan)

    def _partition_elements(self, state_dtype: StateDtype) -> tuple[int | None, int]:
        """The most elements of a partition of a segment stored as ``state_dtype`` (None:
        whole segments) and the multiple its cuts fall at (:func:`partition_align`)."""
        align = partition_align(state_dtype)
        if self.config.ram_budget_bytes is None:
            return None, align
        return elements_per_partition(self.config.partition_size(), align), align

    def _replan(self, new: Sequence[Partition] = (), new_itemsize: int = 0) -> TierPlan:
        segments = [(s.parts, s.gradient_itemsize) for s in self._segments.values()]
        demands = [
            PartitionDemand(p.key, p.layout.file_bytes, gradient_bytes=gradient_file_bytes(p.span.numel, itemsize))
            for parts, itemsize in [*segments, (new, new_itemsize)]
            for p in parts
        ]
        paths = self._tiers.paths
        return plan_tiers(
            demands,
            ram_budget_bytes=self.config.ram_budget_bytes,
            staging_bytes=self.staging_bytes,
            bandwidths=[p.measured() for p in paths],
            num_paths=max(1, len(paths)),
            capacities=[(tier.residency, tier.capacity_bytes) for tier in self._tiers.tiers],
        )

    def settle(self, run_id: str, segment_id: int, *, into: Residency) -> int:
        """Move the segment's partitions that the plan wants in ``into`` there now, instead of
        after their next update; returns how many moved. Called for every segment once a
        registration has re-planned the server (demotions first, so that promotions find
        room in RAM): the first update then reads and writes what the plan says, not the
        moves as well. A partition with a staged gradient, one its planned tier cannot take
        yet, or one whose move fails to write (it stays valid where it is) moves after its
        next update as before. The caller holds the segment still. Raises TierError when a
        partition's file cannot be read (as its next update would)."""
        moved = 0
        for part in self._segments[(run_id, segment_id)].parts:
            if part.residency is into or part.planned is not into or self._gradients.holds(part.key):
                continue
            self._wait_saved(part)
            source = self._tier_of[part.residency]
            staged = self._tiers.stage_now(source, part)
            moving = self._tiers.move(part, staged, part.updates)
            if moving is None:
                source.discard(staged, intact=True)
                continue
            moving.result()
            moved += part.residency is into
        return moved

    def unsettled(self) -> list[tuple[str, int]]:
        """The (run id, segment id) of every segment with a partition outside the tier the
        plan wants: those :meth:`settle` has work for."""
        with self._lock:
            segments = list(self._segments.items())
        return [key for key, s in segments if any(p.residency is not p.planned for p in s.parts)]

    def _wait_saved(self, part: Partition) -> None:
        """Wait until a checkpoint has written this RAM partition out (it may change then)."""
        if part.saving is not None:
            waited = time.perf_counter()
            part.saving.wait()
            part.saving = None
            self._observer.add_tier_io_wait(time.perf_counter() - waited)

    # --- the update ---------------------------------------------------------------------
    def stage_gradient(self, run_id: str, segment_id: int, update: int, gradient: torch.Tensor) -> None:
        """Keep the (already validated) gradient of ``update`` for the partitions not yet
        there, each where its state is, until :meth:`update` is called without one."""
        pending = self._pending(self._segments[(run_id, segment_id)], update, "stage")
        self._gradients.stage(pending, update, gradient)

    def update_partitions(
        self,
        run_id: str,
        segment_id: int,
        update: int,
        gradient: torch.Tensor | None,
        *,
        gradient_owned: bool,
        report: StreamReport,
    ) -> Generator[PartitionUpdate]:
        """Every partition of the segment not yet at ``update``, in memory in stream order,
        for the caller to update in place; each is kept in the tier the plan wants once the
        caller asks for the next. ``gradient``: the (already validated) gradient of the
        whole segment, or None for the one :meth:`stage_gradient` kept, read back a
        partition at a time. ``gradient_owned``: the caller may scale the pieces of
        ``gradient`` in place. ``report`` is filled in as the partitions go by.

        Ends once every partition is durable. On the first failure (a corrupt read, a
        failed write) it stops, lets the I/O in flight finish and raises that error; a
        caller that stops early (its update raised) closes the generator, which does the
        same. Partitions already finished keep their new state, the others their old one,
        and updating again with the same update number finishes them."""
        segment = self._segments[(run_id, segment_id)]
        pending = self._pending(segment, update, "apply")
        order = self._order(segment, pending, update)
        staged_pieces = self._gradients.pieces(order, update) if gradient is None else None

        def piece_of(part: Partition) -> tuple[torch.Tensor, bool]:
            self._wait_saved(part)
            if staged_pieces is None:
                assert gradient is not None
                return gradient[part.span.start : part.span.stop], gradient_owned
            return staged_pieces.take(part)

        tiers: Mapping[Residency, StagingTier] = self._tier_of
        if staged_pieces is not None:  # a file's piece is read with its state
            tiers = {r: WithGradients(t, staged_pieces) if t.keeps_files else t for r, t in self._tier_of.items()}
        report.resumed = len(pending) < len(segment.parts)
        yield from stream_partitions(
            order,
            tiers=tiers,
            piece_of=piece_of,
            finish=lambda part, staged: self._finish(part, staged, update),
            observer=self._observer,
            report=report,
        )
        if staged_pieces is not None:
            self._gradients.consumed(segment.parts, update)

    def _pending(self, segment: _Segment, update: int, verb: str) -> list[Partition]:
        """The segment's partitions not yet at ``update``; each must be one update behind."""
        pending = [p for p in segment.parts if p.updates != update]
        for part in pending:
            if part.updates != update - 1:
                raise IncompleteUpdateError(f"{part.key} is at update {part.updates}; cannot {verb} update {update}")
        return pending

    def _order(self, segment: _Segment, pending: Sequence[Partition], update: int) -> tuple[Partition, ...]:
        """``pending`` in the order update ``update`` streams them (:func:`stream_order`)."""
        where = tuple((p.key.index, p.residency) for p in pending)
        orders = segment.orders.get(where)
        if orders is None:
            by_index = {p.key.index: p for p in pending}
            even, odd = (tuple(by_index[i] for i in stream_order(where, parity)) for parity in (0, 1))
            if len(segment.orders) >= 4:  # partitions moved: the old orders are done with
                segment.orders.clear()
            orders = segment.orders[where] = (even, odd)
        return orders[update % 2]

    def _finish(self, part: Partition, staged: Staged, update: int) -> Future[None]:
        """Keep an updated partition, moving it to the tier the plan wants if it can."""
        if part.planned is not part.residency:
            moving = self._tiers.move(part, staged, update)
            if moving is not None:
                return moving
        kept = self._tier_of[part.residency].commit(staged, update)
        if kept.done() and kept.exception() is None:  # updated in place
            part.updates = update
            return kept
        return kept_after(part, kept, update)

    # --- reads --------------------------------------------------------------------------
    def read_weights(
        self, run_id: str, segment_id: int, updates: int, dtype: torch.dtype, *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The master weights after ``updates`` updates cast to ``dtype``: a new tensor, or ``out`` (a
        spare buffer) when it has that dtype and size."""
        parts = self._consistent(run_id, segment_id, updates)
        numel = parts[-1].span.stop
        if out is None or out.dtype != dtype or out.shape != (numel,):
            out = torch.empty(numel, dtype=dtype)
        for part in parts:
            self._tier_of[part.residency].read_master_into(part, out[part.span.start : part.span.stop])
        return out

    def snapshot(self, run_id: str, segment_id: int, updates: int) -> dict[str, torch.Tensor]:
        """fp32 copies of master, exp_avg and exp_avg_sq of the whole segment (the moments
        decoded from their stored form)."""
        parts = self._consistent(run_id, segment_id, updates)
        numel = parts[-1].span.stop
        out = {name: torch.empty(numel, dtype=torch.float32) for name in ARRAYS}
        for part in parts:
            store = self._tier_of[part.residency]
            staged = self._tiers.stage_now(store, part)
            piece = slice(part.span.start, part.span.stop)
            out["master"][piece] = staged.arrays.master
            staged.arrays.decode_moments_into(out["exp_avg"][piece], out["exp_avg_sq"][piece])
            store.discard(staged, intact=True)
        return out

    def preserve(
        self, run_id: str, segment_id: int, updates: int, directory: str, name_of: Callable[[PartitionKey], str]
    ) -> list[PreservedPartition]:
        """Put every partition of a segment after ``updates`` into ``directory`` as a partition
        file named ``name_of(key)``, for a checkpoint. Files of a tier that keeps them
        (NVMe) are hard-linked now (their version is immutable), or, on another
        filesystem, held open with a :class:`PendingCopy` to run later. Partitions in
        memory (RAM) get a :class:`PendingWrite` to run later: with a RAM budget, of the
        partition itself, and its next update waits until the write has run (or was
        cancelled), since a copy would break the budget; without one, of a copy taken now,
        so training never waits for the disk. Every pending job must be run or cancelled. The caller holds
        the segment still (its lock) until this returns and fsyncs ``directory`` once the
        jobs are done.

        Raises OSError or a TierError, having cancelled its jobs; what it already put
        there stays for the caller to remove with the directory."""
        parts = self._consistent(run_id, segment_id, updates)
        return preserve_partitions(parts, self._tier_of, directory, name_of)

    def _consistent(self, run_id: str, segment_id: int, updates: int) -> list[Partition]:
        parts = self._segments[(run_id, segment_id)].parts
        behind = [p for p in parts if p.updates != updates]
        if behind:
            ahead = max(p.updates for p in parts)
            raise IncompleteUpdateError(
                f"segment {segment_id} of run {run_id!r} stopped part-way through update {ahead} "
                f"({len(parts) - len(behind)} of {len(parts)} partitions after update {updates}); "
                f"repeat the push of update {ahead} to finish it"
            )
        return parts

    # --- accounting and stats -------------------------------------------------------------
    def state_bytes(self, run_id: str | None = None, segment_id: int | None = None) -> dict[Residency, int]:
        """Bytes of optimizer state (12, 8 or about 6 per element: ``optim.state_dtype``) in
        each tier, for a segment or all."""
        totals = {residency: 0 for residency in Residency}
        with self._lock:
            segments = [
                s
                for (run, segment), s in self._segments.items()
                if run_id is None or (run == run_id and segment_id in (None, segment))
            ]
        for segment in segments:
            for part in segment.parts:
                totals[part.residency] += stored_bytes(part.state_dtype, part.span.numel)
        return totals

    def rows(self, run_id: str | None = None) -> list[PartitionRow]:
        """Every partition with the plan's decision and its place in the next stream."""
        with self._lock:
            segments = sorted((k, list(s.parts)) for k, s in self._segments.items() if run_id in (None, k[0]))
        rows = []
        for _, parts in segments:
            next_update = min(p.updates for p in parts) + 1
            order = stream_order([(p.key.index, p.residency) for p in parts], next_update)
            position = {index: n for n, index in enumerate(order)}
            rows += [
                PartitionRow(
                    key=p.key,
                    offset=p.span.start,
                    numel=p.span.numel,
                    planned=p.planned,
                    actual=p.residency,
                    order=position[p.key.index],
                    updates=p.updates,
                    path=p.path if self._tier_of[p.residency].keeps_files else "",
                )
                for p in parts
            ]
        return rows

    def summary(self) -> TierSummary:
        with self._lock:
            plan = self._plan
        paths = self._tiers.paths
        return TierSummary(
            enabled=self.enabled,
            ram_budget_bytes=self.config.ram_budget_bytes or 0,
            staging_bytes=self.staging_bytes,
            buffer_count=self._tiers.buffer_count,
            ram_used_bytes=self._tiers.memory_bytes,
            planned_ram_bytes=plan.ram_bytes,
            planned_nvme_bytes=plan.nvme_bytes,
            predicted_io_seconds=plan.predicted_io_seconds,
            paths=tuple(p.root for p in paths),
            direct_io=tuple(p.direct for p in paths),
            bandwidth=tuple(p.measured() for p in paths),
        )

    def _report_plan(self, plan: TierPlan) -> None:
        self._observer.set_tier_plan({r.value: plan.count(r) for r in Residency}, plan.predicted_io_seconds)

    def close(self) -> None:
        """Stop the I/O threads and delete this server's partition files."""
        self._tiers.close()
