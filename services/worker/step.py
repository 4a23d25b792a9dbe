"""One worker's training step over an FSDP2-sharded model, independent of Ray and of the
transport (the state servers are reached through a :class:`StatePort`).

Forward and backward; FSDP2's all-reduce hook hands over each unit's reduced chunks,
which are copied into an exchange slot (:class:`ExchangeBuffers`, a few unit-sized ones)
and pushed at once while backward goes on (with several micro-batches, summed in an
:class:`Accumulator` and pushed with the last one); FSDP2's own sharded gradients are
dropped. One all-reduce of (sum of squares, loss) gives the global norm. The update is
*immediate* (applied on arrival, the weights fetched during backward), *staged* (commit
with the norm, then fetch) or *delayed* (ZeRO-Offload's DPU: adopt the previous update's
weights, this one's arriving during the next step). Fetched weights are copied into the
unit's local shards at once. docs/architecture.md ("A step, in order") tells it whole.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from cargohold.services.core.errors import TrainingError
from cargohold.services.core.layout import Layout, Segment
from cargohold.services.core.loss_scale import LossScaleState, next_state
from cargohold.services.core.optim import global_norm_from_squares, sum_of_squares
from cargohold.services.core.update_call import CommitTerms
from cargohold.services.core.wire import DTYPE_NAMES, check_representable
from cargohold.services.worker.accumulation import Accumulator
from cargohold.services.worker.sharding import (
    ParamCopies,
    Unit,
    divisor_after_reduce_hook,
    drop_grad,
    local_tensors,
    padding_gaps,
    params_to_range,
)
from cargohold.services.worker.state_port import ExchangeBuffers, ExchangeSlot, StatePort, copies_done_event
from cargohold.services.worker.step_policy import StepPolicy
from cargohold.services.worker.step_report import StepReport
from cargohold.services.worker.task import BatchLoss, ParameterValues, model_loss, scalar_loss
from cargohold.services.worker.weight_window import WeightWindow


class ShardedStep:
    """Trains one worker's shard of ``model`` (already ``fully_shard``-ed by ``units``)."""

    def __init__(
        self,
        model: nn.Module,
        units: list[Unit],
        layout: Layout,
        rank: int,
        port: StatePort,
        buffers: ExchangeBuffers,
        policy: StepPolicy,
        *,
        device: torch.device,
        loss: BatchLoss = model_loss,
        window: WeightWindow | None = None,
    ) -> None:
        """``loss``: the scalar loss of one micro-batch (the model's own by default);
        ``window``: the blocks' weights live in files on NVMe and come into memory through it."""
        if policy.delayed_after is not None and buffers.held is None:
            raise TrainingError("the delayed update needs exchange buffers with the held weights of the whole range")
        if policy.loss_scale is not None and not (policy.staged and policy.nonfinite == "skip"):
            raise TrainingError("a dynamic loss scale needs the staged update that skips non-finite steps")
        self.model = model
        self.units = units
        self.layout = layout
        self.rank = rank
        self.port = port
        self.buffers = buffers
        self.policy = policy
        self.device = device
        self.loss = loss
        self.window = window
        self.world_size = layout.num_workers
        self.updates = 0
        """Updates the servers applied; set by :meth:`register` or :meth:`join`."""
        self.loss_scale = LossScaleState(policy.loss_scale.init_scale) if policy.loss_scale is not None else None
        """fp16 compute: where the dynamic loss scale stands (the same on every worker);
        a resume sets it from the checkpoint."""
        self.segments = layout.segments_of_worker(rank)
        self._by_unit: dict[int, list[Segment]] = {}
        for segment in self.segments:
            self._by_unit.setdefault(segment.unit, []).append(segment)
        self._pool = ThreadPoolExecutor(max_workers=max(1, min(16, len(self.segments))), thread_name_prefix="state")
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        """Where fetched weights go host-to-device, beside the compute."""
        self._pending: list[Future] = []
        """Fetches of a delayed update, still arriving."""
        self._commits: dict[int, Future] = {}
        """A staged delayed update's CommitStep per segment id, still running: a segment's
        next push waits for it (a server stages one gradient per segment)."""
        self._transfers: list[Future] = []
        self._settling: dict[int, Future] = {}
        """The staged update's commit, fetch and adoption of each unit, still running when
        :meth:`run` returned: the unit's forward in the next step waits for its own (a
        pre-forward hook), so the update overlaps the units before it, with the same bits."""
        self._waited = 0.0
        """Seconds this step's forward waited for the previous update's units (its phases
        count them as update, not compute)."""
        self._sum_squares = 0.0
        self._context: tuple[int, float, bool, bool] = (0, 0.0, False, False)
        """(update, lr, defer, fetch) of the step in progress, for the hooks."""
        self._micro = (0, 1)
        """(micro-batch, micro-batches) of the backward in progress, for the hooks."""
        self._accumulator: Accumulator | None = None
        """The micro-batches' summed gradients; allocated by the first step that has several."""
        with torch.no_grad():
            self._targets = local_tensors(model, layout)
        self._copies = ParamCopies.of(layout, rank)
        """Each parameter's local chunk, FSDP2's storage for it (the same tensors for the
        model's life): looked up once, not per unit and step (a DTensor's ``to_local`` costs
        Python time, ~50 ms a step on the demo when done per unit)."""
        for index, unit in enumerate(units):
            cast(FSDPModule, unit.module).set_all_reduce_hook(self._on_reduced(index))
            # Before FSDP2's own pre-forward hook (prepended when it was applied), which gathers the unit.
            unit.module.register_forward_pre_hook(self._before_forward(index), prepend=True)
        for param in model.parameters():
            param.register_post_accumulate_grad_hook(drop_grad)

    # --- start --------------------------------------------------------------------
    def register(self, values: ParameterValues) -> int:
        """Fill the local shards from ``values``, a unit at a time, and register each
        unit's segments with its fp32 values; returns the servers' update count."""
        targets = self._targets
        compute_dtype = DTYPE_NAMES[targets[0].dtype]
        updates = set()
        for unit in self.layout.units:
            initial = torch.zeros(unit.stop - unit.start, dtype=torch.float32)
            first = unit.first_param
            places = {
                place.name: (index, place) for index, place in enumerate(self.layout.unit_params(unit.index), first)
            }
            with torch.no_grad():
                for name, value in values(places):
                    check_representable(name, value, compute_dtype)
                    index, place = places[name]
                    lo, hi = place.local_rows(self.rank)
                    chunk = value.reshape(place.rows, -1)[lo:hi].reshape(-1)
                    at = place.offset - unit.start
                    initial[at : at + chunk.numel()] = chunk
                    if not self._on_disk(unit.index):
                        targets[index].copy_(chunk)
            if self.window is not None and self._on_disk(unit.index):
                self.window.write(unit.index, initial.to(targets[0].dtype))
            for segment in self._by_unit.get(unit.index, []):
                at = segment.local_offset - unit.start
                updates.add(self.port.register(segment, initial[at : at + segment.numel]))
        return self._at_update(updates)

    def join(self) -> int:
        """The update count of the segments their holders already have (a restore, a live
        recovery), drawing and sending no initial values: :meth:`load_weights` brings the
        weights."""
        return self._at_update({self.port.join(segment) for segment in self.segments})

    def _at_update(self, updates: set[int]) -> int:
        if len(updates) > 1:
            raise TrainingError(f"rank {self.rank}: its segments are at different updates {sorted(updates)}")
        self.updates = updates.pop() if updates else 0
        return self.updates

    def load_weights(self) -> None:
        """Fetch the servers' current weights (after a restore) into the local shards."""
        self._wait(self._pool.submit(self._settle_unit, unit, self.updates) for unit in self._by_unit)

    # --- the step -----------------------------------------------------------------
    def run(
        self, step: int, batches: Sequence[Any], lr: float, *, dropout_seeds: Sequence[int] | None = None
    ) -> StepReport:
        """One step on this worker's micro-batches of data step ``step``, their gradients
        summed into one update. Each micro-batch's mean loss is scaled by its
        :attr:`~cargohold.services.data.batches.Batch.weight` over the number of
        micro-batches, so that the ranks' mean of the sum is the step's mean over its
        counted tokens (one micro-batch of weight 1.0 is not scaled at all).
        ``dropout_seeds``: torch's seed before each micro-batch's forward."""
        if not batches:
            raise TrainingError(f"step {step}: no micro-batch to train on")
        if dropout_seeds is not None and len(dropout_seeds) != len(batches):
            raise TrainingError(f"step {step}: {len(dropout_seeds)} dropout seeds for {len(batches)} micro-batches")
        phases: dict[str, float] = {}
        started = mark = time.perf_counter()

        def lap(phase: str) -> None:
            nonlocal mark
            now = time.perf_counter()
            phases[phase] = now - mark
            mark = now

        policy = self.policy
        loss_scale = self.loss_scale.scale if self.loss_scale is not None else 1.0
        scale_tensor = torch.tensor(loss_scale, dtype=torch.float32, device=self.device)
        update, delayed = self.updates + 1, policy.delayed(step)
        self._context = (update, lr, policy.staged, not policy.staged and not delayed)
        self._sum_squares, self._transfers, self._waited = 0.0, [], 0.0
        step_loss = self._backward_all(step, batches, dropout_seeds, scale_tensor)
        self._await_settled()  # a unit no forward reached (none in the models here)
        lap("compute")
        phases["compute"] -= self._waited

        applied = sum(self._wait(self._transfers))
        totals = torch.tensor([self._sum_squares, step_loss], dtype=torch.float64, device=self.device)
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
        global_norm = global_norm_from_squares(float(totals[0])) / loss_scale  # exact: a power of two
        mean_loss = float(totals[1]) / self.world_size
        lap("reduce")

        skipped = policy.skips(step, global_norm, loss_scale if self.loss_scale is not None else None)
        if self.loss_scale is not None and policy.loss_scale is not None:
            self.loss_scale = next_state(self.loss_scale, policy.loss_scale, found_inf=skipped)
        terms = None
        if skipped:
            applied = self._adopt_pending()  # the staged gradients are replaced by the next push
        else:
            terms = CommitTerms(global_norm=global_norm, lr=lr, loss_scale=loss_scale) if policy.staged else None
            applied = self._update(update, delayed, terms, applied)
        lap("update")
        phases["update"] += self._waited
        return StepReport(
            rank=self.rank,
            step=step,
            loss=mean_loss,
            global_grad_norm=global_norm,
            seconds=time.perf_counter() - started,
            phases=phases,
            applied=applied,
            skipped=skipped,
            loss_scale=loss_scale if self.loss_scale is not None else None,
            terms=terms,
        )

    def _backward_all(
        self, step: int, batches: Sequence[Any], dropout_seeds: Sequence[int] | None, scale_tensor: torch.Tensor
    ) -> float:
        """Forward and backward of every micro-batch (the hooks push as backward goes);
        returns the sum of their (weighted) losses."""
        count, step_loss = len(batches), 0.0
        if count > 1 and self._accumulator is None:
            self._accumulator = Accumulator(self.layout.worker_size, pin=self.device.type == "cuda")
        for micro, batch in enumerate(batches):
            self._micro = (micro, count)
            if dropout_seeds is not None:
                torch.manual_seed(dropout_seeds[micro])  # CPU and every GPU
            if self.window is not None:
                self.window.begin(backward=True)
            loss = self._loss_of(batch, count, step)
            (loss * scale_tensor if self.loss_scale is not None else loss).backward()  # as GradScaler.scale
            step_loss += float(loss.detach())
        return step_loss

    def _update(self, update: int, delayed: bool, terms: CommitTerms | None, applied: int) -> int:
        """After the step's gradients are pushed: commit them with ``terms`` (staged
        updates; None: the pushes applied them), now or during the next step
        (``delayed``), and bring the weights back; returns the updates applied
        (``applied``: those the pushes applied already)."""
        if delayed:
            applied = self._adopt_pending()
            if terms is not None:  # CommitStep runs during the next step's compute, its weights into the held range
                self._commits = {
                    s.segment_id: self._pool.submit(
                        self.port.update, s, update, gradient=None, terms=terms, out=self._held(s)
                    )
                    for s in self.segments
                }
                self._pending = list(self._commits.values())
            else:
                self._pending = [self._pool.submit(self.port.fetch, s, update, self._held(s)) for s in self.segments]
            self.updates = update
            return applied
        if terms is not None:
            settling = {unit: self._pool.submit(self._settle_unit, unit, update, terms) for unit in self._by_unit}
            if self.window is None:  # each unit's forward of the next step waits for its own
                self._settling = settling
                applied = len(self.segments)
            else:  # the window reads the blocks' files ahead of forward: they must be written first
                applied = sum(self._wait(settling.values()))
        self.updates = update
        return applied

    def evaluate(self, batches: Iterable[Any], count: int) -> float:
        """The mean loss over ``count`` held-out batches (forward only, dropout off, on the
        weights the next step computes on), identical on every rank. It is averaged as a
        step of ``count`` micro-batches is: each batch's mean loss scaled by its weight
        over ``count``, summed, all-reduced over the ranks and divided by W, so that it
        is the mean over the held-out set's counted tokens."""
        total = 0.0
        self._await_settled()
        self.model.eval()
        try:
            with torch.no_grad():
                for batch in batches:
                    if self.window is not None:
                        self.window.begin(backward=False)
                    loss = self._loss_of(batch, count, None)
                    total += float(loss)
        finally:
            self.model.train()
        summed = torch.tensor([total], dtype=torch.float64, device=self.device)
        dist.all_reduce(summed, op=dist.ReduceOp.SUM)
        return float(summed[0]) / self.world_size

    def _loss_of(self, batch: Any, count: int, step: int | None) -> torch.Tensor:
        """``batch``'s loss scaled by its weight over ``count`` (a scale of 1.0 leaves the
        graph, and every bit, as it was); ``step`` None: in an evaluation."""
        loss = scalar_loss(self.loss(self.model, batch, self.device), step)
        scale = batch.weight / count
        return loss * scale if scale != 1.0 else loss

    def _before_forward(self, unit: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if (settling := self._settling.pop(unit, None)) is not None:
                waiting = time.perf_counter()
                settling.result()
                self._waited += time.perf_counter() - waiting

        return hook

    def _await_settled(self) -> None:
        """Wait for every unit's overlapped update (before anything reads the weights)."""
        settling, self._settling = self._settling, {}
        self._wait(settling.values())

    def _on_reduced(self, unit: int) -> Callable[[torch.Tensor], None]:
        """FSDP2's hook after the reduce-scatter of unit ``unit``: ``reduced`` holds this
        worker's padded chunk of each of the unit's parameters, back to back."""
        places = self.layout.unit_params(unit)
        base, stop = self.layout.units[unit].start, self.layout.units[unit].stop
        # (offset, elements) of each chunk in the exchange slot: read no layout per step
        spans = [(place.offset - base, place.padded_numel) for place in places]
        expected = sum(numel for _, numel in spans)
        gaps = padding_gaps(places, base, stop)

        def hook(reduced: torch.Tensor) -> None:
            if reduced.numel() != expected:
                raise TrainingError(
                    f"unit {self.units[unit].name or '<root>'!r}: FSDP2 reduced {reduced.numel()} "
                    f"gradient elements, the layout expects {expected}"
                )
            if self.window is not None:
                self.window.release_backward(unit)
            if (divisor := divisor_after_reduce_hook(reduced.dtype, reduced.device.type)) is not None:
                # FSDP2's last division of the average comes after this hook: done here, in
                # place, it gives what is pushed FSDP2's bits; FSDP2's own then lands on the
                # sharded .grad views, which are dropped unread (drop_grad).
                reduced.div_(divisor)
            micro, count = self._micro
            if micro < count - 1:
                assert self._accumulator is not None
                self._accumulator.add(places, reduced, first=micro == 0)
                return
            slot = self.buffers.acquire()
            try:
                if count > 1:
                    assert self._accumulator is not None
                    self._accumulator.total_into(places, reduced, slot.grads, base)
                else:
                    at = 0
                    for lo, numel in spans:
                        slot.grads[lo : lo + numel].copy_(reduced[at : at + numel], non_blocking=True)
                        at += numel
                for lo, hi in gaps:
                    slot.grads[lo:hi].zero_()
                self._sum_squares += sum_of_squares(reduced if count == 1 else slot.grads[: stop - base])
                ready = copies_done_event(self.device)
                update, lr, defer, fetch = self._context
                self._transfers.append(self._pool.submit(self._exchange, unit, slot, update, lr, defer, fetch, ready))
            except BaseException:
                self.buffers.release(slot)
                raise

        return hook

    # --- transfers (on the pool) --------------------------------------------------
    def _exchange(
        self,
        unit: int,
        slot: ExchangeSlot,
        update: int,
        lr: float,
        defer: bool,
        fetch: bool,
        ready: torch.cuda.Event | None,
    ) -> int:
        """Push the gradient of unit ``unit`` from ``slot``; with ``fetch``, bring its
        updated weights back into the local shards. Gives the slot back."""
        try:
            if ready is not None:
                ready.synchronize()
            applied = 0
            for segment in self._by_unit.get(unit, []):
                if (committing := self._commits.get(segment.segment_id)) is not None:
                    committing.result()  # submitted before this push: running or done, never queued behind it
                at = self._in_slot(segment)
                out = slot.weights[at] if fetch else None  # the weights after the update, in the same call
                terms = None if defer else CommitTerms(lr=lr)  # applied at once: no clipping
                applied += self.port.update(segment, update, gradient=slot.grads[at], terms=terms, out=out)
            if fetch:
                self._adopt(slot.weights, unit)
            return applied
        finally:
            self.buffers.release(slot)

    def _settle_unit(self, unit: int, update: int, commit: CommitTerms | None = None) -> int:
        """Fetch the weights of unit ``unit`` after ``update`` into its local shards; with
        ``commit`` (its terms), first apply the gradients the servers staged."""
        slot = self.buffers.acquire()
        try:
            applied = 0
            for segment in self._by_unit[unit]:
                out = slot.weights[self._in_slot(segment)]
                if commit is not None:  # the weights come back in the commit's call
                    applied += self.port.update(segment, update, gradient=None, terms=commit, out=out)
                else:
                    self.port.fetch(segment, update, out)
            self._adopt(slot.weights, unit)
            return applied
        finally:
            self.buffers.release(slot)

    def _held(self, segment: Segment) -> torch.Tensor:
        """Where a delayed update's weights of ``segment`` arrive: its part of the held range."""
        assert self.buffers.held is not None
        return self.buffers.held[segment.local_offset : segment.local_offset + segment.numel]

    def _in_slot(self, segment: Segment) -> slice:
        at = segment.local_offset - self.layout.units[segment.unit].start
        return slice(at, at + segment.numel)

    @staticmethod
    def _wait(futures: Iterable[Future]) -> list:
        return [future.result() for future in list(futures)]

    # --- weights ------------------------------------------------------------------
    def _adopt(self, source: torch.Tensor, unit: int | None = None) -> None:
        """Put fetched weights where the next step reads them: those of unit ``unit`` from a
        slot, or the whole range from the held buffer. A unit's chunks in memory are
        copied into; a block whose weights live on NVMe has its file written."""
        start = 0 if unit is None else self.layout.units[unit].start
        units = range(len(self.layout.units)) if unit is None else [unit]
        targets = self._targets
        for index in units:
            if self.window is not None and self._on_disk(index):
                placed = self.layout.units[index]
                self.window.write(index, source[placed.start - start : placed.stop - start])
                continue
            with torch.no_grad(), torch.cuda.stream(self._copy_stream):
                self._copies.into_params(source, targets, index, source_start=start)
        if self._copy_stream is not None:
            self._copy_stream.synchronize()

    def _on_disk(self, unit: int) -> bool:
        """Whether the weights of unit ``unit`` live in a file (every block with a weight window)."""
        return self.window is not None and unit > 0

    def _adopt_pending(self) -> int:
        """Wait for a delayed update's weights, if one is in flight, and adopt them."""
        if not self._pending:
            return 0
        pending, self._pending = self._pending, []
        self._wait(pending)
        self._commits = {}  # the commits are among them, done
        assert self.buffers.held is not None
        self._adopt(self.buffers.held)
        return len(pending)

    def settle(self, timeout: float | None = None) -> None:
        """Wait for an update still in flight (the overlapped one, or a delayed one),
        keeping the weights the next step computes on (before a checkpoint, or shutdown).
        A failure stays with its future, raised where the weights are used."""
        for future in [*self._settling.values(), *self._pending]:
            future.exception(timeout=timeout)

    def newest_weights(self) -> torch.Tensor:
        """This worker's range of the newest weights (a delayed update adopted first)."""
        self._await_settled()
        self._adopt_pending()
        out = torch.zeros(self.layout.worker_size, dtype=self.buffers.slots[0].weights.dtype)
        with torch.no_grad():
            sources = [t.to("cpu") for t in self._targets]
            for unit in self.layout.units:
                if self.window is not None and self._on_disk(unit.index):
                    self.window.read(unit.index, out[unit.start : unit.stop])
                else:
                    params_to_range(self.layout, self.rank, sources, out, unit=unit.index)
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self.window is not None:
            self.window.close()
