"""A state server's optimizer state, kept in tiers: RAM, and NVMe files when a RAM budget
is set. It owns the partitions of every segment, re-plans residency when segments
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

import logging
import threading
import time
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import Future

import torch

from cargohold.cluster.schema.server import TierConfig
from cargohold.services.core.errors import IncompleteUpdateError, TierError
from cargohold.services.core.state_precision import StateDtype, stored_bytes
from cargohold.services.tiers.fileformat import ARRAYS, FileLayout, gradient_file_bytes
from cargohold.services.tiers.gradients import NvmeWithGradients, StagedGradients
from cargohold.services.tiers.io_pool import BufferPool, IoPool
from cargohold.services.tiers.nvme import PROBE_BYTES, NvmeTier, probe_path
from cargohold.services.tiers.partitions import elements_per_partition, partition_align, split_segment
from cargohold.services.tiers.planner import PartitionDemand, TierPlan, plan_tiers, stream_order
from cargohold.services.tiers.preserve import PreservedPartition, preserve_partitions
from cargohold.services.tiers.ram import RamTier
from cargohold.services.tiers.report import PartitionRow, TierSummary
from cargohold.services.tiers.residency import PartitionKey, Residency
from cargohold.services.tiers.source import StateSource, source_piece
from cargohold.services.tiers.stream import PartitionUpdate, StreamReport, stream_partitions
from cargohold.services.tiers.tier import (
    NullObserver,
    Partition,
    PartitionArrays,
    Staged,
    Tier,
    TierObserver,
    done_future,
)

logger = logging.getLogger(__name__)


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
        self._segments: dict[tuple[str, int], list[Partition]] = {}
        self._gradient_itemsize: dict[tuple[str, int], int] = {}
        """Bytes per element of each segment's staged gradients (its wire dtype)."""
        self._plan = TierPlan()
        budget = self.config.ram_budget_bytes
        self._nvme: NvmeTier | None = None
        self._io: IoPool | None = None
        self._buffers: BufferPool | None = None
        if budget is None:
            self._max_elements: int | None = None
            self.staging_bytes = 0
            self._ram = RamTier(None, device)
            self._gradients = StagedGradients(None, None, None, device=device)
            return
        self._max_elements = elements_per_partition(self.config.partition_size())
        # A staging buffer holds a partition in its file layout and, after it, the
        # partition's staged gradient (fp32 at most): read in with the state.
        buffer_bytes = FileLayout(self._max_elements).file_bytes + gradient_file_bytes(self._max_elements, 4)
        self.staging_bytes = self.config.staging_bytes()
        self._ram = RamTier(budget - self.staging_bytes)
        paths = [probe_path(p, self.config.direct_io, min(PROBE_BYTES, buffer_bytes)) for p in self.config.nvme_paths]
        self._io = IoPool(self.config.io_threads, self._observer)
        self._buffers = BufferPool(self.config.buffer_count, buffer_bytes)
        self._nvme = NvmeTier(
            paths, server_index=server_index, io=self._io, buffers=self._buffers, observer=self._observer
        )
        self._gradients = StagedGradients(self._nvme, self._io, self._buffers, self._observer)

    @property
    def enabled(self) -> bool:
        """Whether an NVMe tier (and so a RAM budget) is configured."""
        return self._nvme is not None

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
        with self._lock:
            if self._nvme is not None:
                self._nvme.prepare_run(run_id)
            parts = [
                Partition(
                    PartitionKey(run_id, segment_id, s.index),
                    s,
                    Residency.RAM,
                    updates=updates,
                    state_dtype=state_dtype,
                )
                for s in spans
            ]
            plan = self._replan(parts, gradient_itemsize)
            to_disk: list[Partition] = []
            resident: dict[PartitionKey, PartitionArrays] = {}
            for part in parts:
                if self._nvme is not None:
                    part.path_index = plan.path_index[part.key]
                    part.path = self._nvme.file_of(part.key, part.path_index)
                arrays = self._ram.admit(part) if plan.of(part.key) is Residency.RAM else None
                if arrays is not None:
                    resident[part.key] = arrays
                else:
                    part.residency = Residency.NVME  # RAM is full for now; it moves in later
                    to_disk.append(part)
            try:
                if to_disk:
                    assert self._nvme is not None  # no budget means no limit on RAM
                    self._nvme.check_space(
                        (
                            (
                                p.path_index,
                                p.layout.file_bytes + gradient_file_bytes(p.span.numel, gradient_itemsize),
                            )
                            for p in to_disk
                        ),
                        f"segment {segment_id} of run {run_id!r}",
                    )
                created: list[Future[None]] = []
                try:
                    for part in parts:
                        master, moments = source_piece(source, part, segment_id)
                        if part.residency is Residency.RAM:
                            resident[part.key].load_(master, moments)
                        else:
                            assert self._nvme is not None
                            created.append(self._nvme.create(part, master, moments))
                finally:
                    errors = [f.exception() for f in created]  # waits for every write
                first = next((e for e in errors if e is not None), None)
                if first is not None:
                    raise first
            except BaseException:
                for part in parts:
                    self._store_of(part).drop(part)
                raise
            self._segments[(run_id, segment_id)] = parts
            self._gradient_itemsize[(run_id, segment_id)] = gradient_itemsize
            self._plan = plan
        self._report_plan(plan)

    def _partition_elements(self, state_dtype: StateDtype) -> tuple[int | None, int]:
        """The most elements of a partition of a segment stored as ``state_dtype`` (None:
        whole segments) and the multiple its cuts fall at (:func:`partition_align`)."""
        align = partition_align(state_dtype)
        if self._max_elements is None:
            return None, align
        return elements_per_partition(self.config.partition_size(), align), align

    def _replan(self, new: Sequence[Partition] = (), new_itemsize: int = 0) -> TierPlan:
        segments = [(parts, self._gradient_itemsize[key]) for key, parts in self._segments.items()]
        demands = [
            PartitionDemand(p.key, p.layout.file_bytes, gradient_bytes=gradient_file_bytes(p.span.numel, itemsize))
            for parts, itemsize in [*segments, (new, new_itemsize)]
            for p in parts
        ]
        nvme = self._nvme
        return plan_tiers(
            demands,
            ram_budget_bytes=self.config.ram_budget_bytes,
            staging_bytes=self.staging_bytes,
            bandwidths=[p.measured() for p in nvme.paths] if nvme else (),
            num_paths=len(nvme.paths) if nvme else 1,
        )

    def settle(self, run_id: str, segment_id: int, *, into: Residency) -> int:
        """Move the segment's partitions that the plan wants in ``into`` there now, instead of
        after their next update; returns how many moved. Called for every segment once a
        registration has re-planned the server (demotions first, so that promotions find
        room in RAM): the first update then reads and writes what the plan says, not the
        moves as well. A partition with a staged gradient, one RAM cannot take yet, or one
        whose demotion fails to write (it stays valid in RAM) moves after its next update
        as before. The caller holds the segment still. Raises TierError when a promoted
        partition's file cannot be read (as its next update would)."""
        nvme = self._nvme
        if nvme is None:
            return 0
        plan, moved = self._plan, 0
        for part in self._segments[(run_id, segment_id)]:
            if part.residency is into or plan.of(part.key) is not into or self._gradients.holds(part.key):
                continue
            if into is Residency.NVME:
                self._wait_saved(part)
                try:
                    nvme.write_from(part, self._ram.buffer(part), part.updates).result()
                except TierError as error:
                    logger.warning("could not move %s to disk: %s", part.key, error)
                    continue
                self._left_ram(part)
            else:
                staged = nvme.stage(part, block=True)
                assert staged is not None, "stage(block=True) waits for a buffer"
                try:
                    staged.ready.result()
                except BaseException:
                    nvme.discard(staged, intact=False)
                    raise
                if not self._into_ram(part, staged):
                    nvme.discard(staged, intact=True)
                    continue
            moved += 1
        return moved

    def unsettled(self) -> list[tuple[str, int]]:
        """The (run id, segment id) of every segment with a partition outside the tier the
        plan wants: those :meth:`settle` has work for."""
        with self._lock:
            plan, segments = self._plan, list(self._segments.items())
        return [key for key, parts in segments if any(p.residency is not plan.of(p.key) for p in parts)]

    def _into_ram(self, part: Partition, staged: Staged) -> bool:
        """Make a staged disk partition resident and forget its file; False, with nothing
        changed, when RAM cannot take it yet."""
        assert self._nvme is not None
        if self._ram.admit(part, staged.arrays) is None:
            return False
        self._nvme.discard(staged, intact=False)
        self._nvme.drop(part)
        part.residency = Residency.RAM
        return True

    def _left_ram(self, part: Partition) -> None:
        """A resident partition whose file now holds its state: free its RAM."""
        part.residency = Residency.NVME
        self._ram.drop(part)
        self._gradients.left_ram(part.key)

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
        pending = self._pending(run_id, segment_id, update, "stage")
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
        parts = self._segments[(run_id, segment_id)]
        pending = self._pending(run_id, segment_id, update, "apply")
        by_index = {p.key.index: p for p in pending}
        order = [by_index[i] for i in stream_order([(p.key.index, p.residency) for p in pending], update)]
        plan = self._plan
        staged_pieces = self._gradients.pieces(order, update) if gradient is None else None

        def piece_of(part: Partition) -> tuple[torch.Tensor, bool]:
            self._wait_saved(part)
            if staged_pieces is None:
                assert gradient is not None
                return gradient[part.span.start : part.span.stop], gradient_owned
            return staged_pieces.take(part)

        def finish(part: Partition, staged: Staged) -> Future[None]:
            return self._finish(part, staged, update, plan.of(part.key))

        store_of = self._store_of
        if staged_pieces is not None and self._nvme is not None:
            with_gradients = NvmeWithGradients(self._nvme, staged_pieces)

            def store_of(part: Partition) -> Tier:
                return with_gradients if part.residency is Residency.NVME else self._ram

        report.resumed = len(pending) < len(parts)
        yield from stream_partitions(
            order, store_of=store_of, piece_of=piece_of, finish=finish, observer=self._observer, report=report
        )
        if staged_pieces is not None:
            self._gradients.consumed(parts, update)

    def _pending(self, run_id: str, segment_id: int, update: int, verb: str) -> list[Partition]:
        """The segment's partitions not yet at ``update``; each must be one update behind."""
        pending = [p for p in self._segments[(run_id, segment_id)] if p.updates != update]
        for part in pending:
            if part.updates != update - 1:
                raise IncompleteUpdateError(f"{part.key} is at update {part.updates}; cannot {verb} update {update}")
        return pending

    def _finish(self, part: Partition, staged: Staged, update: int, planned: Residency) -> Future[None]:
        """Keep an updated partition, moving it to the tier the plan wants if it can."""
        if part.residency is Residency.RAM:
            part.updates = update
            if planned is Residency.RAM or self._nvme is None:
                return done_future()

            def demoted(error: BaseException | None) -> None:
                if error is None:
                    self._left_ram(part)
                else:  # it stays in RAM, as valid as before; the budget was already paying for it
                    logger.warning("could not move %s to disk: %s", part.key, error)

            return _then(self._nvme.write_from(part, self._ram.buffer(part), update), demoted, swallow=True)
        assert self._nvme is not None
        if planned is Residency.RAM and self._into_ram(part, staged):
            part.updates = update
            return done_future()

        def committed(error: BaseException | None) -> None:
            if error is None:
                part.updates = update

        return _then(self._nvme.commit(staged, update), committed)

    def _store_of(self, part: Partition) -> Tier:
        if part.residency is Residency.RAM:
            return self._ram
        assert self._nvme is not None
        return self._nvme

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
            view = out[part.span.start : part.span.stop]
            if part.residency is Residency.RAM:
                view.copy_(self._ram.arrays(part).master)
            else:
                assert self._nvme is not None
                self._nvme.read_master_into(part, view)
        return out

    def snapshot(self, run_id: str, segment_id: int, updates: int) -> dict[str, torch.Tensor]:
        """fp32 copies of master, exp_avg and exp_avg_sq of the whole segment (the moments
        decoded from their stored form)."""
        parts = self._consistent(run_id, segment_id, updates)
        numel = parts[-1].span.stop
        out = {name: torch.empty(numel, dtype=torch.float32) for name in ARRAYS}
        for part in parts:
            store = self._store_of(part)
            staged = store.stage(part, block=True)
            assert staged is not None
            try:
                staged.ready.result()
            except BaseException:
                store.discard(staged, intact=False)
                raise
            piece = slice(part.span.start, part.span.stop)
            out["master"][piece] = staged.arrays.master
            staged.arrays.decode_moments_into(out["exp_avg"][piece], out["exp_avg_sq"][piece])
            store.discard(staged, intact=True)
        return out

    def preserve(
        self, run_id: str, segment_id: int, updates: int, directory: str, name_of: Callable[[PartitionKey], str]
    ) -> list[PreservedPartition]:
        """Put every partition of a segment after ``updates`` into ``directory`` as a partition
        file named ``name_of(key)``, for a checkpoint. Files on the NVMe tier are
        hard-linked now (their version is immutable), or, on another filesystem, held
        open with a :class:`PendingCopy` to run later. Partitions in RAM get a
        :class:`PendingWrite` to run later: with a RAM budget, of the partition itself,
        and its next update waits until the write has run (or was cancelled), since a
        copy would break the budget; without one, of a copy taken now, so training never
        waits for the disk. Every pending job must be run or cancelled. The caller holds
        the segment still (its lock) until this returns and fsyncs ``directory`` once the
        jobs are done.

        Raises OSError or a TierError, having cancelled its jobs; what it already put
        there stays for the caller to remove with the directory."""
        parts = self._consistent(run_id, segment_id, updates)
        return preserve_partitions(parts, self._ram.buffer, directory, name_of, in_place=self.enabled)

    def _consistent(self, run_id: str, segment_id: int, updates: int) -> list[Partition]:
        parts = self._segments[(run_id, segment_id)]
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
        totals = {Residency.RAM: 0, Residency.NVME: 0}
        with self._lock:
            segments = [
                (k, v)
                for k, v in self._segments.items()
                if run_id is None or (k[0] == run_id and segment_id in (None, k[1]))
            ]
        for _, parts in segments:
            for part in parts:
                totals[part.residency] += stored_bytes(part.state_dtype, part.span.numel)
        return totals

    def rows(self, run_id: str | None = None) -> list[PartitionRow]:
        """Every partition with the plan's decision and its place in the next stream."""
        with self._lock:
            segments = sorted((k, list(v)) for k, v in self._segments.items() if run_id in (None, k[0]))
            plan = self._plan
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
                    planned=plan.of(p.key),
                    actual=p.residency,
                    order=position[p.key.index],
                    updates=p.updates,
                    path=p.path if p.residency is Residency.NVME else "",
                )
                for p in parts
            ]
        return rows

    def summary(self) -> TierSummary:
        with self._lock:
            plan = self._plan
        nvme = self._nvme
        buffers = self._buffers.allocated_bytes if self._buffers is not None else 0
        return TierSummary(
            enabled=nvme is not None,
            ram_budget_bytes=self.config.ram_budget_bytes or 0,
            staging_bytes=self.staging_bytes,
            buffer_count=self.config.buffer_count if nvme is not None else 0,
            ram_used_bytes=self._ram.used_bytes + buffers + self._gradients.ram_bytes,
            planned_ram_bytes=plan.ram_bytes,
            planned_nvme_bytes=plan.nvme_bytes,
            predicted_io_seconds=plan.predicted_io_seconds,
            paths=tuple(p.root for p in nvme.paths) if nvme else (),
            direct_io=tuple(p.direct for p in nvme.paths) if nvme else (),
            bandwidth=tuple(p.measured() for p in nvme.paths) if nvme else (),
        )

    def _report_plan(self, plan: TierPlan) -> None:
        self._observer.set_tier_plan({r.value: plan.count(r) for r in Residency}, plan.predicted_io_seconds)

    def close(self) -> None:
        """Stop the I/O threads and delete this server's partition files."""
        if self._io is not None:
            self._io.shutdown()
        if self._nvme is not None:
            self._nvme.remove_runs()


def _then(future: Future[None], then: Callable[[BaseException | None], None], *, swallow: bool = False) -> Future[None]:
    """A future that completes after ``then`` has seen the outcome of ``future`` (a done
    callback alone could run after a waiter of ``future`` has woken)."""
    chained: Future[None] = Future()

    def settle(done: Future[None]) -> None:
        error = done.exception()
        try:
            then(error)
        except BaseException as failure:  # pragma: no cover - bookkeeping bug
            chained.set_exception(failure)
            return
        if error is not None and not swallow:
            chained.set_exception(error)
        else:
            chained.set_result(None)

    future.add_done_callback(settle)
    return chained
