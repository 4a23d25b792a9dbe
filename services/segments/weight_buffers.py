"""Buffers for updated weights on their way to a fetch, shared by a server's segments and
bounded in number, so that what waits for the workers to fetch it never grows with the
model.

An update may *prepare* a segment's weights in the fetch's dtype while the partitions
stream through memory (:meth:`~cargohold.services.segments.segment_state.SegmentState.apply_gradient`),
which saves the fetch a second read of the state. Each prepared segment holds a buffer
until its fetch; when every buffer is taken the update prepares nothing and the fetch
reads the state (a partition at a time). Finished buffers come back (:meth:`give`) and
are reused: a fresh allocation's page faults cost as much as the cast itself.
"""

from __future__ import annotations

import threading

import torch

DEFAULT_LIMIT = 8


class WeightBuffers:
    """At most ``limit`` buffers taken or kept free at once, on ``device`` (host memory
    when None; a GPU for a worker's device segments)."""

    def __init__(self, limit: int = DEFAULT_LIMIT, device: torch.device | None = None) -> None:
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        self.limit = limit
        self.device = device
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []
        self._taken: set[int] = set()
        """The data pointers of the buffers handed out and not given back yet."""

    def take(self, dtype: torch.dtype, numel: int) -> torch.Tensor | None:
        """A 1-D buffer of ``numel`` elements of ``dtype`` for the caller alone, or None
        when ``limit`` buffers are taken already."""
        with self._lock:
            if len(self._taken) >= self.limit:
                return None
            index = next((i for i, b in enumerate(self._free) if b.dtype == dtype and b.numel() == numel), None)
            if index is not None:
                buffer = self._free.pop(index)
            else:
                if len(self._taken) + len(self._free) >= self.limit:
                    self._free.pop(0)  # one of another shape makes room
                buffer = torch.empty(numel, dtype=dtype, device=self.device)
            self._taken.add(buffer.data_ptr())
            return buffer

    def give(self, buffer: torch.Tensor) -> None:
        """Hand back a buffer :meth:`take` returned, once nothing reads it any more; any
        other tensor is left alone."""
        with self._lock:
            if buffer.data_ptr() in self._taken:
                self._taken.discard(buffer.data_ptr())
                self._free.append(buffer)

    @property
    def taken(self) -> int:
        with self._lock:
            return len(self._taken)
