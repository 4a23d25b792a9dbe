"""All segments a state server (or a worker, for its device segments) owns, keyed by
(run id, segment id), over one tiered storage and one bounded set of weight buffers:
registration, restore, and the moves between tiers a registration's new plan asks for."""

from __future__ import annotations

import threading

import torch

from cargohold.services.core.errors import SegmentConflictError, UnknownSegmentError
from cargohold.services.core.segment_spec import SegmentSpec, check_same_spec
from cargohold.services.segments.segment_state import SegmentState
from cargohold.services.segments.weight_buffers import WeightBuffers
from cargohold.services.tiers.residency import Residency
from cargohold.services.tiers.source import StateSource
from cargohold.services.tiers.storage import TieredStorage


class SegmentRegistry:
    """All segments a server owns, keyed by (run id, segment id), over one tiered storage and
    one bounded set of weight buffers."""

    def __init__(self, storage: TieredStorage | None = None, buffers: WeightBuffers | None = None) -> None:
        self._lock = threading.Lock()
        self._registering = threading.Lock()
        """Serialises registrations, which may write partition files, without holding
        ``_lock`` (and so every other segment's lookups) meanwhile."""
        self._segments: dict[tuple[str, int], SegmentState] = {}
        self.storage = storage if storage is not None else TieredStorage()
        self.buffers = buffers if buffers is not None else WeightBuffers()

    def register(self, spec: SegmentSpec, initial_weights: torch.Tensor) -> SegmentState:
        """Create the segment, or return it unchanged if registered with the same spec."""
        key = (spec.run_id, spec.segment_id)
        with self._registering:
            with self._lock:
                existing = self._segments.get(key)
            if existing is not None:
                check_same_spec(existing.spec, spec)
                return existing
            state = SegmentState(spec, initial_weights, storage=self.storage, buffers=self.buffers)
            with self._lock:
                self._segments[key] = state
            self._settle()
            return state

    def restore(self, spec: SegmentSpec, source: StateSource, updates: int) -> SegmentState:
        """Create a segment from checkpointed master weights and moments after ``updates``, read
        from ``source`` a partition at a time."""
        key = (spec.run_id, spec.segment_id)
        with self._registering:
            with self._lock:
                if key in self._segments:
                    raise SegmentConflictError(
                        f"segment {spec.segment_id} of run {spec.run_id!r} is already registered; "
                        "restore into a fresh state server"
                    )
            state = SegmentState(spec, storage=self.storage, buffers=self.buffers, source=source, updates=updates)
            with self._lock:
                self._segments[key] = state
            self._settle()
            return state

    def _settle(self) -> None:
        """Move every partition to the tier the plan wants now that a registration has
        re-planned the server, demotions first so that promotions find room in RAM; each
        segment with partitions to move is held still (its lock) while they move."""
        keys = self.storage.unsettled()
        with self._lock:
            unsettled = [self._segments[key] for key in keys if key in self._segments]
        for into in (Residency.NVME, Residency.RAM):
            for state in unsettled:
                with state.lock:
                    self.storage.settle(state.spec.run_id, state.spec.segment_id, into=into)

    def get(self, run_id: str, segment_id: int) -> SegmentState:
        with self._lock:
            state = self._segments.get((run_id, segment_id))
        if state is None:
            raise UnknownSegmentError(f"no segment {segment_id} is registered for run {run_id!r}")
        return state

    def segments(self, run_id: str | None = None) -> list[SegmentState]:
        with self._lock:
            return [s for (run, _), s in self._segments.items() if run_id in (None, run)]

    def resident_bytes(self) -> int:
        """Bytes of optimizer state held in RAM, over every segment."""
        return self.storage.state_bytes()[Residency.RAM]

    def bytes_by_tier(self) -> dict[str, int]:
        """Bytes of optimizer state in each tier ("ram", and "nvme" when one is configured)."""
        totals = self.storage.state_bytes()
        return {r.value: n for r, n in totals.items() if r is Residency.RAM or self.storage.enabled}

    def close(self) -> None:
        """Stop the storage's I/O and delete this server's partition files."""
        self.storage.close()
