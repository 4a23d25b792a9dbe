"""What a state server knows about its segments, without any transport: registration,
idempotent updates keyed by (run, segment, update number), gradients staged until the
step's global norm is known (kept by the tiers, :mod:`.tiers.gradients`), the AdamW call
of each update (:meth:`SegmentState._adamw`, one partition at a time as the tiers stream
them), and weight reads.

Every request is validated completely before any state changes, so a rejected request
leaves the segment exactly as it was.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator
from contextlib import closing

import torch

from cargohold.services.core.errors import (
    InvalidTensorError,
    UpdateMismatchError,
)
from cargohold.services.core.optim import (
    FragmentGroup,
    clip_coefficient,
    clip_fragments,
    inverse_scale,
    unscale_coefficient,
)
from cargohold.services.core.segment_spec import SegmentSpec, UpdateOutcome
from cargohold.services.core.settlement import SegmentStanding
from cargohold.services.core.state_precision import apply_update_stored
from cargohold.services.core.update_call import IN_CALL, STAGED, CommitTerms, GradientIn, UpdateCall
from cargohold.services.core.wire import WIRE_DTYPES
from cargohold.services.segments.weight_buffers import WeightBuffers
from cargohold.services.tiers.preserve import PreservedPartition
from cargohold.services.tiers.residency import PartitionKey, Residency
from cargohold.services.tiers.source import StateSource, tensor_source
from cargohold.services.tiers.storage import TieredStorage
from cargohold.services.tiers.stream import PartitionUpdate, StreamReport


class SegmentState:
    """fp32 master weights and Adam moments of one segment, updated under a lock.

    The arrays live in a :class:`TieredStorage` (the server's, or a private all-RAM one),
    split into partitions there when a RAM budget is set. The clip coefficient and the
    update count are per segment: computed once per update, whatever the partitions.

    An update comes one of two ways: :meth:`apply_gradient` at once (no clipping, no
    non-finite check), or :meth:`stage_gradient` during backward and :meth:`commit` with
    the step's global norm; either way :meth:`_update` loops over the partitions
    ``TieredStorage.update_partitions`` streams through memory and calls AdamW
    (:meth:`_adamw`) on each.
    """

    def __init__(
        self,
        spec: SegmentSpec,
        initial_weights: torch.Tensor | None = None,
        *,
        storage: TieredStorage | None = None,
        buffers: WeightBuffers | None = None,
        moments: tuple[torch.Tensor, torch.Tensor] | None = None,
        updates: int = 0,
        source: StateSource | None = None,
    ) -> None:
        """Starts from ``initial_weights``, or from ``source`` (a checkpoint read a
        partition at a time, so a restore fits the tiers' memory). ``moments``
        (exp_avg, exp_avg_sq) or a source, with ``updates``, restore a checkpointed
        segment; without them it starts fresh with no update applied. ``buffers``: where
        prepared weights are drawn from (the server's, shared by its segments)."""
        if (initial_weights is None) == (source is None):
            raise InvalidTensorError(
                f"segment {spec.segment_id}: give initial weights or a source, not both or neither"
            )
        if source is None:
            assert initial_weights is not None  # one of the two is given (checked above)
            _check_tensor(spec, initial_weights, torch.float32, "initial weights")
            for name, moment in zip(("exp_avg", "exp_avg_sq"), moments or ()):
                _check_tensor(spec, moment, torch.float32, name)
            source = tensor_source(
                initial_weights.detach().contiguous(),
                None if moments is None else (moments[0].detach().contiguous(), moments[1].detach().contiguous()),
            )
        if updates < 0:
            raise InvalidTensorError(f"segment {spec.segment_id}: updates must be >= 0, got {updates}")
        self.spec = spec
        self.lock = threading.Lock()
        self._storage = storage if storage is not None else TieredStorage()
        self._buffers = buffers if buffers is not None else WeightBuffers()
        self._storage.add_segment(
            spec.run_id,
            spec.segment_id,
            spec.numel,
            spec.fragments,
            source,
            updates=updates,
            gradient_itemsize=WIRE_DTYPES[spec.grad_dtype].itemsize,
            state_dtype=spec.state_dtype,
        )
        self._updates = updates
        self._staged = 0
        """The update whose gradient :meth:`stage_gradient` kept (0: none)."""
        self._last_terms: CommitTerms | None = None
        """The terms the last update was applied with (None: none since registration or
        restore), which settle a step a lost worker left part-committed."""
        self._groups = spec.fragment_groups()
        self._prepared: tuple[int, str, torch.Tensor] | None = None
        """(update, dtype, weights) that the latest update prepared, until fetched once;
        the weights are a buffer taken from ``_buffers``."""

    @property
    def updates(self) -> int:
        """The number of updates applied; weights read now are those after the last one."""
        return self._updates

    def standing(self) -> tuple[SegmentStanding, CommitTerms | None]:
        """Its update number, the update whose gradient is staged, and the terms of its
        last update (:mod:`~cargohold.services.core.settlement`)."""
        with self.lock:
            return SegmentStanding(self.spec.segment_id, self._updates, self._staged), self._last_terms

    @property
    def resident_bytes(self) -> int:
        """Bytes of this segment's state held in RAM."""
        return self._storage.state_bytes(self.spec.run_id, self.spec.segment_id)[Residency.RAM]

    def bytes_by_tier(self) -> dict[Residency, int]:
        return self._storage.state_bytes(self.spec.run_id, self.spec.segment_id)

    def update(
        self,
        call: UpdateCall,
        *,
        gradient: torch.Tensor | None = None,
        owned: bool = False,
        weights_out: torch.Tensor | None = None,
    ) -> UpdateOutcome:
        """Carry out ``call`` (services/core/update_call.py): stage its gradient, apply it at
        once, or commit the one staged for its update number. Idempotent by update
        number: a repeat of the last update applies nothing (but still writes
        ``weights_out``); a stage call for it is ignored.

        ``gradient``: the gradient a stage or apply call brings (the caller may reuse it
        once this returns); an fp32 one is used in place, not copied. ``owned``: the caller
        hands it over (a tensor the transport just assembled) and will not use it again, so
        clipping may scale it in place. ``weights_out`` (1-D, the segment's size, in the
        call's ``weights_dtype``, e.g. a co-located worker's shared memory): the update
        writes the new weights straight there. Without it, a call with a
        ``weights_dtype`` prepares them for the next :meth:`weights` in that dtype, while
        they stream through memory anyway.

        If the update stops part-way (a corrupt partition file, a failed write) the error
        propagates and the segment stays at the previous update; the same call again
        finishes the partitions that had not been updated.
        """
        self._check_call(call, gradient, weights_out)
        if gradient is not None and not call.stages and gradient.device != self._storage.device:
            gradient, owned = gradient.to(self._storage.device), True  # a GPU worker's device segment
        with self.lock:
            current = self._updates
            if call.stages:
                assert gradient is not None  # checked above
                if repeats_last_update(self.spec, current, call.update, verb="stages"):
                    return UpdateOutcome(applied=False, updates=current, seconds=0.0)
                self._staged = 0
                self._storage.stage_gradient(self.spec.run_id, self.spec.segment_id, call.update, gradient)
                self._staged = call.update
                return UpdateOutcome(applied=False, updates=call.update, seconds=0.0)
            if call.commits:
                if call.update == current and call.update > 0:
                    return self._repeated(call, weights_out)
                if self._staged != call.update or call.update != current + 1:
                    raise UpdateMismatchError(
                        f"segment {self.spec.segment_id} of run {self.spec.run_id!r} has no gradient staged for "
                        f"update {call.update} (it is at update {current}); stage it first (defer_update)"
                    )
            elif repeats_last_update(self.spec, current, call.update, verb="accepts"):
                return self._repeated(call, weights_out)
            outcome = self._update(call, gradient, owned=owned, weights_out=weights_out)
            self._staged = 0
            return outcome

    def _check_call(self, call: UpdateCall, gradient: torch.Tensor | None, weights_out: torch.Tensor | None) -> None:
        """Refuse a call that does not fit this segment, before anything changes."""
        spec = self.spec
        if (call.run_id, call.segment_id, call.numel) != (spec.run_id, spec.segment_id, spec.numel):
            raise InvalidTensorError(
                f"segment {spec.segment_id}: a call for segment {call.segment_id} of run {call.run_id!r} "
                f"with {call.numel} elements does not fit it"
            )
        if (gradient is None) != call.commits:
            raise InvalidTensorError(f"segment {spec.segment_id}: a commit brings no gradient; the other calls one")
        if gradient is not None:
            _check_tensor(spec, gradient, WIRE_DTYPES[spec.grad_dtype], "gradient")
        if weights_out is not None:
            if call.weights_dtype is None:
                raise InvalidTensorError(
                    f"segment {spec.segment_id}: the weights' destination needs their dtype (prepare_dtype)"
                )
            _check_tensor(spec, weights_out, WIRE_DTYPES[call.weights_dtype], "weights destination")

    def _call(self, update: int, gradient: GradientIn, terms: CommitTerms | None, dtype: str | None) -> UpdateCall:
        spec = self.spec
        return UpdateCall(
            run_id=spec.run_id,
            segment_id=spec.segment_id,
            update=update,
            numel=spec.numel,
            gradient=gradient,
            terms=terms,
            weights_dtype=dtype,
        )

    def apply_gradient(
        self,
        update: int,
        gradient: torch.Tensor,
        *,
        global_norm: float,
        lr: float,
        owned: bool = False,
        prepare: str | None = None,
        weights_out: torch.Tensor | None = None,
    ) -> UpdateOutcome:
        """:meth:`update` with a gradient applied at once (in-process callers and tests)."""
        call = self._call(update, IN_CALL, self._terms(lr=lr, global_norm=global_norm), prepare)
        return self.update(call, gradient=gradient, owned=owned, weights_out=weights_out)

    def stage_gradient(self, update: int, gradient: torch.Tensor) -> UpdateOutcome:
        """:meth:`update` with a gradient kept until :meth:`commit`."""
        return self.update(self._call(update, IN_CALL, None, None), gradient=gradient)

    def commit(
        self,
        update: int,
        *,
        global_norm: float,
        lr: float,
        prepare: str | None = None,
        loss_scale: float = 1.0,
        weights_out: torch.Tensor | None = None,
    ) -> UpdateOutcome:
        """:meth:`update` committing the gradient staged for ``update``; ``loss_scale``: the
        dynamic loss scale it was computed with (fp16 compute), taken out before clipping;
        ``global_norm`` is the norm without it."""
        terms = self._terms(lr=lr, global_norm=global_norm, loss_scale=loss_scale)
        return self.update(self._call(update, STAGED, terms, prepare), weights_out=weights_out)

    def _terms(self, **terms: float) -> CommitTerms:
        """The commit terms, refused naming this segment."""
        try:
            return CommitTerms(**terms)
        except InvalidTensorError as error:
            raise InvalidTensorError(f"segment {self.spec.segment_id}: {error}") from None

    def _update(
        self, call: UpdateCall, gradient: torch.Tensor | None, *, owned: bool, weights_out: torch.Tensor | None
    ) -> UpdateOutcome:
        """The update itself, under the lock; ``gradient`` None: the staged one."""
        assert call.terms is not None
        started = time.perf_counter()
        if self._prepared is not None:  # never fetched: its buffer goes back
            self._buffers.give(self._prepared[2])
            self._prepared = None
        prepare = call.weights_dtype
        out = weights_out  # the caller's destination, or a pooled buffer kept for the fetch
        if weights_out is None and prepare is not None:
            out = self._buffers.take(WIRE_DTYPES[prepare], self.spec.numel)
        pooled = out is not weights_out
        number = torch.tensor(float(call.update), dtype=torch.float32)
        coefficient = unscale_coefficient(
            clip_coefficient(call.terms.global_norm, self.spec.hyper.max_grad_norm),
            inverse_scale(call.terms.loss_scale),
        )
        report = StreamReport()
        partitions: Generator[PartitionUpdate] = self._storage.update_partitions(
            self.spec.run_id, self.spec.segment_id, call.update, gradient, gradient_owned=owned, report=report
        )
        try:
            with closing(partitions):  # an update that raises stops the stream, its I/O finished
                for partition in partitions:
                    self._adamw(partition, number=number, coefficient=coefficient, lr=call.terms.lr, weights_out=out)
        except BaseException:
            if pooled and out is not None:
                self._buffers.give(out)
            raise
        self._updates = call.update
        self._last_terms = call.terms
        if weights_out is not None:
            if report.resumed:  # the partitions updated before the failure were not written
                self._storage.read_weights(
                    self.spec.run_id, self.spec.segment_id, call.update, weights_out.dtype, out=weights_out
                )
        elif out is not None and prepare is not None and not report.resumed:
            self._prepared = (call.update, prepare, out)
        elif out is not None:  # a resumed update wrote only some partitions' weights
            self._buffers.give(out)
        return UpdateOutcome(applied=True, updates=call.update, seconds=time.perf_counter() - started)

    def _repeated(self, call: UpdateCall, weights_out: torch.Tensor | None) -> UpdateOutcome:
        """The outcome of an update repeated (under the lock): nothing applied, but the
        weights its caller asks for are written all the same."""
        if weights_out is not None and call.weights_dtype is not None:
            self._weights_locked(call.update, call.weights_dtype, weights_out)
        return UpdateOutcome(applied=False, updates=self._updates, seconds=0.0)

    def _adamw(
        self,
        partition: PartitionUpdate,
        *,
        number: torch.Tensor,
        coefficient: torch.Tensor | None,
        lr: float,
        weights_out: torch.Tensor | None,
    ) -> None:
        """AdamW on one partition of the segment, in place: the gradient piece cast to fp32
        and multiplied by the step's ``coefficient`` (clipping, and the inverse of an fp16
        run's loss scale), then torch's fused AdamW kernel over the
        partition's fragments, one call per param group
        (:func:`~cargohold.services.core.optim.apply_update`; with moments stored in bf16 or
        8 bits, decoded to fp32 around it a piece at a time,
        :func:`~cargohold.services.core.state_precision.apply_update_stored`). ``number``: the update number, torch's
        AdamW ``step``. With ``weights_out`` the new master weights are also
        written there in its dtype while they are in memory (the prepared weights)."""
        span = partition.span
        device = partition.state.master.device
        if number.device != device:  # a worker's device segments on a GPU: the kernel reads its scalars there
            number = number.to(device)
            coefficient = coefficient.to(device) if coefficient is not None else None
        if span.fragments:
            apply_update_stored(
                partition.state.master,
                partition.state.exp_avg,
                partition.state.exp_avg_sq,
                [
                    FragmentGroup(clip_fragments(group.fragments, span.start, span.stop), group.hyper, group.lr_scale)
                    for group in self._groups
                ],
                partition.gradient,
                step=number,
                coefficient=coefficient,
                lr=lr,
                owned=partition.owned,
            )
        if weights_out is not None:
            weights_out[span.start : span.stop].copy_(partition.state.master)

    def weights(self, update: int, dtype: str, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """A copy of the master weights after update ``update``, in a wire dtype; the
        caller is its only holder (hand it back with :meth:`recycle` when done). With
        ``out`` (a 1-D tensor of the segment's size and that dtype, e.g. a worker's shared
        memory) the copy is written there and ``out`` returned."""
        if dtype not in WIRE_DTYPES:
            raise InvalidTensorError(f"weight dtype {dtype!r} is not one of {sorted(WIRE_DTYPES)}")
        with self.lock:
            return self._weights_locked(update, dtype, out)

    def _weights_locked(self, update: int, dtype: str, out: torch.Tensor | None) -> torch.Tensor:
        """:meth:`weights`, under the lock."""
        current = self._updates
        if update != current:
            raise UpdateMismatchError(
                f"segment {self.spec.segment_id} of run {self.spec.run_id!r} holds the weights "
                f"of update {current}, not of update {update}"
            )
        prepared, self._prepared = self._prepared, None
        if prepared is not None and prepared[:2] != (update, dtype):
            self._buffers.give(prepared[2])
            prepared = None
        if prepared is not None:
            if out is None:
                return prepared[2]
            out.copy_(prepared[2])
            self._buffers.give(prepared[2])
            return out
        if out is not None:
            _check_tensor(self.spec, out, WIRE_DTYPES[dtype], "weights destination")
            return self._storage.read_weights(
                self.spec.run_id, self.spec.segment_id, update, WIRE_DTYPES[dtype], out=out
            )
        buffer = self._buffers.take(WIRE_DTYPES[dtype], self.spec.numel)
        try:
            return self._storage.read_weights(
                self.spec.run_id, self.spec.segment_id, update, WIRE_DTYPES[dtype], out=buffer
            )
        except BaseException:
            if buffer is not None:
                self._buffers.give(buffer)
            raise

    def recycle(self, weights: torch.Tensor) -> None:
        """Hand back a tensor :meth:`weights` returned, once nothing reads it any more
        (the server, after the last chunk of a fetch is built), for the next update or
        read to write into; a tensor that is not one of the server's buffers is left
        alone (simply freed)."""
        self._buffers.give(weights)

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Copies of master, exp_avg and exp_avg_sq (for tests and checkpoints)."""
        with self.lock:
            return self._storage.snapshot(self.spec.run_id, self.spec.segment_id, self._updates)

    def master_weights(self) -> torch.Tensor:
        """A new fp32 copy of the master weights, read a partition at a time; unlike
        :meth:`weights` it leaves what the next push prepares alone (export)."""
        with self.lock:
            return self._storage.read_weights(self.spec.run_id, self.spec.segment_id, self._updates, torch.float32)

    def preserve(self, directory: str, name_of: Callable[[PartitionKey], str]) -> tuple[int, list[PreservedPartition]]:
        """Put the segment's partition files into ``directory`` (see
        :meth:`TieredStorage.preserve`); returns the update count they hold too."""
        with self.lock:
            updates = self._updates
            return updates, self._storage.preserve(self.spec.run_id, self.spec.segment_id, updates, directory, name_of)


def repeats_last_update(spec: SegmentSpec, current: int, update: int, *, verb: str) -> bool:
    """True when ``update`` repeats the update the segment already applied (to be
    ignored); raises UpdateMismatchError unless it is the next one."""
    if update == current and update > 0:
        return True
    if update != current + 1:
        raise UpdateMismatchError(
            f"segment {spec.segment_id} of run {spec.run_id!r} is at update {current}; "
            f"it {verb} a gradient for update {current + 1}, got update {update}"
        )
    return False


def _check_tensor(spec: SegmentSpec, tensor: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    if tensor.dtype != dtype:
        raise InvalidTensorError(f"segment {spec.segment_id}: {what} must be {dtype}, got {tensor.dtype}")
    if tensor.dim() != 1 or tensor.numel() != spec.numel:
        raise InvalidTensorError(
            f"segment {spec.segment_id}: {what} must have {spec.numel} elements, got shape {tuple(tensor.shape)}"
        )
