"""``cargohold plan``: the memory each tier needs and the bytes each step moves, from the
config and a cluster description, before anything is launched.

    cargohold plan --config examples/demo.yaml --host-memory 16GiB
    cargohold plan --config examples/llama-13b-1gpu.yaml --device-memory 24GiB --host-memory 256GiB --nvme 2TiB
    cargohold plan --config train.yaml --device-memory 80GiB --host-memory 480GiB --nvme 100GiB --json
    cargohold plan --config train.yaml --cluster cluster.yaml      # node groups, see ClusterDescription

Exit status: 0 when every checked resource fits, 3 when one does not (the reason is
printed per resource), 2 for a bad config or cluster description.

Everything is computed from the same code a run uses: the model is built on the meta
device and cut into FSDP2 units and laid out by ``model_layout`` (what every worker
does), and each state server's partitions are placed by the tier planner itself
(``plan_tiers`` over the same ``PartitionDemand`` list ``TieredStorage`` builds). So:

* a worker's **buffers** (``weights``: its FSDP2 shards, the most any rank holds;
  ``exchange``: ``worker.exchange_slots`` gradient and weight slots of the largest unit,
  and the weights of its whole range with the delayed update) are
  exactly the sizes ``TrainingWorker.resident_bytes()`` reports;
* a state server's **state in RAM / on NVMe** (12 bytes per element) is exactly what it
  reports as ``cargohold_state_resident_bytes{tier}`` once every partition sits in its
  planned tier (partitions move after their first update); the **memory** those
  partitions occupy is their 4 KiB-aligned file layout (header and padding: at most
  16 KiB more per partition), which is what the RAM tier allocates and what the files
  hold on disk;
* push and fetch bytes are what the workers count in ``cargohold_transport_*_bytes_total``.

A worker's memory follows FSDP2 (ZeRO-3): between steps it holds its 1/W shards (on the
device, or in pinned host memory with ``worker.offload_params``) and its exchange
buffers (host memory). During a step the device also holds, at most, the root unit
(embeddings, final norm, head: gathered from forward to backward) and two blocks (the
one computed and the one FSDP2 prefetches; every block with
``worker.reshard_after_forward: false``) unsharded in the compute dtype, the all-gather
buffer of the unit arriving, the root's gradients (reduced only when backward ends) and
one unit's unsharded gradients with FSDP2's reduce-scatter input and output (wire
dtype), and the activations (all of them, or with ``worker.activation_checkpointing:
blocks`` each block's input plus one block's recomputed activations).

Estimates and bounds, said as such in the output: activations (a formula, see
:func:`activation_bytes_estimate`), units in flight and per-step temporaries (upper
bounds: everything FSDP2 and the step may hold at once, counted as if at the same
moment), the state servers' per-step temporaries (every transfer a server may hold at
once), NVMe reads (at most every disk partition; those still in a staging buffer from
the previous step are not read again). Not counted at all: the Python/torch/Ray runtime
of each process (~0.5-1 GiB), the CUDA context and allocator caching and fragmentation,
NCCL's buffers, Ray's object store, and anything else running on the node.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from cargohold.cluster.config import TrainConfig, read_yaml_mapping
from cargohold.cluster.sizes import format_bytes, parse_size
from cargohold.services.dtypes import WIRE_DTYPES
from cargohold.services.errors import ConfigError, LayoutError
from cargohold.services.layout import Layout
from cargohold.services.state_port import exchange_nbytes
from cargohold.services.tiers.fileformat import FileLayout
from cargohold.services.tiers.partitions import STATE_BYTES_PER_ELEMENT, elements_per_partition, split_segment
from cargohold.services.tiers.planner import PartitionDemand, TierPlan, plan_tiers
from cargohold.services.tiers.residency import PartitionKey, Residency

if TYPE_CHECKING:
    from cargohold.services.sharding import Unit

EXIT_FITS = 0
EXIT_DOES_NOT_FIT = 3

_DTYPE_BYTES = {name: dtype.itemsize for name, dtype in WIRE_DTYPES.items()}
_FP32 = 4


# --- the cluster --------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class NodeGroup:
    """``count`` identical nodes, each running ``workers`` workers and ``servers`` state servers."""

    count: int = 1
    workers: int = 0
    servers: int = 0
    host_memory_bytes: int | None = None
    """RAM of each node; None leaves host memory unchecked."""

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ConfigError(f"a node group's count must be >= 1, got {self.count}")
        if self.workers < 0 or self.servers < 0:
            raise ConfigError(f"a node group's workers and servers must be >= 0, got {self.workers}, {self.servers}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterDescription:
    """What the run will get. A YAML file holds the same keys, sizes as numbers of bytes or
    strings like ``80GiB``::

        device_memory: 80GiB      # each worker's accelerator; absent: workers run on CPUs
        nvme: 100GiB              # free NVMe of each state server, all its tier paths together
        host_memory: 64GiB        # default RAM of a node (for groups that do not say)
        nodes:                    # absent: one node runs every worker and state server
          - {count: 1, workers: 8, servers: 0, host_memory: 480GiB}
          - {count: 2, workers: 0, servers: 1}
    """

    device_memory_bytes: int | None = None
    nvme_bytes: int | None = None
    nodes: tuple[NodeGroup, ...] = ()
    """Empty: one node holding every worker and state server of the config."""

    def groups(self, config: TrainConfig) -> tuple[NodeGroup, ...]:
        return self.nodes or (NodeGroup(workers=config.worker.num_workers, servers=config.state_server.num_servers),)


_CLUSTER_KEYS = {"device_memory", "nvme", "host_memory", "nodes"}
_GROUP_KEYS = {"count", "workers", "servers", "host_memory"}


def load_cluster(
    path: str | Path | None = None,
    *,
    config: TrainConfig,
    device_memory: str | None = None,
    host_memory: str | None = None,
    nvme: str | None = None,
) -> ClusterDescription:
    """The cluster from a YAML file and/or flags (a flag replaces the file's top-level key
    of the same name); ConfigError names what is wrong."""
    data: dict[str, Any] = {}
    if path is not None:
        data = read_yaml_mapping(path, "cluster file")
        unknown = sorted(set(data) - _CLUSTER_KEYS, key=str)
        if unknown:
            raise ConfigError(f"unknown cluster key {unknown[0]!r}; known keys: {', '.join(sorted(_CLUSTER_KEYS))}")
    flags = {"device_memory": device_memory, "host_memory": host_memory, "nvme": nvme}
    data.update({k: v for k, v in flags.items() if v is not None})

    def size(mapping: Mapping[str, Any], key: str, what: str) -> int | None:
        value = mapping.get(key)
        return None if value is None else parse_size(value, what)

    host = size(data, "host_memory", "host_memory (--host-memory)")
    groups = []
    if not isinstance(data.get("nodes") or [], list):
        raise ConfigError(f"cluster nodes must be a list of node groups, got {data['nodes']!r}")
    for index, raw in enumerate(data.get("nodes") or ()):
        where = f"nodes[{index}]"
        if not isinstance(raw, dict):
            raise ConfigError(f"cluster {where} must be a mapping with keys {', '.join(sorted(_GROUP_KEYS))}")
        unknown = sorted(set(raw) - _GROUP_KEYS, key=str)
        if unknown:
            raise ConfigError(f"unknown cluster key {where}.{unknown[0]}; known keys: {', '.join(sorted(_GROUP_KEYS))}")
        counts = {}
        for key, default in (("count", 1), ("workers", 0), ("servers", 0)):
            value = raw.get(key, default)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"cluster {where}.{key} must be an integer, got {value!r}")
            counts[key] = value
        groups.append(
            NodeGroup(
                **counts,
                host_memory_bytes=size(raw, "host_memory", f"{where}.host_memory") if "host_memory" in raw else host,
            )
        )
    if not groups:
        groups = [
            NodeGroup(
                workers=config.worker.num_workers, servers=config.state_server.num_servers, host_memory_bytes=host
            )
        ]
    return ClusterDescription(
        device_memory_bytes=size(data, "device_memory", "device_memory (--device-memory)"),
        nvme_bytes=size(data, "nvme", "nvme (--nvme)"),
        nodes=tuple(groups),
    )


# --- the plan -----------------------------------------------------------------------------
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


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerPlan:
    """One worker: rank 0, which holds the most of FSDP2's uneven dim-0 shards."""

    device: str
    """Where it computes: "cuda" or "cpu" (then its device memory is host memory)."""
    offload: bool
    """Its weight shards live in host memory (``worker.offload_params`` on a GPU)."""
    buffers: dict[str, int]
    """What it holds between steps, keyed as ``TrainingWorker.resident_bytes()``: its FSDP2
    weight shards (compute dtype) and its exchange buffers (slots of the largest unit's
    gradients in the wire dtype and weights in the compute dtype; with the delayed update
    also ``range_elements`` weights)."""
    range_elements: int
    """Elements of its range of the flat space (``layout.worker_size``)."""
    blocks: int
    """Transformer blocks, each one FSDP2 unit (the root is one more)."""
    reshard_after_forward: bool
    """``worker.reshard_after_forward``: blocks are gathered again for backward."""
    gathered_bytes: int
    """Units unsharded at once on the device, in the compute dtype (upper bound): the root,
    the block computed and the one prefetched (every block without
    ``reshard_after_forward``), and the all-gather buffer of the unit arriving."""
    gradient_bytes: int
    """Gradients on the device during backward (upper bound): the root's unsharded
    gradients (reduced when backward ends) plus the larger of a block's unsharded
    gradients with its reduce-scatter input and output (wire dtype) and the root's
    reduce-scatter input and output. None persists: reduced gradients are copied to the
    exchange buffer and dropped."""
    transient_bytes: int
    """Other per-step temporaries on the device (upper bound): the fp64 copy of a unit's
    reduced gradient for the norm, its cast to the weights' dtype when the wire dtype
    differs, and with offload the shards of the two units in flight copied in."""
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
    startup_host_bytes: int
    """Host memory while it starts: the buffers held in host memory, one module's full
    fp32 initial values and one unit's fp32 initial chunk (registered with the servers a
    unit at a time); the model itself is only ever built on the meta device."""
    traffic: WorkerTraffic

    @property
    def device_bytes(self) -> int:
        """Resident on the compute device between steps: the weight shards unless offloaded."""
        return 0 if self.offload else self.buffers["weights"]

    @property
    def device_peak_bytes(self) -> int:
        return (
            self.device_bytes + self.gathered_bytes + self.gradient_bytes + self.transient_bytes + self.activation_bytes
        )

    @property
    def host_bytes(self) -> int:
        """Host memory while training: the exchange buffers, offloaded shards, temporaries
        and corpus; on a CPU also everything the device total counts."""
        on_host = self.device_peak_bytes if self.device == "cpu" else 0
        offloaded = self.buffers["weights"] if self.offload else 0
        return on_host + self.buffers["exchange"] + offloaded + self.host_transient_bytes + self.corpus_bytes

    @property
    def host_peak_bytes(self) -> int:
        return max(self.host_bytes, self.startup_host_bytes)


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerTraffic:
    """Bytes one state server moves per step."""

    push_bytes: int
    """Gradients received (wire dtype) for its range."""
    fetch_bytes: int
    """Weights sent (compute dtype) for its range."""
    nvme_write_bytes: int
    """Every disk partition is written back once per step."""
    nvme_read_bytes: int
    """At most every disk partition is read once per step."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerPlan:
    """One state server: its range of the flat buffer and where that state lives."""

    index: int
    elements: int
    segments: int
    partitions: int
    partitions_on_nvme: int
    ram_state_bytes: int
    """State (12 B/element) planned in RAM: ``cargohold_state_resident_bytes{tier="ram"}``."""
    nvme_state_bytes: int
    """State planned on NVMe: ``cargohold_state_resident_bytes{tier="nvme"}``."""
    ram_resident_bytes: int
    """Memory the resident partitions occupy (their 4 KiB-aligned file layout)."""
    staging_bytes: int
    """Staging buffers of the NVMe tier (0 without one)."""
    gradient_bytes: int
    """Gradients held during a step: staged until CommitStep when clipping or checking the
    norm, else those in flight (upper bound)."""
    update_temp_bytes: int
    """fp32 copies of the gradient of the partitions being updated at once (upper bound)."""
    weights_bytes: int
    """Updated weights in the compute dtype waiting for their fetch, plus the streamed
    copies of those being fetched (upper bound)."""
    nvme_file_bytes: int
    """Partition files on disk."""
    nvme_need_bytes: int
    """Files plus room for the writes in flight (what start-up checks against free space)."""
    nvme_bytes_by_path: dict[str, int]
    traffic: ServerTraffic
    checkpoint_bytes: int = 0
    """Payload files one checkpoint holds for this server (0 without ``checkpoint.dir``)."""
    checkpoint_written_bytes: int = 0
    """Of those, bytes written per checkpoint (the rest are the NVMe tier's files,
    hard-linked; copied instead when ``checkpoint.dir`` is on another filesystem)."""
    checkpoint_snapshot_bytes: int = 0
    """RAM a checkpoint copies the state into until written (all-RAM state only): the
    partitions' file layouts, as the RAM tier holds them."""

    @property
    def ram_bytes(self) -> int:
        """Memory the tiers hold: the part ``state_server.tier.ram_budget_bytes`` limits."""
        return self.ram_resident_bytes + self.staging_bytes

    @property
    def ram_peak_bytes(self) -> int:
        return (
            self.ram_bytes
            + self.gradient_bytes
            + self.update_temp_bytes
            + self.weights_bytes
            + self.checkpoint_snapshot_bytes
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Check:
    """One resource: what the run needs of it, what the cluster has, and the verdict."""

    resource: str
    need: int
    available: int | None
    fits: bool | None
    """None: not checked (the cluster description does not say how much there is)."""
    reason: str
    unit: str = "bytes"


@dataclass(frozen=True, slots=True, kw_only=True)
class RunPlan:
    """What one run needs of every tier, what each step moves, and the verdict per resource."""

    parameters: int
    """Real parameter elements of the model."""
    flat_elements: int
    """Length of the flat buffer, padding included."""
    num_workers: int
    num_servers: int
    compute_dtype: str
    grad_wire_dtype: str
    transport: str
    """How pushes and fetches travel: "shared_memory", "grpc", or "mixed"."""
    worker: WorkerPlan
    servers: tuple[ServerPlan, ...]
    checks: tuple[Check, ...]
    checkpoint_keep_last: int = 0
    """``checkpoint.keep_last`` when checkpoints are on (``checkpoint.dir``), else 0."""
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def fits(self) -> bool:
        return all(check.fits is not False for check in self.checks)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``--json``, derived totals included."""
        data = dataclasses.asdict(self)
        data["fits"] = self.fits
        data["worker"].update(
            device_bytes=self.worker.device_bytes,
            device_peak_bytes=self.worker.device_peak_bytes,
            host_bytes=self.worker.host_bytes,
            host_peak_bytes=self.worker.host_peak_bytes,
        )
        for out, server in zip(data["servers"], self.servers):
            out.update(ram_bytes=server.ram_bytes, ram_peak_bytes=server.ram_peak_bytes)
        return data


def plan_run(config: TrainConfig, cluster: ClusterDescription | None = None) -> RunPlan:
    """What ``config`` needs of every tier and moves per step, checked against ``cluster``."""
    cluster = cluster or ClusterDescription()
    model, units, layout = _layout(config)
    device = _worker_device(config, cluster)
    groups = cluster.groups(config)
    transport = _transport(config, device, groups)
    worker = _plan_worker(config, layout, model, device, transport, activation_bytes_estimate(config, model))
    servers = tuple(_plan_server(config, layout, s, transport) for s in range(layout.num_servers))
    checks = _checks(config, cluster, groups, worker, servers)
    notes = [
        "activations are an estimate (fused attention, no s x s score matrix); units in flight, "
        "per-step temporaries and NVMe reads are upper bounds",
        "not counted: each process's Python/torch/Ray runtime (~0.5-1 GiB), the CUDA context, "
        "caching allocator and NCCL buffers, Ray's object store",
    ]
    if config.worker.offload_params and device == "cpu":
        notes.append(
            "worker.offload_params does nothing for CPU workers (their weights are in host memory "
            "anyway); planned without it"
        )
    return RunPlan(
        parameters=layout.num_real_elements,
        flat_elements=layout.total,
        num_workers=layout.num_workers,
        num_servers=layout.num_servers,
        compute_dtype=config.worker.compute_dtype,
        grad_wire_dtype=config.worker.grad_wire_dtype,
        transport=transport,
        worker=worker,
        servers=servers,
        checks=checks,
        notes=tuple(notes),
        checkpoint_keep_last=config.checkpoint.keep_last if config.checkpoint.dir is not None else 0,
    )


def _layout(config: TrainConfig) -> tuple[torch.nn.Module, list[Unit], Layout]:
    """The meta-device model, its FSDP2 units and the layout every worker computes
    (shapes only; nothing allocated, nothing read)."""
    from cargohold.services.model_setup import model_layout

    try:
        return model_layout(config)
    except LayoutError as error:
        raise ConfigError(f"the model cannot be laid out: {error}") from error


def _worker_device(config: TrainConfig, cluster: ClusterDescription) -> str:
    requested = config.worker.device
    if requested == "auto":  # a plan cannot look for GPUs: the cluster description says
        return "cuda" if cluster.device_memory_bytes is not None else "cpu"
    return requested


def _transport(config: TrainConfig, device: str, groups: Sequence[NodeGroup]) -> str:
    """Shared memory where a CPU worker and a state server share a node (worker.shared_memory)."""
    if device != "cpu" or config.worker.shared_memory == "off":
        return "grpc"
    if len(groups) == 1 and groups[0].count == 1:
        return "shared_memory"
    return "mixed" if any(g.workers and g.servers for g in groups) else "grpc"


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
            numel=sum(s.numel for s in layout.group_params(g.index)),
            chunk=sum(s.slot_numel for s in layout.group_params(g.index)),
        )
        for g in layout.groups
    ]


def _plan_worker(
    config: TrainConfig, layout: Layout, model: torch.nn.Module, device: str, transport: str, activations: int
) -> WorkerPlan:
    settings = config.worker
    compute = _DTYPE_BYTES[settings.compute_dtype]
    wire = _DTYPE_BYTES[settings.grad_wire_dtype]
    world = layout.num_workers
    offload = settings.offload_params and device == "cuda"
    # FSDP2's local shards, in the compute dtype; rank 0 holds the most (the last ranks'
    # dim-0 chunks run short or empty).
    weights = sum(slot.local_numel(0) for slot in layout.params) * compute
    exchange = exchange_nbytes(
        layout.largest_group,
        wire,
        compute,
        slots=settings.exchange_slots,
        held_numel=layout.worker_size if settings.delayed_update else 0,
    )
    units = _unit_sizes(layout)
    root, blocks = units[0], units[1:]
    if settings.reshard_after_forward:  # the block computed and the one prefetched
        in_flight = sum(sorted((u.numel for u in blocks), reverse=True)[:2])
    else:  # every block stays gathered from its forward to its backward
        in_flight = sum(u.numel for u in blocks)
    gather_buffer = max(world * u.chunk for u in units) if world > 1 else 0  # none to gather alone
    gathered = (root.numel + in_flight + gather_buffer) * compute

    def reduce_scatter(unit: _UnitSize) -> int:  # FSDP2's input (W chunks) and output, wire dtype
        return (world + 1) * unit.chunk * wire

    gradients = root.numel * compute + max(
        max(u.numel * compute + reduce_scatter(u) for u in blocks), reduce_scatter(root)
    )
    chunk = max(u.chunk for u in units)
    transient = chunk * 8 + (chunk * compute if wire != compute else 0) + (2 * chunk * compute if offload else 0)

    on_host = weights if offload or device == "cpu" else 0
    one_module = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    startup = (
        exchange
        + on_host
        + config.data.corpus_bytes
        + one_module * _FP32
        + max(g.stop - g.start for g in layout.groups) * _FP32
    )
    gathers = sum(u.chunk for u in units) + (sum(u.chunk for u in blocks) if settings.reshard_after_forward else 0)
    return WorkerPlan(
        device=device,
        offload=offload,
        buffers={"weights": weights, "exchange": exchange},
        range_elements=layout.worker_size,
        blocks=len(blocks),
        reshard_after_forward=settings.reshard_after_forward,
        gathered_bytes=gathered,
        gradient_bytes=gradients,
        transient_bytes=transient,
        activation_bytes=activations,
        activation_checkpointing=settings.activation_checkpointing,
        pinned_bytes=exchange + (weights if offload else 0) if device == "cuda" else 0,
        shared_memory_bytes=exchange if transport != "grpc" else 0,
        host_transient_bytes=chunk * compute if offload else 0,
        corpus_bytes=config.data.corpus_bytes,
        startup_host_bytes=startup,
        traffic=WorkerTraffic(
            reduce_scatter_bytes=(world - 1) * sum(u.chunk for u in units) * wire,
            all_gather_bytes=(world - 1) * gathers * compute,
            push_bytes=layout.worker_size * wire,
            fetch_bytes=layout.worker_size * compute,
        ),
    )


def activation_bytes_estimate(config: TrainConfig, model: torch.nn.Module | None = None) -> int:
    """Activations backward keeps for one batch, after Korthikanti et al. 2022 ("Reducing
    Activation Recomputation in Large Transformer Models", eq. 1): 34·s·b·h bytes per layer
    at 2-byte activations for a 4h-wide MLP, without the 5·a·s²·b of a materialised score
    matrix (the models use fused attention), scaled to the compute dtype. Of the 34, 16
    are the MLP's wide tensors (its up-projection's output and the activation's, 2 bytes
    each at width 4h); for a model (``model``, on the meta device) with another MLP width
    ``I`` or a gated MLP (SwiGLU: gate and up outputs, the activation's, their product)
    they become 4·I per up-projection, so a layer keeps 18·h + 4·k·I, k the number of
    up-projections. With ``worker.activation_checkpointing: blocks`` only each block's
    input (s·b·h) stays, plus one block's full activations while it is recomputed. Plus
    the logits in the compute dtype, their fp32 copy for the loss and its gradient."""
    layers, width, vocab = config.model.n_layer, config.model.n_embd, config.model.vocab_size
    intermediate, up_projections = 4 * width, 1
    inner = getattr(getattr(model, "hf", None), "config", None)  # HFCausalLM.hf: the PreTrainedModel
    if config.hf.enabled and inner is not None:
        layers = getattr(inner, "num_hidden_layers", layers)
        width = getattr(inner, "hidden_size", width)
        vocab = getattr(inner, "vocab_size", vocab)
        intermediate = next(
            (
                v
                for v in (getattr(inner, key, None) for key in ("intermediate_size", "n_inner", "ffn_dim"))
                if isinstance(v, int) and v > 0
            ),
            intermediate,
        )
    if model is not None and intermediate != width:
        up_projections = max(1, _matrices_of_width(model, width, intermediate) - 1)  # less the down-projection
    compute = _DTYPE_BYTES[config.worker.compute_dtype]
    tokens = config.data.batch_size * config.model.block_size
    per_layer = tokens * (18 * width + 4 * up_projections * intermediate) * compute // 2
    logits = tokens * vocab * (compute + 2 * _FP32)
    if config.worker.activation_checkpointing == "blocks":
        return layers * tokens * width * compute + per_layer + logits
    return layers * per_layer + logits


def _matrices_of_width(model: torch.nn.Module, width: int, intermediate: int) -> int:
    """Weight matrices of the first transformer block mapping ``width`` to ``intermediate``
    or back (either orientation: transformers' Conv1D stores them transposed)."""
    from cargohold.services.models.blocks import transformer_blocks

    _, block = transformer_blocks(model)[0]
    shapes = {(width, intermediate), (intermediate, width)}
    return sum(1 for p in block.parameters() if tuple(p.shape) in shapes)


def _plan_server(config: TrainConfig, layout: Layout, index: int, transport: str) -> ServerPlan:
    tier = config.state_server.tier
    compute = _DTYPE_BYTES[config.worker.compute_dtype]
    wire = _DTYPE_BYTES[config.worker.grad_wire_dtype]
    budget = tier.ram_budget_bytes
    max_elements = elements_per_partition(tier.partition_bytes) if budget is not None else None
    run_id = config.run_id or "plan"
    segments = layout.segments_of_server(index)
    spans = {
        s.segment_id: split_segment(s.numel, [(f.segment_start, f.length) for f in s.fragments], max_elements)
        for s in segments
    }
    # The demands TieredStorage._replan gives the planner: every partition in its file layout.
    numel = {PartitionKey(run_id, sid, span.index): span.numel for sid, parts in spans.items() for span in parts}
    staging = tier.staging_bytes() if budget is not None else 0
    plan: TierPlan = plan_tiers(
        [PartitionDemand(key, FileLayout(n).file_bytes) for key, n in numel.items()],
        ram_budget_bytes=budget,
        staging_bytes=staging,
        num_paths=max(1, len(tier.nvme_paths)),
    )
    on_disk = [k for k in numel if plan.of(k) is Residency.NVME]
    if config.checkpoint.dir is None:
        checkpoint_bytes = checkpoint_written = snapshot = 0
    else:  # one partition file each: disk ones hard-linked, RAM ones written (from a copy without a budget)
        checkpoint_bytes = sum(FileLayout(n).file_bytes for n in numel.values())
        checkpoint_written = checkpoint_bytes - sum(FileLayout(numel[k]).file_bytes for k in on_disk)
        snapshot = checkpoint_bytes if budget is None else 0
    by_path: dict[str, int] = {}
    for key in on_disk:
        path = tier.nvme_paths[plan.path_index[key]]
        by_path[path] = by_path.get(path, 0) + FileLayout(numel[key]).file_bytes
    nvme_state = sum(numel[k] for k in on_disk) * STATE_BYTES_PER_ELEMENT
    elements = sum(s.numel for s in segments)

    threads = config.state_server.rpc_threads  # requests a server handles at once
    defer = config.optim.max_grad_norm > 0 or config.optim.nonfinite != "ignore"
    sizes = sorted((s.numel for s in segments), reverse=True)
    busiest = sum(sizes[:threads])
    largest_partition = sorted((max(p.numel for p in parts) for parts in spans.values()), reverse=True)
    return ServerPlan(
        index=index,
        elements=elements,
        segments=len(segments),
        partitions=len(numel),
        partitions_on_nvme=len(on_disk),
        ram_state_bytes=elements * STATE_BYTES_PER_ELEMENT - nvme_state,
        nvme_state_bytes=nvme_state,
        ram_resident_bytes=plan.ram_bytes,
        staging_bytes=staging,
        gradient_bytes=(elements if defer else busiest) * wire,
        update_temp_bytes=sum(largest_partition[:threads]) * _FP32,
        weights_bytes=(elements + (0 if transport == "shared_memory" else busiest)) * compute,
        nvme_file_bytes=plan.nvme_bytes,
        nvme_need_bytes=plan.nvme_bytes + staging if on_disk else 0,
        nvme_bytes_by_path=by_path,
        traffic=ServerTraffic(
            push_bytes=elements * wire,
            fetch_bytes=elements * compute,
            nvme_write_bytes=plan.nvme_bytes,
            nvme_read_bytes=plan.nvme_bytes,
        ),
        checkpoint_bytes=checkpoint_bytes,
        checkpoint_written_bytes=checkpoint_written,
        checkpoint_snapshot_bytes=snapshot,
    )


def _checks(
    config: TrainConfig,
    cluster: ClusterDescription,
    groups: Sequence[NodeGroup],
    worker: WorkerPlan,
    servers: Sequence[ServerPlan],
) -> tuple[Check, ...]:
    checks = []
    for role, want, have in (
        ("worker slots", config.worker.num_workers, sum(g.count * g.workers for g in groups)),
        ("state-server slots", config.state_server.num_servers, sum(g.count * g.servers for g in groups)),
    ):
        checks.append(
            Check(
                resource=role,
                need=want,
                available=have,
                fits=have >= want,
                unit="count",
                reason=(
                    f"the cluster has room for {have}"
                    if have >= want
                    else f"the config asks for {want} but the node groups hold {have}; add nodes or lower the count"
                ),
            )
        )

    if worker.device == "cuda":
        settings = config.worker
        remedies = [
            *(["set worker.offload_params=true"] if not settings.offload_params else []),
            *(["worker.activation_checkpointing=blocks"] if settings.activation_checkpointing == "off" else []),
            *(["worker.compute_dtype=bfloat16"] if settings.compute_dtype == "float32" else []),
            "add workers",
            "lower data.batch_size or model.block_size",
        ]
        checks.append(
            _check(
                "device memory per worker",
                worker.device_peak_bytes,
                cluster.device_memory_bytes,
                "--device-memory",
                ", ".join(remedies[:-1]) + " or " + remedies[-1],
            )
        )
    server_peak = max(s.ram_peak_bytes for s in servers)
    for number, group in enumerate(groups, 1):
        name = f"node group {number} ({group.count} x {group.workers} workers + {group.servers} servers)"
        need = group.workers * worker.host_peak_bytes + group.servers * server_peak
        checks.append(
            _check(
                f"host RAM per node, {name}",
                need,
                group.host_memory_bytes,
                "--host-memory",
                "set or lower state_server.tier.ram_budget_bytes, or spread the actors over more nodes",
            )
        )
    if config.state_server.tier.ram_budget_bytes is not None:
        for server in servers:
            checks.append(
                _check(
                    f"NVMe of state server {server.index}",
                    server.nvme_need_bytes,
                    cluster.nvme_bytes,
                    "--nvme",
                    "free space, add state_server.tier.nvme_paths, or raise the RAM budget",
                )
            )
    return tuple(checks)


def _check(resource: str, need: int, available: int | None, flag: str, remedy: str) -> Check:
    if available is None:
        return Check(
            resource=resource,
            need=need,
            available=None,
            fits=None,
            reason=f"not checked; give {flag} (or the cluster file) to check it",
        )
    if need <= available:
        return Check(
            resource=resource,
            need=need,
            available=available,
            fits=True,
            reason=f"{format_bytes(available - need)} to spare",
        )
    return Check(
        resource=resource,
        need=need,
        available=available,
        fits=False,
        reason=f"{format_bytes(need - available)} short; {remedy}",
    )


# --- output -------------------------------------------------------------------------------
_LABEL = 33
"""Width of the row names in :func:`render`."""


def render(plan: RunPlan) -> str:
    """The plan as a table in human units."""
    w, b = plan.worker, format_bytes
    lines = [
        f"cargohold plan: {plan.parameters:,} parameters ({plan.flat_elements:,} in the flat buffer), "
        f"{plan.num_workers} worker{'s' * (plan.num_workers != 1)} on {w.device}, "
        f"{plan.num_servers} state server{'s' * (plan.num_servers != 1)}",
        f"  weights in {plan.compute_dtype}, gradients on the wire in {plan.grad_wire_dtype}, "
        f"push/fetch over {plan.transport.replace('_', ' ')}",
        "",
        f"Each worker (rank 0, the largest shards; a {w.range_elements:,}-element range of the flat buffer)",
        f"  FSDP2 units: root + {w.blocks} block{'s' * (w.blocks != 1)}"
        + (", resharded after forward" if w.reshard_after_forward else ", gathered from forward to backward")
        + f"; activation checkpointing {w.activation_checkpointing}"
        + ("; weight shards offloaded to host RAM" if w.offload else ""),
    ]
    on = "GPU" if w.device == "cuda" else "host RAM"
    host = "pinned host RAM" if w.device == "cuda" else "host RAM"
    gathered = "root + 2 blocks" if w.reshard_after_forward else f"root + {w.blocks} blocks"
    rows = [
        *([] if w.offload else [("weight shards", w.buffers["weights"], on)]),
        (f"{gathered} gathered (bound)", w.gathered_bytes, on),
        ("gradients in backward (bound)", w.gradient_bytes, on),
        ("per-step temporaries (bound)", w.transient_bytes, on),
        ("activations (estimate)", w.activation_bytes, on),
        ("= compute device total", w.device_peak_bytes, on),
        *([("weight shards (offloaded)", w.buffers["weights"], host)] if w.offload else []),
        ("exchange buffers", w.buffers["exchange"], "host RAM, shared" if w.shared_memory_bytes else host),
        *([("offload: gradient copies", w.host_transient_bytes, "host RAM")] if w.offload else []),
        ("corpus", w.corpus_bytes, "host RAM"),
        ("while training", w.host_bytes, "host RAM"),
        ("while starting", w.startup_host_bytes, "host RAM"),
        ("= host peak", w.host_peak_bytes, "host RAM"),
    ]
    lines += [f"  {name:<{_LABEL}} {b(n):>10}  {where}" for name, n, where in rows]

    names = [f"server {s.index}" for s in plan.servers]
    lines += ["", f"{'Each state server':<{_LABEL + 2}}" + "".join(f"{n:>12}" for n in names)]
    server_rows = [
        ("state in RAM (12 B/param)", lambda s: s.ram_state_bytes),
        ("state on NVMe", lambda s: s.nvme_state_bytes),
        ("RAM: resident partitions", lambda s: s.ram_resident_bytes),
        ("RAM: staging buffers", lambda s: s.staging_bytes),
        ("RAM: step gradients", lambda s: s.gradient_bytes),
        ("RAM: update temporaries", lambda s: s.update_temp_bytes),
        ("RAM: weights to fetch", lambda s: s.weights_bytes),
        ("RAM: checkpoint snapshot", lambda s: s.checkpoint_snapshot_bytes),
        ("= RAM peak", lambda s: s.ram_peak_bytes),
        ("NVMe files", lambda s: s.nvme_file_bytes),
        ("NVMe + writes in flight", lambda s: s.nvme_need_bytes),
    ]
    lines += [f"  {name:<{_LABEL}}" + "".join(f"{b(get(s)):>12}" for s in plan.servers) for name, get in server_rows]
    lines.append(
        f"  {'partitions (on NVMe)':<{_LABEL}}"
        + "".join(f"{f'{s.partitions} ({s.partitions_on_nvme})':>12}" for s in plan.servers)
    )

    t = w.traffic
    lines += [
        "",
        "Per step",
        f"  each worker: reduce-scatter {b(t.reduce_scatter_bytes)}, all-gather {b(t.all_gather_bytes)} "
        f"(ring), push {b(t.push_bytes)}, fetch {b(t.fetch_bytes)}",
    ]
    lines += [
        f"  server {s.index}: receives {b(s.traffic.push_bytes)}, sends {b(s.traffic.fetch_bytes)}"
        + (
            f", NVMe writes {b(s.traffic.nvme_write_bytes)} and reads <= {b(s.traffic.nvme_read_bytes)}"
            if s.traffic.nvme_write_bytes
            else ""
        )
        for s in plan.servers
    ]

    if any(s.checkpoint_bytes for s in plan.servers):
        total = sum(s.checkpoint_bytes for s in plan.servers)
        written = sum(s.checkpoint_written_bytes for s in plan.servers)
        kept = plan.checkpoint_keep_last
        lines += [
            "",
            "Per checkpoint",
            f"  files {b(total)}: written {b(written)}, hard-linked from the NVMe tier {b(total - written)}",
            f"  checkpoint.dir holds up to {kept + 1} while one is saved: {b((kept + 1) * total)}"
            + (
                "; on the tier's filesystem the linked files stop being shared once the tier writes newer versions"
                if written < total
                else ""
            ),
        ]

    lines += ["", "Fits"]
    for c in plan.checks:
        verdict = {True: "fits", False: "DOES NOT FIT", None: "unchecked"}[c.fits]
        need = f"{c.need}" if c.unit == "count" else b(c.need)
        have = "?" if c.available is None else (f"{c.available}" if c.unit == "count" else b(c.available))
        lines.append(f"  {verdict:<13} {c.resource}: {need} of {have} ({c.reason})")
    lines.append("")
    lines.append("=> fits" if plan.fits else "=> does not fit")
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


# --- the command --------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The cluster flags of ``cargohold plan``."""
    parser.add_argument("--cluster", metavar="FILE", help="YAML cluster description (see docs/operations.md)")
    parser.add_argument(
        "--device-memory",
        metavar="SIZE",
        help="memory of each worker's accelerator, e.g. 80GiB; "
        "absent, workers with worker.device=auto are planned on CPUs",
    )
    parser.add_argument("--host-memory", metavar="SIZE", help="RAM of each node, e.g. 256GiB")
    parser.add_argument("--nvme", metavar="SIZE", help="free NVMe of each state server, e.g. 2TiB")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def plan_command(config: TrainConfig, args: argparse.Namespace) -> int:
    """Print the plan; EXIT_FITS or EXIT_DOES_NOT_FIT. Raises ConfigError for a bad cluster."""
    cluster = load_cluster(
        args.cluster, config=config, device_memory=args.device_memory, host_memory=args.host_memory, nvme=args.nvme
    )
    plan = plan_run(config, cluster)
    print(json.dumps(plan.to_dict(), indent=2) if args.json else render(plan), file=sys.stdout, flush=True)
    return EXIT_FITS if plan.fits else EXIT_DOES_NOT_FIT
