"""The RAM tier: resident partitions in page-aligned memory laid out like their files, so
that one can be written to disk or filled from a staging buffer without reshaping."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from cargohold.services.tiers.io_pool import AlignedBuffer
from cargohold.services.tiers.residency import PartitionKey, Residency
from cargohold.services.tiers.source import Moments
from cargohold.services.tiers.tier import DONE, Partition, PartitionArrays, Staged

if TYPE_CHECKING:
    from cargohold.services.tiers.nvme import TierPath


class RamTier:
    """Resident partitions, never more than ``capacity_bytes`` of them (None: no limit), in
    host memory or on a CUDA ``device`` (a worker's device segments). A partition's arrays
    are views made once, when it is admitted: an update only looks them up."""

    residency = Residency.RAM
    keeps_files = False
    paths: Sequence[TierPath] = ()

    def __init__(self, capacity_bytes: int | None, device: torch.device | None = None) -> None:
        self.capacity_bytes = capacity_bytes
        self.device = device
        self._lock = threading.Lock()
        self._held: dict[PartitionKey, tuple[AlignedBuffer, PartitionArrays]] = {}
        self._used = 0

    @property
    def used_bytes(self) -> int:
        """Bytes of memory the resident partitions occupy (their file layouts)."""
        return self._used

    @property
    def memory_bytes(self) -> int:
        return self._used

    def holds(self, key: PartitionKey) -> bool:
        return key in self._held

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
            self._held[partition.key] = (buffer, arrays)
        return arrays

    def arrays(self, partition: Partition) -> PartitionArrays:
        return self._held[partition.key][1]

    def buffer(self, partition: Partition) -> AlignedBuffer:
        return self._held[partition.key][0]

    # --- registration --------------------------------------------------------------
    def prepare(self, run_id: str, parts: Sequence[Partition], path_index: Mapping[PartitionKey, int]) -> None:
        pass  # no files to name

    def reserve(self, partition: Partition) -> bool:
        return self.admit(partition) is not None

    def check_room(self, parts: Sequence[Partition], gradient_itemsize: int, what: str) -> None:
        pass  # admission already kept to the capacity

    def load(self, partition: Partition, master: torch.Tensor, moments: Moments | None) -> Future[None]:
        self.arrays(partition).load_(master, moments)
        return DONE

    def receive(self, partition: Partition, staged: Staged, updates: int) -> Future[None] | None:
        return DONE if self.admit(partition, staged.arrays) is not None else None

    # --- Tier ----------------------------------------------------------------------
    def stage(self, partition: Partition, *, block: bool) -> Staged:
        buffer, arrays = self._held[partition.key]
        return Staged(partition, arrays, warm=True, handle=buffer)

    def commit(self, staged: Staged, update: int) -> Future[None]:
        return DONE  # updated in place; RAM is as durable as it gets

    def discard(self, staged: Staged, *, intact: bool) -> None:
        pass

    def drop(self, partition: Partition) -> None:
        with self._lock:
            held = self._held.pop(partition.key, None)
            if held is not None:
                self._used -= held[0].nbytes
        # The memory goes back when the last view of the buffer is gone.

    def read_master_into(self, partition: Partition, out: torch.Tensor) -> None:
        out.copy_(self.arrays(partition).master)

    def close(self) -> None:
        pass  # the memory goes with the process
