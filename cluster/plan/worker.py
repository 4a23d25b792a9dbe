"""One worker's plan: the buffers it holds between steps, what a step adds on its device
and in host memory, and the bytes it moves.

A worker's memory follows FSDP2 (ZeRO-3): between steps it holds its 1/W shards (on the
device, or in pinned host memory with ``worker.offload_params``) and its exchange
buffers (host memory). During a step the device also holds, at most, the root unit
(every parameter outside the other units: gathered from forward to backward) and two
other units (the one computed and the one FSDP2 prefetches; every unit with
``worker.reshard_after_forward: false``; with ``tuning.worker.kept_gathered_units`` above 1, those
kept and one more) unsharded in the compute dtype, the all-gather
buffer of the unit arriving, the root's gradients (reduced only when backward ends) and
one unit's unsharded gradients with FSDP2's reduce-scatter input and output (wire
dtype), and the activations (all of them, or with ``worker.activation_checkpointing:
blocks`` each block's input plus one block's recomputed activations; see
:mod:`.activations`). The other units are the blocks, or with ``worker.max_unit_params``
the pieces no larger than it (:func:`~cargohold.services.worker.sharding.split_modules`): every
per-unit figure then follows the largest piece.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from cargohold.cluster.plan.itemsize import DTYPE_BYTES, FP32_BYTES
from cargohold.cluster.plan.runtime import worker_runtime_bytes
from cargohold.cluster.schema.train import TrainConfig
from cargohold.services.core.layout import Layout
from cargohold.services.core.optim import SQUARES_CHUNK
from cargohold.services.core.state_precision import bytes_per_parameter, stored_bytes
from cargohold.services.tiers.fileformat import round_up
from cargohold.services.worker.colocated_collectives import region_nbytes
from cargohold.services.worker.host_allocator import worker_allocator
from cargohold.services.worker.model_setup import collectives_in_shared_memory, largest_collective_bytes
from cargohold.services.worker.sharding import backward_gathered_units
from cargohold.services.worker.state_port import exchange_nbytes
from cargohold.services.worker.weight_files import READ_BUFFERS as WEIGHT_READ_BUFFERS
from cargohold.services.worker.window_schedule import reads_per_micro_batch


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerTraffic:
    """Bytes one worker moves per step."""

    reduce_scatter_bytes: int
    """Sent by each worker reducing every unit's gradients (ring: (W-1)/W of each unit's
    padded size, wire dtype)."""
    all_gather_bytes: int
    """Sent by each worker gathering the units (ring: (W-1)/W of each unit, compute
    dtype): every unit in forward, the blocks again in backward when resharded."""
    push_bytes: int
    """Its range of the gradients, to the state servers, in the wire dtype."""
    fetch_bytes: int
    """Its range of the weights, from the state servers, in the compute dtype."""
    weight_read_bytes: int = 0
    """With weights on NVMe: its units' files read per step (each unit ahead of every
    micro-batch's forward, and again ahead of its backward when resharded unless the
    window still holds it: :func:`~cargohold.services.worker.window_schedule.reads_per_micro_batch`)."""
    weight_write_bytes: int = 0
    """With weights on NVMe: its units' files written per step (once, after the update)."""


MIMALLOC_KEPT_SHARE = 0.3
"""The share of a CPU worker's per-step buffers (gathered units, gradients, temporaries,
activations) that mimalloc keeps beyond their live peak: blocks freed in one size that the
next step asks for in another. Measured peak RSS over the plan without it, both sides on
mimalloc (docs/benchmarks.md, "The workers' allocator"): 1.04-1.07 on the demo, 100M and 0.24B models,
zero2 and zero3, 7-26% of those buffers; glibc's stayed under the plan (0.90 at 100M)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerPlan:
    """One worker: rank 0, which holds the most of FSDP2's uneven dim-0 shards."""

    device: str
    """Where it computes: "cuda" or "cpu" (then its device memory is host memory)."""
    offload: bool
    """Its weight shards live in host memory (``worker.offload_params`` or weights on NVMe,
    on a GPU)."""
    buffers: dict[str, int]
    """What it holds between steps, keyed as ``TrainingWorker.resident_bytes()``: its FSDP2
    weight shards (compute dtype; with weights on NVMe the root's, ``tuning.worker.weight_window``
    units' and the files' two read buffers) and its exchange buffers (slots of the
    largest unit's gradients in the wire dtype and weights in the compute dtype; with the
    delayed update also ``range_elements`` weights); CPU workers on one host also their
    region for FSDP2's collectives ("collectives", ``tuning.worker.shared_memory_collectives``)."""
    device_state_bytes: int = 0
    """Its device segments' AdamW state (``worker.optimizer_on_device_fraction``) on the
    compute device: master weights and moments as ``optim.state_dtype`` stores them, and
    with the staged update (clipping, non-finite checks) their staged gradients (push dtype)."""
    device_update_bytes: int = 0
    """The device segments' weights prepared by the updates in flight (compute dtype, the
    largest device segment per exchange slot)."""
    device_state_per_element: float = 0.0
    """What one more element of device segments would cost on the compute device: the
    state's bytes per element, its staged gradient's, and its share of the prepared
    weights: how the plan picks the fraction."""
    nvme_weight_bytes: int = 0
    """Its units' weight files under ``worker.weights_nvme_path`` (0: weights in memory)."""
    weight_window: int = 0
    """With weights on NVMe: units in host memory at once (``tuning.worker.weight_window``)."""
    range_elements: int
    """Elements of its range of the flat space (``layout.worker_size``)."""
    units: int
    """FSDP2 units besides the root: the transformer blocks, or the pieces of
    ``worker.max_unit_params``."""
    max_unit_params: int
    """``worker.max_unit_params`` (0: one unit per block)."""
    largest_unit: int
    """Parameters of the largest unit besides the root."""
    reshard_after_forward: bool
    """``worker.reshard_after_forward``: units are gathered again for backward."""
    kept_gathered_units: int
    """With ``reshard_after_forward``, the last units kept gathered from forward to
    backward (``tuning.worker.kept_gathered_units``, at most every unit)."""
    gathered_bytes: int
    """Units unsharded at once on the device, in the compute dtype (upper bound): the root,
    the unit computed and the one prefetched (every unit without
    ``reshard_after_forward``), and the all-gather buffer of the unit arriving."""
    gradient_bytes: int
    """Gradients on the device during backward (upper bound): the root's unsharded
    gradients (reduced when backward ends) plus the larger of a unit's unsharded
    gradients with its reduce-scatter input and output (wire dtype) and the root's
    reduce-scatter input and output. None persists: reduced gradients are copied to the
    exchange buffer and dropped."""
    transient_bytes: int
    """Other per-step temporaries on the device (upper bound): the fp64 cast of a unit's
    reduced gradient for the norm (``SQUARES_CHUNK`` elements at a time), its cast to the
    weights' dtype when the wire dtype differs, and with offload the shards of the two
    units in flight copied in."""
    activation_bytes: int
    """Estimate (see activation_bytes_estimate)."""
    activation_checkpointing: str
    """``worker.activation_checkpointing``: "off" or "blocks"."""
    pinned_bytes: int
    """Pinned host memory (GPU only): the exchange buffers and the offloaded weight shards."""
    shared_memory_bytes: int
    """Host memory a CPU worker shares with a state server on its node (its exchange
    buffers, a sealed memfd: host RAM, not /dev/shm)."""
    host_transient_bytes: int
    """Host memory a step needs beyond the buffers: with offload, FSDP2's host copy of
    one unit's reduced gradient (dropped at once)."""
    corpus_bytes: int
    """Training text in host memory (at most data.corpus_bytes)."""
    allocator_kept_bytes: int = 0
    """Freed host memory the worker's allocator keeps for the next step: on a CPU worker
    running mimalloc (``tuning.worker.host_allocator``), :data:`MIMALLOC_KEPT_SHARE` of the step's
    buffers; 0 with glibc, which returns them, and on a GPU worker, whose step buffers are
    the CUDA caching allocator's."""
    runtime_bytes: int
    """The process's runtime (Python, torch, Ray, gloo; CUDA on a GPU worker): measured,
    :mod:`.runtime`."""
    startup_host_bytes: int
    """Host memory while it starts: the runtime, the buffers held in host memory, one
    module's full fp32 initial values and one unit's fp32 initial chunk (registered with
    the servers a unit at a time); the model itself is only ever built on the meta device."""
    traffic: WorkerTraffic

    @property
    def device_bytes(self) -> int:
        """Resident on the compute device between steps: the weight shards unless
        offloaded, and the device segments' state."""
        return (0 if self.offload else self.buffers["weights"]) + self.device_state_bytes

    @property
    def device_peak_bytes(self) -> int:
        return (
            self.device_bytes
            + self.gathered_bytes
            + self.gradient_bytes
            + self.transient_bytes
            + self.activation_bytes
            + self.device_update_bytes
        )

    def device_fraction_fit(self, device_memory_bytes: int) -> float:
        """The largest ``worker.optimizer_on_device_fraction`` (to 0.01) whose device
        segments fit in what the step leaves of ``device_memory_bytes``; 0 where nothing does."""
        left = device_memory_bytes - (self.device_peak_bytes - self.device_state_bytes - self.device_update_bytes)
        if left <= 0 or not self.range_elements:
            return 0.0
        return min(1.0, math.floor(100 * left / (self.device_state_per_element * self.range_elements)) / 100)

    @property
    def host_bytes(self) -> int:
        """Host memory while training: the runtime, the exchange buffers, offloaded shards,
        temporaries and corpus; on a CPU also everything the device total counts."""
        on_host = self.device_peak_bytes if self.device == "cpu" else 0
        offloaded = self.buffers["weights"] if self.offload else 0
        return (
            self.runtime_bytes
            + on_host
            + self.buffers["exchange"]
            + self.buffers.get("collectives", 0)
            + offloaded
            + self.host_transient_bytes
            + self.corpus_bytes
            + self.allocator_kept_bytes
        )

    @property
    def host_peak_bytes(self) -> int:
        return max(self.host_bytes, self.startup_host_bytes)


@dataclass(frozen=True, slots=True)
class _UnitSize:
    """One FSDP2 unit in elements: its parameters, and its padded chunk on each worker
    (dim 0 split in ``ceil(rows / W)`` rows: the reduce-scatter output; ``W`` times it is
    the all-gather output and the reduce-scatter input)."""

    numel: int
    chunk: int


def _unit_sizes(layout: Layout) -> list[_UnitSize]:
    return [
        _UnitSize(
            numel=sum(s.numel for s in layout.unit_params(u.index)),
            chunk=sum(s.padded_numel for s in layout.unit_params(u.index)),
        )
        for u in layout.units
    ]


@dataclass(frozen=True, slots=True)
class _Itemsizes:
    """Bytes per element of what a worker holds and moves."""

    compute: int
    """Weights, gathered units and their gradients (``worker.compute_dtype``)."""
    wire: int
    """Gradients in FSDP2's reduce-scatter (``worker.grad_wire_dtype``)."""
    push: int
    """Gradients pushed to the state servers (fp32 when micro-batches are accumulated)."""


@dataclass(frozen=True, slots=True)
class _DeviceOptimizer:
    """The device segments' share of the compute device (``worker.optimizer_on_device_fraction``)."""

    state_bytes: int
    """Their AdamW state and, with the staged update, their staged gradients: these stay."""
    update_bytes: int
    """The weights each update in flight (one per exchange slot) prepares, in the compute dtype."""
    per_element: float
    """What one more element of device segments would cost."""


def plan_worker(
    config: TrainConfig, layout: Layout, model: torch.nn.Module, device: str, transport: str, activations: int
) -> WorkerPlan:
    """Rank 0 of ``layout`` computing on ``device`` ("cuda" or "cpu"), exchanging with the
    state servers over ``transport``; ``activations`` is the activation estimate."""
    settings = config.worker
    size = _Itemsizes(
        compute=DTYPE_BYTES[settings.compute_dtype],
        wire=DTYPE_BYTES[settings.grad_wire_dtype],
        push=DTYPE_BYTES[config.push_dtype],
    )
    on_nvme = settings.weights_nvme_path is not None
    offload = (settings.offload_params or on_nvme) and device == "cuda"
    unit_files = [round_up((u.stop - u.start) * size.compute) for u in layout.units[1:]]  # as written: whole units
    if on_nvme:
        weights = _weights_in_window(layout, size, settings.weight_window, unit_files)
    else:
        weights = _weights_all_in_memory(layout, size)
    exchange = exchange_nbytes(
        layout.largest_unit,
        size.push,
        size.compute,
        slots=settings.exchange_slots,
        held_numel=layout.worker_size if settings.delayed_update else 0,
    )
    shared = collectives_in_shared_memory(settings, device)
    collectives = region_nbytes(largest_collective_bytes(layout, settings), layout.num_workers) if shared else 0
    units = _unit_sizes(layout)
    regathered = backward_gathered_units(len(units), settings.reshard_after_forward, settings.kept_gathered_units)
    gathered = _gathered_bytes(units, regathered, layout.num_workers, size)
    gradients = _gradient_bytes(units, layout.num_workers, size)
    chunk = max(u.chunk for u in units)
    transient = _transient_bytes(chunk, size, offload)
    optimizer = _device_optimizer(config, layout, size)
    on_host = weights if offload or device == "cpu" else 0
    runtime = worker_runtime_bytes(device)
    startup = runtime + exchange + collectives + on_host + config.data.corpus_bytes
    startup += _initial_values_bytes(model, layout)
    others = units[1:]
    return WorkerPlan(
        device=device,
        offload=offload,
        buffers={"weights": weights, "exchange": exchange, **({"collectives": collectives} if collectives else {})},
        range_elements=layout.worker_size,
        units=len(others),
        max_unit_params=settings.max_unit_params,
        largest_unit=max((u.numel for u in others), default=0),
        reshard_after_forward=settings.reshard_after_forward,
        kept_gathered_units=len(others) - len(regathered) if settings.reshard_after_forward else 0,
        gathered_bytes=gathered,
        gradient_bytes=gradients,
        transient_bytes=transient,
        activation_bytes=activations,
        activation_checkpointing=settings.activation_checkpointing,
        pinned_bytes=exchange + (weights if offload else 0) if device == "cuda" else 0,
        shared_memory_bytes=exchange if transport != "grpc" else 0,
        host_transient_bytes=chunk * size.compute if offload else 0,
        corpus_bytes=config.data.corpus_bytes,
        allocator_kept_bytes=_allocator_kept(config, device, gathered + gradients + transient + activations),
        runtime_bytes=runtime,
        startup_host_bytes=startup,
        traffic=_traffic(config, layout, units, regathered, unit_files if on_nvme else None, size),
        nvme_weight_bytes=sum(unit_files) if on_nvme else 0,
        device_state_bytes=optimizer.state_bytes,
        device_update_bytes=optimizer.update_bytes,
        device_state_per_element=optimizer.per_element,
        weight_window=settings.weight_window if on_nvme else 0,
    )


def _weights_all_in_memory(layout: Layout, size: _Itemsizes) -> int:
    """FSDP2's local shards of every unit, in the compute dtype; rank 0 holds the most (the
    last ranks' dim-0 chunks run short or empty)."""
    return sum(place.local_numel(0) for place in layout.params) * size.compute


def _weights_in_window(layout: Layout, size: _Itemsizes, window: int, unit_files: Sequence[int]) -> int:
    """With weights on NVMe, the weight shards in memory: the root's, ``window`` units
    (their padded chunks, as allocated) and the files' read buffers."""
    root_weights = sum(place.local_numel(0) for place in layout.unit_params(0)) * size.compute
    largest_chunks = max(sum(s.padded_numel for s in layout.unit_params(u.index)) for u in layout.units[1:])
    read_buffers = WEIGHT_READ_BUFFERS * max(unit_files)
    return root_weights + window * largest_chunks * size.compute + read_buffers


def _gathered_bytes(units: Sequence[_UnitSize], regathered: Collection[int], world: int, size: _Itemsizes) -> int:
    """Units unsharded at once on the device (upper bound): the root, the units in flight
    and the all-gather buffer of the unit arriving (none to gather alone)."""
    root, others = units[0], units[1:]
    kept = [u.numel for g, u in enumerate(others, start=1) if g not in regathered]
    freed = [u.numel for g, u in enumerate(others, start=1) if g in regathered]
    # The unit computed and the one prefetched; the units kept from their forward to their
    # backward, with the one prefetched after them (every unit without resharding).
    in_flight = max(sum(sorted((u.numel for u in others), reverse=True)[:2]), sum(kept) + max(freed, default=0))
    gather_buffer = max(world * u.chunk for u in units) if world > 1 else 0
    return (root.numel + in_flight + gather_buffer) * size.compute


def _gradient_bytes(units: Sequence[_UnitSize], world: int, size: _Itemsizes) -> int:
    """Gradients on the device during backward (upper bound): the root's, and the larger of
    a unit's with its reduce-scatter and the root's reduce-scatter."""

    def reduce_scatter(unit: _UnitSize) -> int:  # FSDP2's input (W chunks) and output, wire dtype
        return (world + 1) * unit.chunk * size.wire

    root, others = units[0], units[1:]
    return root.numel * size.compute + max(
        max(u.numel * size.compute + reduce_scatter(u) for u in others), reduce_scatter(root)
    )


def _transient_bytes(chunk: int, size: _Itemsizes, offload: bool) -> int:
    """Other per-step temporaries on the device (upper bound), for units of at most
    ``chunk`` elements on a worker."""
    squares = min(chunk, SQUARES_CHUNK) * 8  # the norm's fp64 cast, a piece at a time
    cast = chunk * size.compute if size.wire != size.compute else 0
    return squares + cast + (2 * chunk * size.compute if offload else 0)


def _device_optimizer(config: TrainConfig, layout: Layout, size: _Itemsizes) -> _DeviceOptimizer:
    """What rank 0's device segments take of its compute device."""
    on_device = layout.device_segments(0)
    staged = size.push if config.optim.staged else 0
    slots = config.worker.exchange_slots
    per_element = bytes_per_parameter(config.optim.state_dtype) + staged
    per_element += slots * size.compute * layout.largest_unit / layout.worker_size
    return _DeviceOptimizer(
        state_bytes=sum(stored_bytes(config.optim.state_dtype, s.numel) + s.numel * staged for s in on_device),
        update_bytes=slots * max((s.numel for s in on_device), default=0) * size.compute,
        per_element=per_element,
    )


def _initial_values_bytes(model: torch.nn.Module, layout: Layout) -> int:
    """Host memory the initial values take while the worker starts: one module's full fp32
    values and one unit's fp32 chunk (registered with the servers a unit at a time)."""
    one_module = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return one_module * FP32_BYTES + max(u.stop - u.start for u in layout.units) * FP32_BYTES


def _traffic(
    config: TrainConfig,
    layout: Layout,
    units: Sequence[_UnitSize],
    regathered: Collection[int],
    unit_files: Sequence[int] | None,
    size: _Itemsizes,
) -> WorkerTraffic:
    """The bytes rank 0 moves per step; ``unit_files`` are its units' weight files (None:
    weights in memory)."""
    world = layout.num_workers
    gathers = sum(u.chunk for u in units) + sum(units[g].chunk for g in regathered)
    weight_reads = 0
    if unit_files is not None:
        window = config.worker.weight_window
        reads = reads_per_micro_batch(range(1, len(units)), window=window, backward=regathered)
        weight_reads = config.data.micro_batches * sum(unit_files[g - 1] for g in reads)
    return WorkerTraffic(
        reduce_scatter_bytes=(world - 1) * sum(u.chunk for u in units) * size.wire,
        all_gather_bytes=(world - 1) * gathers * size.compute,
        push_bytes=layout.worker_size * size.push,
        fetch_bytes=layout.worker_size * size.compute,
        weight_read_bytes=weight_reads,
        weight_write_bytes=sum(unit_files) if unit_files is not None else 0,  # each file once, after the update
    )


def _allocator_kept(config: TrainConfig, device: str, step_buffers: int) -> int:
    """What the worker's allocator keeps of ``step_buffers`` (the per-step buffers)."""
    kept = worker_allocator(config.worker, config.cluster) == "mimalloc" and device == "cpu"
    return round(MIMALLOC_KEPT_SHARE * step_buffers) if kept else 0
