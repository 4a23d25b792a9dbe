"""One segment's update as one value: what the worker's port builds, the transport encodes
(services/transport/codec.py, the same functions at both ends) and the state server's
segment state consumes (:meth:`SegmentState.update
<cargohold.services.segments.segment_state.SegmentState.update>`).

An update comes in one of three shapes, told apart by where its gradient is and whether
it carries the commit terms:

| shape | ``gradient`` | ``terms`` | RPC |
| --- | --- | --- | --- |
| stage: keep the gradient until the commit | in the call, or shared memory | None | PushGradient, ``defer_update`` |
| apply at once (no clipping, no non-finite check) | in the call, or shared memory | lr (norm 0) | PushGradient |
| commit what was staged | :data:`STAGED` | lr, global norm, loss scale | CommitStep |

and its weights come back one of three ways: not at all (stage), prepared in
``weights_dtype`` for the fetch that follows, or written in the same call into the
worker's shared memory (``weights_to``, a co-located worker). Which fields go together is
checked here, once, when the value is built, on either end of the wire.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from cargohold.services.core.errors import InvalidTensorError
from cargohold.services.core.wire import WIRE_DTYPES


def is_power_of_two(value: float) -> bool:
    """Whether ``value`` is 2**k for an integer k (negative k included)."""
    return math.isfinite(value) and value > 0 and math.frexp(value)[0] == 0.5


@dataclass(frozen=True, slots=True)
class SharedRef:
    """A place in a worker's shared memory: its region's path and a byte offset there."""

    path: str
    byte_offset: int


class GradientIn(Enum):
    """Where an update's gradient is, when not in shared memory."""

    CALL = "call"
    """Sent with the call: gRPC chunks, or the bulk socket."""
    STAGED = "staged"
    """Already on the server, kept by an earlier stage call."""


STAGED = GradientIn.STAGED
IN_CALL = GradientIn.CALL


@dataclass(frozen=True, slots=True, kw_only=True)
class CommitTerms:
    """What an applied update needs besides its gradient."""

    lr: float
    global_norm: float = 0.0
    """The whole model's gradient norm without the loss scale, for clipping (0: none)."""
    loss_scale: float = 1.0
    """The dynamic loss scale a staged gradient carries (fp16 compute), taken out before
    clipping; a power of two, so taking it out is exact."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lr) and self.lr >= 0.0):
            raise InvalidTensorError(f"lr must be finite and >= 0, got {self.lr}")
        if not (math.isfinite(self.global_norm) and self.global_norm >= 0.0):
            raise InvalidTensorError(f"global gradient norm must be finite and >= 0, got {self.global_norm}")
        if not is_power_of_two(self.loss_scale):
            raise InvalidTensorError(
                f"the loss scale must be a power of two (so that taking it out is exact), got {self.loss_scale}"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class UpdateCall:
    """Update number ``update`` of segment ``segment_id`` of ``run_id`` (see the module's
    table); raises InvalidTensorError when its fields do not go together."""

    run_id: str
    segment_id: int
    update: int
    numel: int
    """The segment's elements: the gradient's and the weights' length."""
    gradient: GradientIn | SharedRef
    terms: CommitTerms | None
    """None: stage the gradient only; the commit brings the terms."""
    weights_dtype: str | None = None
    """The dtype the update writes the new weights in (for a fetch, or ``weights_to``)."""
    weights_to: SharedRef | None = None
    """Where the weights after the update go in the same call (shared memory)."""

    def __post_init__(self) -> None:
        if self.terms is None and self.gradient is STAGED:
            raise InvalidTensorError(f"segment {self.segment_id}: a commit needs its terms (lr, norm, loss scale)")
        if self.terms is None and (self.weights_dtype is not None or self.weights_to is not None):
            raise InvalidTensorError(f"segment {self.segment_id}: a staged gradient brings no weights back")
        if self.terms is not None and self.terms.loss_scale != 1.0 and self.gradient is not STAGED:
            raise InvalidTensorError(f"segment {self.segment_id}: a loss scale comes with a commit only")
        if self.weights_dtype is not None and self.weights_dtype not in WIRE_DTYPES:
            raise InvalidTensorError(f"weight dtype {self.weights_dtype!r} is not one of {sorted(WIRE_DTYPES)}")
        if self.weights_to is not None and self.weights_dtype is None:
            raise InvalidTensorError(
                f"segment {self.segment_id}: the weights' destination (weights_out) needs their dtype (prepare_dtype)"
            )

    @property
    def stages(self) -> bool:
        """The call only keeps the gradient."""
        return self.terms is None

    @property
    def commits(self) -> bool:
        """The call applies a gradient staged earlier."""
        return self.gradient is STAGED
