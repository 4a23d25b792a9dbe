"""``cargohold plan``: the memory each tier needs and the bytes each step moves, from the
config and a cluster description, before anything is launched.

    cargohold plan --config examples/demo.yaml --host-memory 16GiB
    cargohold plan --config train.yaml --device-memory 80GiB --host-memory 480GiB --nvme 100GiB --json
    cargohold plan --config train.yaml --cluster cluster.yaml      # node groups, see ClusterDescription

Exit status: 0 when every checked resource fits, 3 when one does not (the reason is
printed per resource), 2 for a bad config or cluster description.

Everything is computed from the same code a run uses: the model is built on the meta
device, laid out by ``layout_for_config`` (what every worker does), and each state
server's partitions are placed by the tier planner itself (``plan_tiers`` over the same
``PartitionDemand`` list ``TieredStorage`` builds). So:

* a worker's **buffers** (``weights``, ``gradients``, ``grad_shard``) are exactly the sizes
  ``TrainingWorker.resident_bytes()`` reports;
* a state server's **state in RAM / on NVMe** (12 bytes per element) is exactly what it
  reports as ``cargohold_state_resident_bytes{tier}`` once every partition sits in its
  planned tier (partitions move after their first update); the **memory** those
  partitions occupy is their 4 KiB-aligned file layout (header and padding: at most
  16 KiB more per partition), which is what the RAM tier allocates and what the files
  hold on disk;
* push and fetch bytes are what the workers count in ``cargohold_transport_*_bytes_total``.

Estimates and bounds, said as such in the output: activations (a formula, see
:func:`activation_bytes_estimate`), per-step temporaries (upper bounds: every transfer a
state server may hold at once), NVMe reads (at most every disk partition; those still in
a staging buffer from the previous step are not read again). Not counted at all: the
Python/torch/Ray runtime of each process (~0.5-1 GiB), the CUDA context and allocator
caching, Ray's object store, and anything else running on the node.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cargohold.cluster.config import TrainConfig, read_yaml_mapping
from cargohold.cluster.sizes import format_bytes, parse_size
from cargohold.services.checkpoint import shard_file_bytes
from cargohold.services.errors import ConfigError, LayoutError
from cargohold.services.layout import ShardLayout
from cargohold.services.shard_state import WIRE_DTYPES
from cargohold.services.tiers.fileformat import FileLayout
from cargohold.services.tiers.partitions import STATE_BYTES_PER_ELEMENT, elements_per_partition, split_segment
from cargohold.services.tiers.planner import PartitionDemand, TierPlan, plan_tiers
from cargohold.services.tiers.residency import PartitionKey, Residency

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
    shm_bytes: int | None = None
    """Size of each node's /dev/shm; None leaves it unchecked."""

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
        shm_memory: 32GiB         # default /dev/shm of a node
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


_CLUSTER_KEYS = {"device_memory", "nvme", "host_memory", "shm_memory", "nodes"}
_GROUP_KEYS = {"count", "workers", "servers", "host_memory", "shm_memory"}


def load_cluster(path: str | Path | None = None, *, config: TrainConfig,
                 device_memory: str | None = None, host_memory: str | None = None, nvme: str | None = None,
                 shm_memory: str | None = None) -> ClusterDescription:
    """The cluster from a YAML file and/or flags (a flag replaces the file's top-level key
    of the same name); ConfigError names what is wrong."""
    data: dict[str, Any] = {}
    if path is not None:
        data = read_yaml_mapping(path, "cluster file")
        unknown = sorted(set(data) - _CLUSTER_KEYS, key=str)
        if unknown:
            raise ConfigError(f"unknown cluster key {unknown[0]!r}; known keys: {', '.join(sorted(_CLUSTER_KEYS))}")
    flags = {"device_memory": device_memory, "host_memory": host_memory, "nvme": nvme, "shm_memory": shm_memory}
    data.update({k: v for k, v in flags.items() if v is not None})

    def size(mapping: Mapping[str, Any], key: str, what: str) -> int | None:
        value = mapping.get(key)
        return None if value is None else parse_size(value, what)

    host = size(data, "host_memory", "host_memory (--host-memory)")
    shm = size(data, "shm_memory", "shm_memory (--shm-memory)")
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
        groups.append(NodeGroup(
            **counts,
            host_memory_bytes=size(raw, "host_memory", f"{where}.host_memory") if "host_memory" in raw else host,
            shm_bytes=size(raw, "shm_memory", f"{where}.shm_memory") if "shm_memory" in raw else shm,
        ))
    if not groups:
        groups = [NodeGroup(workers=config.worker.num_workers, servers=config.state_server.num_servers,
                            host_memory_bytes=host, shm_bytes=shm)]
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
    """Sent by each worker reducing the gradients (ring algorithm: (W-1)/W of the buffer, wire dtype)."""
    all_gather_bytes: int
    """Sent by each worker gathering the weights (ring: (W-1)/W of the buffer, compute dtype)."""
    push_bytes: int
    """Its gradient shard, to the state servers, in the wire dtype."""
    fetch_bytes: int
    """Its weight shard, from the state servers, in the compute dtype."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerPlan:
    """One worker (all are the same size)."""

    device: str
    """Where it computes: "cuda" or "cpu" (then its device memory is host memory)."""
    buffers: dict[str, int]
    """The buffers it holds for training, keyed as ``TrainingWorker.resident_bytes()``."""
    shard_elements: int
    device_bytes: int
    """Buffers on the compute device: weights, gradients, gradient and weight shard (the
    latter two in /dev/shm instead when a state server shares the node, on CPU)."""
    transient_bytes: int
    """Per-step temporaries on the device: the bucket cast to the wire dtype (when it
    differs from the compute dtype) and the fp64 copy of a piece for the norm."""
    activation_bytes: int
    """Estimate (see activation_bytes_estimate)."""
    pinned_bytes: int
    """Pinned host memory: the gradient shard's copy for device-to-host transfers (GPU only)."""
    shared_memory_bytes: int
    """/dev/shm a CPU worker uses when a state server shares its node (part of device_bytes)."""
    corpus_bytes: int
    """Training text in host memory (at most data.corpus_bytes)."""
    startup_host_bytes: int
    """Host memory while it starts: the fp32 model and its fp32 initial shard (on CPU,
    then the flat weights and gradients)."""
    traffic: WorkerTraffic

    @property
    def device_peak_bytes(self) -> int:
        return self.device_bytes + self.transient_bytes + self.activation_bytes

    @property
    def host_bytes(self) -> int:
        """Host memory while training (on CPU everything, on GPU the pinned shard and corpus)."""
        on_host = self.device_peak_bytes if self.device == "cpu" else 0
        return on_host + self.pinned_bytes + self.corpus_bytes

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
    """RAM a checkpoint copies the state into until written (all-RAM state only)."""

    @property
    def ram_bytes(self) -> int:
        """Memory the tiers hold: the part ``state_server.tier.ram_budget_bytes`` limits."""
        return self.ram_resident_bytes + self.staging_bytes

    @property
    def ram_peak_bytes(self) -> int:
        return (self.ram_bytes + self.gradient_bytes + self.update_temp_bytes + self.weights_bytes
                + self.checkpoint_snapshot_bytes)


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
        data["worker"].update(device_peak_bytes=self.worker.device_peak_bytes, host_bytes=self.worker.host_bytes,
                              host_peak_bytes=self.worker.host_peak_bytes)
        for out, server in zip(data["servers"], self.servers):
            out.update(ram_bytes=server.ram_bytes, ram_peak_bytes=server.ram_peak_bytes)
        return data


def plan_run(config: TrainConfig, cluster: ClusterDescription | None = None) -> RunPlan:
    """What ``config`` needs of every tier and moves per step, checked against ``cluster``."""
    cluster = cluster or ClusterDescription()
    layout, model = _layout(config)
    device = _worker_device(config, cluster)
    groups = cluster.groups(config)
    transport = _transport(config, device, groups)
    worker = _plan_worker(config, layout, device, transport, activation_bytes_estimate(config, model))
    servers = tuple(_plan_server(config, layout, s, transport) for s in range(layout.num_servers))
    checks = _checks(config, cluster, groups, worker, servers)
    notes = (
        "activations are an estimate (fused attention, no s x s score matrix); per-step "
        "temporaries and NVMe reads are upper bounds",
        "not counted: each process's Python/torch/Ray runtime (~0.5-1 GiB), the CUDA context "
        "and caching allocator, Ray's object store",
    )
    return RunPlan(
        parameters=layout.num_real_elements, flat_elements=layout.total, num_workers=layout.num_workers,
        num_servers=layout.num_servers, compute_dtype=config.worker.compute_dtype,
        grad_wire_dtype=config.worker.grad_wire_dtype, transport=transport, worker=worker, servers=servers,
        checks=checks, notes=notes,
        checkpoint_keep_last=config.checkpoint.keep_last if config.checkpoint.dir is not None else 0,
    )


def _layout(config: TrainConfig) -> tuple[ShardLayout, torch.nn.Module]:
    """The layout every worker computes, from the model ``build_model`` makes, built on the
    meta device (shapes only; nothing allocated, nothing read)."""
    from cargohold.services.worker import build_model, layout_for_config

    with torch.random.fork_rng(devices=[]), torch.device("meta"):  # build_model seeds torch
        model = build_model(config)
    try:
        return layout_for_config(config, model), model
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


def _plan_worker(config: TrainConfig, layout: ShardLayout, device: str, transport: str,
                 activations: int) -> WorkerPlan:
    compute = _DTYPE_BYTES[config.worker.compute_dtype]
    wire = _DTYPE_BYTES[config.worker.grad_wire_dtype]
    total, shard, world = layout.total, layout.worker_shard_size, layout.num_workers
    copies = 2 if config.worker.delayed_update else 1  # the spare weights of the delayed update
    pinned = shard * wire if device == "cuda" else 0
    buffers = {
        "weights": copies * total * compute,
        "gradients": total * compute,
        "grad_shard": shard * (wire + compute) + pinned,
    }
    largest_bucket = max(b.stop - b.start for b in layout.buckets)
    largest_piece = max(b.piece_size for b in layout.buckets)
    transient = (largest_bucket * wire if wire != compute else 0) + largest_piece * 8
    # The fp32 model is built, then moved parameter by parameter into the flat weights
    # (services/flat_params.py), the fp32 initial shard taken on the way: on a GPU the host
    # holds the model and that shard; on a CPU the flat weights replace the model as it
    # moves (one parameter overlaps), then the flat gradients join them.
    largest_param = max(slot.numel for slot in layout.params)
    startup = layout.num_real_elements * _FP32 + shard * _FP32
    if device == "cpu":
        startup = max(startup + largest_param * compute, 2 * total * compute + shard * _FP32)
    return WorkerPlan(
        device=device,
        buffers=buffers,
        shard_elements=shard,
        device_bytes=sum(buffers.values()) - pinned,
        transient_bytes=transient,
        activation_bytes=activations,
        pinned_bytes=pinned,
        shared_memory_bytes=shard * (wire + compute) if transport != "grpc" else 0,
        corpus_bytes=config.data.corpus_bytes,
        startup_host_bytes=startup,
        traffic=WorkerTraffic(
            reduce_scatter_bytes=(world - 1) * total * wire // world,
            all_gather_bytes=(world - 1) * total * compute // world,
            push_bytes=shard * wire,
            fetch_bytes=shard * compute,
        ),
    )


def activation_bytes_estimate(config: TrainConfig, model: torch.nn.Module | None = None) -> int:
    """Activations backward keeps for one batch, after Korthikanti et al. 2022 ("Reducing
    Activation Recomputation in Large Transformer Models", eq. 1): 34·s·b·h bytes per layer
    at 2-byte activations, without the 5·a·s²·b of a materialised score matrix (the models
    use fused attention), scaled to the compute dtype; plus the logits in the compute
    dtype, their fp32 copy for the loss and its gradient. An estimate: it assumes a 4h-wide
    MLP. For an ``hf`` model the sizes come from its transformers config (``model``)."""
    layers, width, vocab = config.model.n_layer, config.model.n_embd, config.model.vocab_size
    inner = getattr(getattr(model, "hf", None), "config", None)  # HFCausalLM.hf: the PreTrainedModel
    if config.hf.enabled and inner is not None:
        layers = getattr(inner, "num_hidden_layers", layers)
        width = getattr(inner, "hidden_size", width)
        vocab = getattr(inner, "vocab_size", vocab)
    compute = _DTYPE_BYTES[config.worker.compute_dtype]
    tokens = config.data.batch_size * config.model.block_size
    per_layer = 34 * tokens * width * compute // 2
    logits = tokens * vocab * (compute + 2 * _FP32)
    return layers * per_layer + logits


def _plan_server(config: TrainConfig, layout: ShardLayout, index: int, transport: str) -> ServerPlan:
    tier = config.state_server.tier
    compute = _DTYPE_BYTES[config.worker.compute_dtype]
    wire = _DTYPE_BYTES[config.worker.grad_wire_dtype]
    budget = tier.ram_budget_bytes
    max_elements = elements_per_partition(tier.partition_bytes) if budget is not None else None
    run_id = config.run_id or "plan"
    segments = layout.segments_of_server(index)
    spans = {s.segment_id: split_segment(s.numel, [(f.segment_start, f.length) for f in s.fragments], max_elements)
             for s in segments}
    # The demands TieredStorage._replan gives the planner: every partition in its file layout.
    numel = {PartitionKey(run_id, sid, span.index): span.numel for sid, parts in spans.items() for span in parts}
    staging = tier.staging_bytes() if budget is not None else 0
    plan: TierPlan = plan_tiers(
        [PartitionDemand(key, FileLayout(n).file_bytes) for key, n in numel.items()],
        ram_budget_bytes=budget, staging_bytes=staging, num_paths=max(1, len(tier.nvme_paths)),
    )
    on_disk = [k for k in numel if plan.of(k) is Residency.NVME]
    if config.checkpoint.dir is None:
        checkpoint_bytes = checkpoint_written = snapshot = 0
    elif budget is None:  # one shard file per segment, written from a snapshot in RAM
        checkpoint_bytes = checkpoint_written = sum(shard_file_bytes(s.numel) for s in segments)
        snapshot = sum(s.numel for s in segments) * STATE_BYTES_PER_ELEMENT
    else:  # one partition file each: disk ones hard-linked, RAM ones written in place
        checkpoint_bytes = sum(FileLayout(n).file_bytes for n in numel.values())
        checkpoint_written = checkpoint_bytes - sum(FileLayout(numel[k]).file_bytes for k in on_disk)
        snapshot = 0
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
            push_bytes=elements * wire, fetch_bytes=elements * compute,
            nvme_write_bytes=plan.nvme_bytes, nvme_read_bytes=plan.nvme_bytes,
        ),
        checkpoint_bytes=checkpoint_bytes,
        checkpoint_written_bytes=checkpoint_written,
        checkpoint_snapshot_bytes=snapshot,
    )


def _checks(config: TrainConfig, cluster: ClusterDescription, groups: Sequence[NodeGroup],
            worker: WorkerPlan, servers: Sequence[ServerPlan]) -> tuple[Check, ...]:
    checks = []
    for role, want, have in (
        ("worker slots", config.worker.num_workers, sum(g.count * g.workers for g in groups)),
        ("state-server slots", config.state_server.num_servers, sum(g.count * g.servers for g in groups)),
    ):
        checks.append(Check(resource=role, need=want, available=have, fits=have >= want, unit="count", reason=(
            f"the cluster has room for {have}" if have >= want else
            f"the config asks for {want} but the node groups hold {have}; add nodes or lower the count")))

    if worker.device == "cuda":
        checks.append(_check("device memory per worker", worker.device_peak_bytes, cluster.device_memory_bytes,
                             "--device-memory", "lower model size or batch_size, use compute_dtype=bfloat16, "
                             "or turn off worker.delayed_update"))
    server_peak = max(s.ram_peak_bytes for s in servers)
    for number, group in enumerate(groups, 1):
        name = f"node group {number} ({group.count} x {group.workers} workers + {group.servers} servers)"
        need = group.workers * worker.host_peak_bytes + group.servers * server_peak
        checks.append(_check(f"host RAM per node, {name}", need, group.host_memory_bytes, "--host-memory",
                             "set or lower state_server.tier.ram_budget_bytes, or spread the actors over more nodes"))
        if group.shm_bytes is not None and group.workers and group.servers and worker.shared_memory_bytes:
            checks.append(_check(f"/dev/shm per node, {name}", group.workers * worker.shared_memory_bytes,
                                 group.shm_bytes, "--shm-memory", "enlarge /dev/shm or set worker.shared_memory=off"))
    if config.state_server.tier.ram_budget_bytes is not None:
        for server in servers:
            checks.append(_check(f"NVMe of state server {server.index}", server.nvme_need_bytes, cluster.nvme_bytes,
                                 "--nvme", "free space, add state_server.tier.nvme_paths, or raise the RAM budget"))
    return tuple(checks)


def _check(resource: str, need: int, available: int | None, flag: str, remedy: str) -> Check:
    if available is None:
        return Check(resource=resource, need=need, available=None, fits=None,
                     reason=f"not checked; give {flag} (or the cluster file) to check it")
    if need <= available:
        return Check(resource=resource, need=need, available=available, fits=True,
                     reason=f"{format_bytes(available - need)} to spare")
    return Check(resource=resource, need=need, available=available, fits=False,
                 reason=f"{format_bytes(need - available)} short; {remedy}")


# --- output -------------------------------------------------------------------------------
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
        f"Each worker ({w.shard_elements:,}-element shard)",
    ]
    on = "GPU" if w.device == "cuda" else "host RAM"
    rows = [
        ("weights", w.buffers["weights"], on),
        ("gradients", w.buffers["gradients"], on),
        ("gradient + weight shard", w.device_bytes - w.buffers["weights"] - w.buffers["gradients"],
         "host RAM, /dev/shm" if w.shared_memory_bytes else on),
        ("per-step temporaries (bound)", w.transient_bytes, on),
        ("activations (estimate)", w.activation_bytes, on),
        ("= compute device total", w.device_peak_bytes, on),
        ("pinned gradient shard", w.pinned_bytes, "pinned host RAM"),
        ("corpus", w.corpus_bytes, "host RAM"),
        ("while starting", w.startup_host_bytes, "host RAM"),
        ("= host peak", w.host_peak_bytes, "host RAM"),
    ]
    lines += [f"  {name:<30} {b(n):>10}  {where}" for name, n, where in rows]

    names = [f"server {s.index}" for s in plan.servers]
    lines += ["", "Each state server" + " " * 15 + "".join(f"{n:>12}" for n in names)]
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
    lines += [f"  {name:<30}" + "".join(f"{b(get(s)):>12}" for s in plan.servers) for name, get in server_rows]
    lines.append(f"  {'partitions (on NVMe)':<30}"
                 + "".join(f"{f'{s.partitions} ({s.partitions_on_nvme})':>12}" for s in plan.servers))

    t = w.traffic
    lines += ["", "Per step",
              f"  each worker: reduce-scatter {b(t.reduce_scatter_bytes)}, all-gather {b(t.all_gather_bytes)} "
              f"(ring), push {b(t.push_bytes)}, fetch {b(t.fetch_bytes)}"]
    lines += [f"  server {s.index}: receives {b(s.traffic.push_bytes)}, sends {b(s.traffic.fetch_bytes)}"
              + (f", NVMe writes {b(s.traffic.nvme_write_bytes)} and reads <= {b(s.traffic.nvme_read_bytes)}"
                 if s.traffic.nvme_write_bytes else "") for s in plan.servers]

    if any(s.checkpoint_bytes for s in plan.servers):
        total = sum(s.checkpoint_bytes for s in plan.servers)
        written = sum(s.checkpoint_written_bytes for s in plan.servers)
        kept = plan.checkpoint_keep_last
        lines += ["", "Per checkpoint",
                  f"  files {b(total)}: written {b(written)}, hard-linked from the NVMe tier {b(total - written)}",
                  f"  checkpoint.dir holds up to {kept + 1} while one is saved: {b((kept + 1) * total)}"
                  + ("; on the tier's filesystem the linked files stop being shared once the tier "
                     "writes newer versions" if written < total else "")]

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
    parser.add_argument("--device-memory", metavar="SIZE", help="memory of each worker's accelerator, e.g. 80GiB; "
                        "absent, workers with worker.device=auto are planned on CPUs")
    parser.add_argument("--host-memory", metavar="SIZE", help="RAM of each node, e.g. 256GiB")
    parser.add_argument("--nvme", metavar="SIZE", help="free NVMe of each state server, e.g. 2TiB")
    parser.add_argument("--shm-memory", metavar="SIZE", help="size of each node's /dev/shm, e.g. 32GiB")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def plan_command(config: TrainConfig, args: argparse.Namespace) -> int:
    """Print the plan; EXIT_FITS or EXIT_DOES_NOT_FIT. Raises ConfigError for a bad cluster."""
    cluster = load_cluster(args.cluster, config=config, device_memory=args.device_memory,
                           host_memory=args.host_memory, nvme=args.nvme, shm_memory=args.shm_memory)
    plan = plan_run(config, cluster)
    print(json.dumps(plan.to_dict(), indent=2) if args.json else render(plan), file=sys.stdout, flush=True)
    return EXIT_FITS if plan.fits else EXIT_DOES_NOT_FIT
