"""FSDP2's all-gather and reduce-scatter through shared memory, for CPU workers on one host.

Gloo moves every collective through loopback TCP: each byte is copied into the kernel by
the sender and out of it by the receiver, by gloo's own threads, with wake-ups per
message; for reduce-scatter it also sums on those threads. On a 2-core host that was most
of the kernel time in a worker's profile (26% of its cycles at 0.3B bf16). Here each
worker owns a sealed memfd (:class:`SharedRegion`) that the other workers map:

* all-gather: each rank copies its chunk into its region, one barrier, then each rank
  copies the others' chunks straight out of their regions;
* reduce-scatter: each rank copies its gradient into its region, one barrier, then each
  rank sums its own chunk out of every region.

The barrier goes through semaphores at the start of each region
(:mod:`cargohold.services.worker.shared_barrier`: ~12 us where gloo's took ~0.5 ms). After them a
region is two halves used in turn, so one barrier per collective suffices: a rank writes
into a half again only two collectives later, after a barrier that its peers reach only
once they have finished reading that half.
A collective larger than a half goes through in pieces, one barrier each.

Reduction order: rank r's chunk is the sum of the ranks' chunks r-1, r-2, ..., r (left to
right, as gloo's ring reduce-scatter adds them), divided by the world size for an average.
At two workers any order gives gloo's bits (a + b = b + a); at three or more gloo's own
order changes with sizes (its ring's segments), so the FSDP2 reference of the correctness
contract runs on these collectives too, and tests compare them with gloo and with exact
sums. Other reduce ops go to gloo, as they would without these collectives.

Workers not on one host (or whose host refuses the memory) keep gloo: :func:`connect`
decides for all ranks together.

A region is named ``cargohold-<run id>:collectives-rank-<r>`` (:func:`region_label`), as a
worker's exchange buffers are ``cargohold-<run id>:<label>``: a state server maps only
memfds of its own run, and a rank maps a peer's region only when it is a sealed memfd of
its own user with the name of that rank's region of its run (else every rank keeps gloo,
with a warning naming the region).
"""

from __future__ import annotations

import logging
import os
import socket

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

# FSDP2's comm interfaces and default buffers are not exported (torch 2.13, pinned).
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllocMixin

from cargohold.services.core.errors import InvalidTensorError
from cargohold.services.transport.shm import MEMFD_PREFIX, SharedRegion, available, check_sealed_memfd, region_name
from cargohold.services.worker.shared_barrier import SharedBarrier, inbox_nbytes, init_inbox

logger = logging.getLogger(__name__)

MAX_HALF_BYTES = 64 << 20
"""The most a half of a worker's region holds; larger collectives go in pieces."""


def region_nbytes(collective_bytes: int, world_size: int) -> int:
    """A worker's region for collectives of up to ``collective_bytes`` (a unit's gathered
    weights or its unreduced gradients) among ``world_size`` ranks: the barrier's inbox,
    then two halves that hold one each, whole pages, at most :data:`MAX_HALF_BYTES` each."""
    half = min(max(collective_bytes, 1), MAX_HALF_BYTES)
    return inbox_nbytes(world_size) + 2 * (-(-half // 4096) * 4096)


def host_identity() -> str:
    """What two processes on the same running host share: the hostname and the boot id."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as file:
            boot = file.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class SharedMemoryGroup:
    """The ranks of ``group`` with one region each, mapped by all; see the module's doc."""

    def __init__(self, group: ProcessGroup, regions: list[SharedRegion], pids: list[int]) -> None:
        """``regions``: every rank's, mapped here, each with its barrier inbox made;
        ``pids``: every rank's process."""
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self._regions = regions
        self.nbytes = regions[self.rank].size
        """This rank's region: host memory it holds for the collectives."""
        self._inbox_bytes = inbox_nbytes(self.size)
        self._half_bytes = (self.nbytes - self._inbox_bytes) // 2
        self._parity = 0
        self._barrier = SharedBarrier(self.rank, [r.bytes.data_ptr() for r in regions], pids).wait

    def _next_half(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """Every rank's half for the next collective (or piece), as ``dtype``."""
        start = self._inbox_bytes + self._parity * self._half_bytes
        self._parity ^= 1
        numel = self._half_bytes // dtype.itemsize
        return [region.tensor(dtype, start, numel) for region in self._regions]

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """``output`` (size x ``input``'s elements) gets every rank's ``input`` in rank order."""
        n = input.numel()
        if output.numel() != n * self.size or output.dtype != input.dtype:
            raise ValueError(
                f"all-gather of {n} x {input.dtype} among {self.size} ranks into {output.numel()} x {output.dtype}"
            )
        own = output[self.rank * n : (self.rank + 1) * n]
        if own.data_ptr() != input.data_ptr():  # FSDP2's input is a view of the output's own chunk
            own.copy_(input)
        piece = self._half_bytes // input.element_size()
        for start in range(0, n, piece):
            stop = min(n, start + piece)
            halves = self._next_half(input.dtype)
            halves[self.rank][: stop - start].copy_(input[start:stop])
            self._barrier()
            for k, half in enumerate(halves):
                if k != self.rank:
                    output[k * n + start : k * n + stop].copy_(half[: stop - start])

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, average: bool) -> None:
        """``output`` gets the sum (or the mean) over the ranks of chunk ``rank`` of ``input``."""
        n = output.numel()
        if input.numel() != n * self.size or output.dtype != input.dtype:
            raise ValueError(
                f"reduce-scatter of {input.numel()} x {input.dtype} among {self.size} ranks into {n} x {output.dtype}"
            )
        order = [(self.rank - 1 - i) % self.size for i in range(self.size)]
        piece = self._half_bytes // (self.size * input.element_size())
        for start in range(0, n, piece):
            stop = min(n, start + piece)
            m = stop - start
            halves = self._next_half(input.dtype)
            staged = halves[self.rank]
            if m == n:
                staged[: n * self.size].copy_(input)
            else:
                for k in range(self.size):
                    staged[k * m : (k + 1) * m].copy_(input[k * n + start : k * n + stop])
            self._barrier()
            mine = slice(self.rank * m, (self.rank + 1) * m)
            out = output[start:stop]
            out.copy_(halves[order[0]][mine])
            for k in order[1:]:
                out.add_(halves[k][mine])
        if average:
            output.div_(self.size)

    def close(self) -> None:
        """Unmap every region (this rank's memfd goes once no peer maps it)."""
        for region in self._regions:
            region.close()
        self._regions = []


def region_label(rank: int) -> str:
    """What names rank ``rank``'s region after its run id (:func:`region_name`)."""
    return f"collectives-rank-{rank}"


def _open_peer(path: str, run_id: str, rank: int) -> SharedRegion:
    """Rank ``rank``'s region at ``path``, mapped only when it is what that rank of run
    ``run_id`` made: a memfd of this user, sealed against resizing, named
    ``cargohold-<run id>:collectives-rank-<rank>``. A state server checks a worker's
    exchange buffers the same way (:class:`~cargohold.services.transport.shm.RegionCache`)."""
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        check_sealed_memfd(fd, path, "worker")
        name = os.readlink(f"/proc/self/fd/{fd}")  # what was opened, whatever the path names now
        expected = f"/memfd:{MEMFD_PREFIX}{region_name(run_id, region_label(rank))}"
        if name not in (expected, f"{expected} (deleted)"):
            raise InvalidTensorError(
                f"shared memory {path!r} ({name}) is not rank {rank}'s collectives region of run {run_id!r}"
            )
        return SharedRegion(fd, path, owner=False)
    except BaseException:
        os.close(fd)
        raise


def connect(group: ProcessGroup, collective_bytes: int, run_id: str) -> SharedMemoryGroup | None:
    """The ranks of ``group`` joined through shared memory, or None on every rank (gloo
    stays) when they are not all on one host or any of them cannot make or map a region,
    or finds a peer's region not its rank's of run ``run_id`` (:func:`_open_peer`).
    Collective: every rank of ``group`` calls it. ``collective_bytes``: the largest
    collective's bytes on a rank (:func:`region_nbytes`)."""
    nbytes = region_nbytes(collective_bytes, group.size())
    rank, size = group.rank(), group.size()
    hosts: list[str | None] = [None] * size
    dist.all_gather_object(hosts, host_identity(), group=group)
    if len(set(hosts)) != 1 or not available():
        if rank == 0:
            logger.info("workers on %d hosts: FSDP2's collectives stay on gloo", len(set(hosts)))
        return None
    regions: list[SharedRegion] = []
    own: SharedRegion | None = None
    problem = ""
    try:
        own = SharedRegion.create(region_name(run_id, region_label(rank)), nbytes)
        own.bytes.zero_()  # every page now: a host short of memory fails here, not mid-step
        init_inbox(own.bytes.data_ptr(), size)
    except (OSError, RuntimeError) as error:
        problem = f"rank {rank} cannot make {nbytes} bytes of shared memory with its barrier: {error}"
    found: list[tuple[str | None, int]] = [(None, 0)] * size
    dist.all_gather_object(found, (own.path if own is not None and not problem else None, os.getpid()), group=group)
    paths = [path for path, _ in found]
    for k, path in enumerate(paths):
        if problem or own is None:
            break
        if path is None:
            problem = f"rank {k} made no shared memory"
            break
        try:
            regions.append(own if k == rank else _open_peer(path, run_id, k))
        except (OSError, RuntimeError, InvalidTensorError) as error:
            problem = f"rank {rank} cannot map rank {k}'s shared memory: {error}"
    failed = torch.tensor([1 if problem else 0])
    dist.all_reduce(failed, group=group)
    if int(failed) == 0:
        return SharedMemoryGroup(group, regions, [pid for _, pid in found])
    if problem:
        logger.warning("%s; FSDP2's collectives stay on gloo", problem)
    for region in [r for r in regions if r is not own] + ([own] if own is not None else []):
        region.close()
    return None


class _OnSharedMemory(DefaultAllocMixin):
    """An FSDP2 comm on a :class:`SharedMemoryGroup`; its buffers FSDP2's default ones."""

    def __init__(self, shared: SharedMemoryGroup) -> None:
        self.shared = shared


class SharedMemoryAllGather(_OnSharedMemory, AllGather):
    """FSDP2's all-gather (``set_custom_all_gather``) on a :class:`SharedMemoryGroup`."""

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: ProcessGroup, async_op: bool = False
    ) -> None:
        """Done when it returns (async_op too: there is no work to wait for)."""
        self.shared.all_gather(output_tensor, input_tensor)


class SharedMemoryReduceScatter(_OnSharedMemory, ReduceScatter):
    """FSDP2's reduce-scatter (``set_custom_reduce_scatter``) on a :class:`SharedMemoryGroup`."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: ProcessGroup,
        op,
        async_op: bool = False,
    ) -> dist.Work | None:
        """SUM and AVG here, done when it returns; any other op to gloo, as without this."""
        if op == ReduceOp.SUM or op == ReduceOp.AVG:
            self.shared.reduce_scatter(output_tensor, input_tensor, average=op == ReduceOp.AVG)
            return None
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
