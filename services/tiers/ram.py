"""The RAM tier: resident partitions in page-aligned memory laid out like their files, so
that one can be written to disk or filled from a staging buffer without reshaping."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import torch

from cargohold.services.tiers.io_pool import AlignedBuffer
from cargohold.services.tiers.residency import PartitionKey, Residency
from cargohold.services.tiers.tier import Partition, PartitionArrays, Staged, done_future


class RamTier:
    """Resident partitions, never more than ``capacity_bytes`` of them (None: no limit), in
    host memory or on a CUDA ``device`` (a worker's device segments)."""

    residency = Residency.RAM

    def __init__(self, capacity_bytes: int | None, device: torch.device | None = None) -> None:
        self.capacity_bytes = capacity_bytes
        self.device = device
        self._lock = threading.Lock()
        self._buffers: dict[PartitionKey, AlignedBuffer] = {}
        self._used = 0

    @property
    def used_bytes(self) -> int:
        """Bytes of memory the resident partitions occupy (their file layouts)."""
        return self._used

    def holds(self, key: PartitionKey) -> bool:
        return key in self._buffers

    def admit(self, partition: Partition, source: PartitionArrays | None = None) -> PartitionArrays | None:
        """Make room for a partition and return its (zeroed, or copied from ``source``)
        arrays; None, with nothing changed, when it does not fit the capacity."""
        nbytes = partition.layout.file_bytes
        with self._lock:
            if self.capacity_bytes is not None and self._used + nbytes > self.capacity_bytes:
                return None
            self._used += nbytes
        buffer = AlignedBuffer(nbytes, self.device)
        arrays = buffer.arrays(partition.layout)
        if source is not None:
            arrays.copy_(source)
        with self._lock:
            self._buffers[partition.key] = buffer
        return arrays

    def arrays(self, partition: Partition) -> PartitionArrays:
        return self._buffers[partition.key].arrays(partition.layout)

    def buffer(self, partition: Partition) -> AlignedBuffer:
        return self._buffers[partition.key]

    # --- Tier ----------------------------------------------------------------------
    def stage(self, partition: Partition, *, block: bool) -> Staged:
        return Staged(partition, self.arrays(partition), warm=True)

    def commit(self, staged: Staged, update: int) -> Future[None]:
        return done_future()  # updated in place; RAM is as durable as it gets

    def discard(self, staged: Staged, *, intact: bool) -> None:
        pass

    def drop(self, partition: Partition) -> None:
        with self._lock:
            buffer = self._buffers.pop(partition.key, None)
            if buffer is not None:
                self._used -= buffer.nbytes
        # The memory goes back when the last view of the buffer is gone.
