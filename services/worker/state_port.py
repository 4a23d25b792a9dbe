"""The worker's port to the state servers: register, update and fetch one segment.

The step (:mod:`cargohold.services.worker.step`) talks only to a :class:`StatePort`. Here
:class:`RemotePort`, the gRPC clients (with shared memory for servers on the same node);
:mod:`.device_port` holds the port to state in this process (a worker's own device
segments, a step without Ray or a network). Gradients and weights travel through the worker's
:class:`ExchangeBuffers`: a few unit-sized slots in host memory (shared memory when a
server on this node reads and writes it directly).
"""

from __future__ import annotations

import queue
import uuid
from dataclasses import dataclass
from typing import Protocol

import torch

from cargohold.cluster.schema.optim import OptimConfig
from cargohold.cluster.schema.worker import DType
from cargohold.services.core.layout import Segment
from cargohold.services.core.segment_spec import SegmentSpec, check_same_spec
from cargohold.services.core.update_call import IN_CALL, STAGED, CommitTerms, GradientIn, SharedRef, UpdateCall
from cargohold.services.metrics.worker import WorkerMetrics
from cargohold.services.transport.grpc_client import StateServerClient
from cargohold.services.transport.shm import SharedRegion
from cargohold.services.worker.page_lock import PageLock, PageLockRefused, page_lock, pinned_empty
from cargohold.services.worker.param_groups import ParamGroups


@dataclass(frozen=True, slots=True, kw_only=True)
class PortConfig:
    """What a port reads from the run's config: what the servers are told about each
    segment, and the dtypes gradients go and weights come back in."""

    optim: OptimConfig
    """``optim.*``: each segment's AdamW terms, param groups' settings and state dtype."""
    push_dtype: DType
    """The dtype gradients travel in: ``worker.grad_wire_dtype``, or float32 when
    micro-batches are accumulated (the config's ``push_dtype``)."""
    compute_dtype: DType
    """``worker.compute_dtype``: the dtype the workers' weights come back in."""


def segment_spec(config: PortConfig, run_id: str, segment: Segment, param_groups: ParamGroups) -> SegmentSpec:
    """What a state server is told about one segment it owns."""
    groups, fragment_group = param_groups.of_segment(segment)
    return SegmentSpec(
        run_id=run_id,
        segment_id=segment.segment_id,
        start=segment.start,
        numel=segment.numel,
        fragments=tuple((f.segment_start, f.length) for f in segment.fragments),
        grad_dtype=config.push_dtype,
        hyper=config.optim.hyper_params(),
        groups=groups,
        fragment_group=fragment_group,
        state_dtype=config.optim.state_dtype,
    )


SLOT_ALIGN = 64
"""Elements a slot's length is rounded up to."""


@dataclass(frozen=True, slots=True)
class ExchangeSlot:
    """Room for one unit's part of a worker's range: its reduced gradient on the way to
    the servers (wire dtype), its updated weights on the way back (compute dtype)."""

    grads: torch.Tensor
    weights: torch.Tensor


def exchange_nbytes(slot_numel: int, grad_size: int, weight_size: int, *, slots: int, held_numel: int) -> int:
    """Bytes of :meth:`ExchangeBuffers.allocate`'s buffers (for the plan), given the
    dtypes' sizes."""
    return slots * _slot_numel(slot_numel) * (grad_size + weight_size) + held_numel * weight_size


def _slot_numel(numel: int) -> int:
    return -(-numel // SLOT_ALIGN) * SLOT_ALIGN  # every view stays aligned


class ExchangeBuffers:
    """The host memory a worker's gradients and weights pass through, as the servers read
    and write it (shared memory, ``region``, when a server shares the node).

    ``slots`` unit-sized slots are taken by a unit's transfers and given back when its
    weights are in FSDP2's shards, so the buffers do not grow with the model. With the
    delayed update, ``held`` is the whole range's weights too: they arrive during the
    next step's compute and are adopted only after its backward.

    For a GPU worker they are page-locked (services/worker/page_lock.py), shared or not; where
    that was refused, ``pin_refused`` says why and they are pageable."""

    def __init__(
        self,
        slots: list[ExchangeSlot],
        held: torch.Tensor | None = None,
        region: SharedRegion | None = None,
        *,
        lock: PageLock | None = None,
        pin_refused: PageLockRefused | None = None,
    ) -> None:
        self.slots = slots
        self.held = held
        self.region = region
        self.lock = lock
        self.pin_refused = pin_refused
        self._free: queue.SimpleQueue[ExchangeSlot] = queue.SimpleQueue()
        for slot in slots:
            self._free.put(slot)

    @classmethod
    def allocate(
        cls,
        slot_numel: int,
        grad_dtype: torch.dtype,
        weight_dtype: torch.dtype,
        *,
        slots: int,
        held_numel: int = 0,
        shared_name: str | None = None,
        pin: bool = False,
    ) -> ExchangeBuffers:
        """``slots`` slots of ``slot_numel`` elements and ``held_numel`` held weights, in
        shared memory named after ``shared_name``, else in host memory; page-locked with
        ``pin`` where that can be done."""
        slot_numel = _slot_numel(slot_numel)
        slot_bytes = slot_numel * (grad_dtype.itemsize + weight_dtype.itemsize)
        total = exchange_nbytes(
            slot_numel, grad_dtype.itemsize, weight_dtype.itemsize, slots=slots, held_numel=held_numel
        )
        region, lock, refused = None, None, None
        if shared_name is not None:
            region = SharedRegion.create(f"{shared_name}-{uuid.uuid4().hex[:8]}", total)
            memory = region.bytes
        try:
            if shared_name is None:
                memory = pinned_empty(total) if pin else torch.empty(total, dtype=torch.uint8)
            elif pin:
                lock = page_lock(memory)
        except PageLockRefused as error:
            refused = error
            if shared_name is None:
                memory = torch.empty(total, dtype=torch.uint8)

        def view(dtype: torch.dtype, at: int, numel: int) -> torch.Tensor:
            return memory[at : at + numel * dtype.itemsize].view(dtype)

        grad_bytes = slot_numel * grad_dtype.itemsize
        made = [
            ExchangeSlot(
                view(grad_dtype, i * slot_bytes, slot_numel),
                view(weight_dtype, i * slot_bytes + grad_bytes, slot_numel),
            )
            for i in range(slots)
        ]
        held = view(weight_dtype, slots * slot_bytes, held_numel) if held_numel else None
        return cls(made, held, region, lock=lock, pin_refused=refused)

    def acquire(self) -> ExchangeSlot:
        """A free slot; waits while every slot is in use."""
        return self._free.get()

    def release(self, slot: ExchangeSlot) -> None:
        self._free.put(slot)

    def shared_ref(self, view: torch.Tensor) -> tuple[str, int]:
        """(path, byte offset) of a view of these buffers, for a co-located server."""
        assert self.region is not None
        return self.region.path, view.data_ptr() - self.region.bytes.data_ptr()

    @property
    def nbytes(self) -> int:
        tensors = [t for slot in self.slots for t in (slot.grads, slot.weights)]
        return sum(t.numel() * t.element_size() for t in tensors + ([self.held] if self.held is not None else []))

    def close(self) -> None:
        if self.lock is not None:
            self.lock.release()  # CUDA lets go of the pages before they are unmapped
        if self.region is not None:
            self.region.close()


class StatePort(Protocol):
    def register(self, segment: Segment, initial: torch.Tensor) -> int:
        """Register a segment with its fp32 initial values; returns its update count."""

    def join(self, segment: Segment) -> int:
        """The update count of a segment its holder already has (restored from a
        checkpoint, or kept through a live recovery), refused where the holder's was
        registered with another specification: no initial values are drawn or sent."""

    def update(
        self,
        segment: Segment,
        update: int,
        *,
        gradient: torch.Tensor | None,
        terms: CommitTerms | None,
        out: torch.Tensor | None = None,
    ) -> bool:
        """Update number ``update`` of ``segment`` (services/core/update_call.py): with a
        ``gradient`` and no ``terms`` the server stages it; with both it applies it now;
        with ``terms`` alone it commits the one staged. An applied update prepares the new
        weights in the compute dtype for the :meth:`fetch` that follows or, given ``out``,
        writes them there (in the same call where the server shares the node, else
        fetched after it). Returns whether an update was applied (False for a repeat or
        when staged)."""

    def fetch(self, segment: Segment, update: int, out: torch.Tensor) -> None:
        """Write the weights after ``update`` into ``out`` (a view of the exchange buffers)."""

    def close(self) -> None:
        """Release the connections."""


class RemotePort:
    """State servers over gRPC; those on this node (``shared``) through shared memory.
    The clients are serving already (the worker waits for each once)."""

    def __init__(
        self,
        config: PortConfig,
        run_id: str,
        clients: list[StateServerClient],
        buffers: ExchangeBuffers,
        shared: set[int],
        metrics: WorkerMetrics,
        param_groups: ParamGroups,
    ) -> None:
        self.config = config
        self.run_id = run_id
        self.param_groups = param_groups
        self.clients = clients
        self.buffers = buffers
        self.shared = shared if buffers.region is not None else set()
        self.metrics = metrics

    def register(self, segment: Segment, initial: torch.Tensor) -> int:
        updates, _ = self.clients[segment.server].register(
            segment_spec(self.config, self.run_id, segment, self.param_groups), initial
        )
        return updates

    def join(self, segment: Segment) -> int:
        client = self.clients[segment.server]
        held, updates = client.describe(self.run_id, segment.segment_id)
        check_same_spec(held, segment_spec(self.config, self.run_id, segment, self.param_groups))
        return updates

    def update(
        self,
        segment: Segment,
        update: int,
        *,
        gradient: torch.Tensor | None,
        terms: CommitTerms | None,
        out: torch.Tensor | None = None,
    ) -> bool:
        shared = segment.server in self.shared
        where: GradientIn | SharedRef = STAGED
        if gradient is not None:
            where = SharedRef(*self.buffers.shared_ref(gradient)) if shared else IN_CALL
        call = UpdateCall(
            run_id=self.run_id,
            segment_id=segment.segment_id,
            update=update,
            numel=segment.numel,
            gradient=where,
            terms=terms,
            weights_dtype=None if terms is None else self.config.compute_dtype,
            weights_to=SharedRef(*self.buffers.shared_ref(out)) if shared and out is not None and terms else None,
        )
        client = self.clients[segment.server]
        outcome = client.update(call, gradient)
        if gradient is not None:
            rpc = _path_label("PushGradient", shared, client)
            self.metrics.transport.sent[rpc].inc(gradient.numel() * gradient.element_size())
        else:
            rpc = "CommitStep.shm"
        self._weights_arrived(segment, update, out, written=call.weights_to is not None, rpc=rpc)
        return outcome.applied and not call.stages

    def _weights_arrived(
        self, segment: Segment, update: int, out: torch.Tensor | None, *, written: bool, rpc: str
    ) -> None:
        """After an update asked for its weights in ``out``: count them where the call
        wrote them, else fetch them."""
        if out is None:
            return
        if written:
            self.metrics.transport.received[rpc].inc(segment.numel * out.element_size())
        else:
            self.fetch(segment, update, out)

    def fetch(self, segment: Segment, update: int, out: torch.Tensor) -> None:
        shm = self.buffers.shared_ref(out) if segment.server in self.shared else None
        dtype = self.config.compute_dtype
        weights = self.clients[segment.server].fetch(
            self.run_id, segment.segment_id, update, dtype, segment.numel, shm=shm, out=out if shm is None else None
        )
        rpc = _path_label("FetchWeights", shm is not None, self.clients[segment.server])
        self.metrics.transport.received[rpc].inc(segment.numel * out.element_size())
        if weights is not None and weights.data_ptr() != out.data_ptr():
            out.copy_(weights)

    def close(self) -> None:
        for client in self.clients:
            client.close()


def _path_label(rpc: str, shm: bool, client: StateServerClient) -> str:
    """The transport counters' label: the call, and the path its bytes took (as the
    server counts them)."""
    return f"{rpc}.shm" if shm else f"{rpc}.bulk" if client.bulk else rpc


def copies_done_event(device: torch.device) -> torch.cuda.Event | None:
    """On CUDA, an event recorded after the copies into an exchange slot: the pushes wait
    on it before reading the slot (None on CPU, where the copies are done on return)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event
