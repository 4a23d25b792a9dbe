"""Gradients that arrived before the step's global norm: held until CommitStep.

Workers ship each bucket's gradient while backward still runs; with clipping on, no
update can start before every shard's contribution to the global norm is known. The
staged gradient waits here, validated, and is applied by the shard exactly once.
"""

from __future__ import annotations

import threading

import torch

from cargohold.services.dtypes import WIRE_DTYPES
from cargohold.services.errors import InvalidTensorError, StepMismatchError
from cargohold.services.segment_state import SegmentState, UpdateOutcome, repeats_last_update


class GradientStaging:
    """At most one staged gradient per shard: the one for the shard's next step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._staged: dict[tuple[str, int], tuple[int, torch.Tensor]] = {}
        self._spares: dict[tuple[str, int], torch.Tensor] = {}
        """Per shard that stages borrowed gradients: last step's copy, reused for the next
        (a fresh allocation's page faults cost as much as the copy itself)."""

    def stage(
        self, state: SegmentState, update: int, gradient: torch.Tensor, *, borrowed: bool = False
    ) -> UpdateOutcome:
        """Hold ``gradient`` for update ``update``; one for the already applied update is ignored.
        ``borrowed``: the caller's buffer (shared memory the worker reuses), so keep a copy."""
        spec = state.spec
        if gradient.dtype != WIRE_DTYPES[spec.grad_dtype] or gradient.numel() != spec.numel:
            raise InvalidTensorError(
                f"shard {spec.segment_id}: gradient must be {spec.numel} x {spec.grad_dtype}, "
                f"got {gradient.numel()} x {gradient.dtype}"
            )
        current = state.updates
        if repeats_last_update(spec, current, update, verb="stages"):
            return UpdateOutcome(applied=False, updates=current, seconds=0.0)
        key = (spec.run_id, spec.segment_id)
        if borrowed:
            with self._lock:
                spare = self._spares.pop(key, None)
            if spare is None or spare.dtype != gradient.dtype or spare.numel() != gradient.numel():
                spare = torch.empty_like(gradient)
            gradient = spare.copy_(gradient)
        with self._lock:
            self._staged[key] = (update, gradient)
            if borrowed:
                self._spares.setdefault(key, torch.empty(0))  # marks the shard as reusing
        return UpdateOutcome(applied=False, updates=update, seconds=0.0)

    def commit(
        self, state: SegmentState, update: int, *, global_norm: float, lr: float, prepare: str | None = None
    ) -> UpdateOutcome:
        """Apply the gradient staged for ``update``; repeating a commit is harmless.
        ``prepare`` as in :meth:`SegmentState.apply_gradient`."""
        spec = state.spec
        key = (spec.run_id, spec.segment_id)
        with self._lock:
            staged = self._staged.get(key)
        if staged is None or staged[0] != update:
            if update == state.updates and update > 0:
                return UpdateOutcome(applied=False, updates=update, seconds=0.0)
            raise StepMismatchError(
                f"shard {spec.segment_id} of run {spec.run_id!r} has no gradient staged for step "
                f"{update} (it is at step {state.updates}); push it with defer_update first"
            )
        # Not handed over (owned=False): a commit retried after a failed write passes the
        # same tensor again, so clipping must not scale it in place.
        outcome = state.apply_gradient(update, staged[1], global_norm=global_norm, lr=lr, prepare=prepare)
        with self._lock:
            if self._staged.get(key, (None,))[0] == update:
                del self._staged[key]
                if key in self._spares:
                    self._spares[key] = staged[1]
        return outcome
