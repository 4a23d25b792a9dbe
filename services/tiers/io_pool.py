"""Aligned buffers, the pool of staging buffers the NVMe tier streams through, and the
thread pool its reads and writes run on.

Why threads and the standard library rather than an async-I/O package: ``os.preadv`` and
``os.pwritev`` release the GIL, read straight into a caller's buffer, and with O_DIRECT
and page-aligned buffers (anonymous ``mmap``) move a whole partition in a few large
sequential requests; a few threads give the queue depth. We evaluated caio (maintained,
Linux AIO with a thread fallback, the base of aiofile): its reads return newly allocated
``bytes`` (an extra copy per partition), its buffers are not aligned, so O_DIRECT reads
fail with EINVAL, and buffered it measured 0.2-0.5 GB/s against 1.66 GB/s for O_DIRECT
``preadv`` on the same disk (docs/benchmarks.md). aiofiles only wraps blocking calls in a
thread pool; the liburing/libaio bindings need system libraries and kernel features
(io_uring is often disabled in containers) for no gain at these request sizes.
"""

from __future__ import annotations

import itertools
import mmap
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Literal, TypeVar, overload

import torch

from cargohold.services.core.errors import TierError
from cargohold.services.tiers.fileformat import FileLayout
from cargohold.services.tiers.residency import PartitionKey
from cargohold.services.tiers.tier import PartitionArrays, TierObserver

T = TypeVar("T")


class AlignedBuffer:
    """Page-aligned anonymous memory holding one partition in its file layout; with a CUDA
    ``device``, the same layout in GPU memory (a worker's device segments,
    ``worker.optimizer_on_device_fraction``): no file reads or writes it, a checkpoint
    writes a host :meth:`clone`."""

    def __init__(self, nbytes: int, device: torch.device | None = None) -> None:
        self.nbytes = nbytes
        self._map: mmap.mmap | None = None
        self._view: memoryview | None = None
        if device is not None and device.type != "cpu":
            self.tensor = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        else:
            self._map = mmap.mmap(-1, nbytes)
            self._view = memoryview(self._map)
            self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self.tag: tuple[PartitionKey, int] | None = None
        """(partition, updates) whose stored file these bytes equal, or None."""

    @property
    def view(self) -> memoryview:
        """The bytes, for file reads and writes (host memory only)."""
        if self._view is None:
            raise TierError(f"a {self.nbytes}-byte buffer on {self.tensor.device} has no host bytes to read or write")
        return self._view

    def arrays(self, layout: FileLayout) -> PartitionArrays:
        """Views of the partition of ``layout`` held in these bytes."""
        master = self.tensor[layout.offset(0) : layout.offset(0) + layout.array_bytes].view(torch.float32)
        return PartitionArrays(master, layout.moment(self.tensor, 1), layout.moment(self.tensor, 2))

    def clone(self) -> AlignedBuffer:
        """A new buffer in host memory holding a copy of these bytes."""
        copy = AlignedBuffer(self.nbytes)
        copy.tensor.copy_(self.tensor)
        return copy

    def close(self) -> None:
        """Unmap; only when no tensor view of it is alive any more."""
        del self.tensor
        if self._view is not None and self._map is not None:
            self._view.release()
            self._map.close()


class BufferPool:
    """Up to ``count`` staging buffers, allocated on first use.

    A released buffer keeps a tag saying which partition (after which update) it still holds;
    staging that partition again takes it back without a read ("warm"). Otherwise the
    least recently released buffer is reused.
    """

    def __init__(self, count: int, nbytes: int) -> None:
        self.count = count
        self.nbytes = nbytes
        self._cond = threading.Condition()
        self._free: list[AlignedBuffer] = []
        self._all: list[AlignedBuffer] = []

    @property
    def allocated_bytes(self) -> int:
        with self._cond:
            return len(self._all) * self.nbytes

    @overload
    def acquire(self, tag: tuple[PartitionKey, int] | None, *, block: Literal[True]) -> tuple[AlignedBuffer, bool]: ...

    @overload
    def acquire(self, tag: tuple[PartitionKey, int] | None, *, block: bool) -> tuple[AlignedBuffer, bool] | None: ...

    def acquire(self, tag: tuple[PartitionKey, int] | None, *, block: bool) -> tuple[AlignedBuffer, bool] | None:
        """A buffer, and whether it is warm (already holds ``tag``); None when none is
        free and ``block`` is False."""
        with self._cond:
            while True:
                for index, buffer in enumerate(self._free):
                    if tag is not None and buffer.tag == tag:
                        return self._free.pop(index), True
                if len(self._all) < self.count:
                    buffer = AlignedBuffer(self.nbytes)
                    self._all.append(buffer)
                    return buffer, False
                if self._free:
                    untagged = next((i for i, b in enumerate(self._free) if b.tag is None), 0)
                    buffer = self._free.pop(untagged)
                    buffer.tag = None
                    return buffer, False
                if not block:
                    return None
                self._cond.wait()

    def release(self, buffer: AlignedBuffer, tag: tuple[PartitionKey, int] | None = None) -> None:
        with self._cond:
            buffer.tag = tag
            self._free.append(buffer)
            self._cond.notify_all()

    def forget(self, key: PartitionKey) -> None:
        """Untag free buffers holding ``key`` (its file is gone or superseded)."""
        with self._cond:
            for buffer in self._free:
                if buffer.tag is not None and buffer.tag[0] == key:
                    buffer.tag = None


class IoPool:
    """The threads tier I/O runs on; reports the number of jobs queued or running."""

    def __init__(self, threads: int, observer: TierObserver) -> None:
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tier-io")
        self._observer = observer
        self._lock = threading.Lock()
        self._depth = 0
        self._ids = itertools.count()

    @property
    def depth(self) -> int:
        return self._depth

    def submit(self, job: Callable[[], T]) -> Future[T]:
        self._change_depth(+1)

        def run() -> T:
            try:
                return job()
            finally:
                self._change_depth(-1)

        return self._executor.submit(run)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)

    def _change_depth(self, delta: int) -> None:
        with self._lock:
            self._depth += delta
            depth = self._depth
        self._observer.set_tier_queue_depth(depth)
