"""The values both ends of the update path share about a segment: what a server must know
to own it (:class:`SegmentSpec`, sent once at registration) and what an update did
(:class:`UpdateOutcome`)."""

from __future__ import annotations

from dataclasses import dataclass

from cargohold.services.core.errors import InvalidTensorError, SegmentConflictError
from cargohold.services.core.optim import AdamWHyperParams, FragmentGroup, UpdateGroup, fragment_groups
from cargohold.services.core.state_precision import STATE_DTYPES, StateDtype
from cargohold.services.core.wire import WIRE_DTYPES


@dataclass(frozen=True, slots=True, kw_only=True)
class SegmentSpec:
    """Everything a server must know to own one segment of the flat parameter buffer."""

    run_id: str
    segment_id: int
    start: int
    """First element of the segment in the flat buffer (informational, for stats)."""
    numel: int
    fragments: tuple[tuple[int, int], ...]
    """(offset, length) of each run of real parameter elements inside the segment."""
    grad_dtype: str
    hyper: AdamWHyperParams
    groups: tuple[UpdateGroup, ...] = ()
    """The param groups among the fragments, each with its weight decay and lr multiplier;
    empty: one, with ``hyper.weight_decay`` at the pushed lr."""
    fragment_group: tuple[int, ...] = ()
    """Each fragment's index in ``groups`` (empty with them)."""
    state_dtype: StateDtype = "float32"
    """How the segment's moments are stored (``optim.state_dtype``,
    :mod:`cargohold.services.core.state_precision`); the master weights are fp32 in every kind."""

    def __post_init__(self) -> None:
        if not self.run_id:
            raise InvalidTensorError("run_id must not be empty")
        if self.state_dtype not in STATE_DTYPES:
            raise InvalidTensorError(
                f"segment {self.segment_id}: state dtype {self.state_dtype!r} is not one of {', '.join(STATE_DTYPES)}"
            )
        if self.numel <= 0:
            raise InvalidTensorError(f"segment {self.segment_id}: numel must be > 0, got {self.numel}")
        if self.grad_dtype not in WIRE_DTYPES:
            raise InvalidTensorError(
                f"segment {self.segment_id}: grad dtype {self.grad_dtype!r} is not one of {sorted(WIRE_DTYPES)}"
            )
        end = 0
        for offset, length in self.fragments:
            if offset < end or length <= 0 or offset + length > self.numel:
                raise InvalidTensorError(
                    f"segment {self.segment_id}: fragment ({offset}, {length}) overlaps, is empty "
                    f"or leaves the segment of {self.numel} elements"
                )
            end = offset + length
        if len(self.fragment_group) != (len(self.fragments) if self.groups else 0) or any(
            not 0 <= g < len(self.groups) for g in self.fragment_group
        ):
            raise InvalidTensorError(
                f"segment {self.segment_id}: fragment groups {self.fragment_group} do not name one of the "
                f"{len(self.groups)} param groups for each of the {len(self.fragments)} fragments"
            )

    def fragment_groups(self) -> tuple[FragmentGroup, ...]:
        """The fragments as the update's kernel calls, one per param group."""
        return fragment_groups(self.fragments, self.hyper, self.groups, self.fragment_group)


def check_same_spec(held: SegmentSpec, asked: SegmentSpec) -> None:
    """Refuse a segment registered (or joined) again with another specification."""
    if held != asked:
        raise SegmentConflictError(
            f"segment {asked.segment_id} of run {asked.run_id!r} is already registered with a different specification"
        )


@dataclass(frozen=True, slots=True)
class UpdateOutcome:
    applied: bool
    """False when the gradient repeated an already applied update and was ignored."""
    updates: int
    """The segment's update count after the call."""
    seconds: float
    """Time spent in the update (0 for an ignored repeat)."""
