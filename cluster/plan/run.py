"""The whole plan of a run: the model laid out as every worker lays it out, the worker
and each state server planned, where the workers compute and how pushes and fetches
travel, and the checks against the cluster."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from cargohold.cluster.plan.activations import activation_bytes_estimate
from cargohold.cluster.plan.budget import HostBudget, PlanParts, apply_host_budget, split_host_budget
from cargohold.cluster.plan.checks import Check, check_cluster
from cargohold.cluster.plan.description import ClusterDescription, NodeGroup
from cargohold.cluster.plan.runtime import DRIVER_RUNTIME_BYTES
from cargohold.cluster.plan.server import ServerPlan, plan_server
from cargohold.cluster.plan.worker import WorkerPlan, plan_worker
from cargohold.cluster.schema.train import TrainConfig
from cargohold.services.core.errors import ConfigError, LayoutError
from cargohold.services.core.layout import Layout

if TYPE_CHECKING:
    from cargohold.services.worker.sharding import Unit
    from cargohold.services.worker.task import TrainingTask


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
    driver_bytes: int = DRIVER_RUNTIME_BYTES
    """The driver's host memory (its runtime; it holds no model)."""
    host_budget: HostBudget | None = None
    """The split of ``cluster.host_memory_bytes`` when set (the plan is then of the config
    that keeps it)."""
    notes: tuple[str, ...] = field(default_factory=tuple)
    device_fraction: float = 0.0
    """``worker.optimizer_on_device_fraction``, as planned."""
    device_fraction_fit: float | None = None
    """The largest fraction that fits the GPU's memory left over (``--device-memory``);
    None for CPU workers or an unsized GPU."""
    kept_gathered_units: int = 0
    """``tuning.worker.kept_gathered_units``, as planned."""
    kept_gathered_fit: int | None = None
    """The most units ``tuning.worker.kept_gathered_units`` may keep gathered within the GPU's
    memory (``--device-memory``); None for CPU workers, an unsized GPU, or without
    ``worker.reshard_after_forward``."""

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
        if self.host_budget is not None:
            data["host_budget"]["need_bytes"] = self.host_budget.need_bytes
        return data


def plan_run(config: TrainConfig, cluster: ClusterDescription | None = None) -> RunPlan:
    """What ``config`` needs of every tier and moves per step, checked against ``cluster``;
    with ``cluster.host_memory_bytes``, of the config that keeps its split."""
    cluster = cluster or ClusterDescription()
    layout, parts = plan_parts(config, cluster)
    host_budget = None
    if config.cluster.host_memory_bytes is not None:
        host_budget, config = split_host_budget(config, parts)
    worker, servers = parts(config)
    groups = cluster.groups(config)
    checks = check_cluster(config, cluster, groups, worker, servers, host_budget)
    notes = [
        "activations are an estimate (fused attention, no s x s score matrix); units in flight, "
        "per-step temporaries and NVMe reads are upper bounds",
        "each process's runtime (Python, torch, Ray) as measured on CPU, a GPU worker's CUDA libraries "
        "estimated; not counted: the CUDA context's device memory, caching allocator and NCCL buffers, "
        "Ray's object store",
    ]
    if cluster.device_memory_bytes is not None and worker.device == "cpu":
        notes.append(
            "the device memory given is not checked: worker.gpus is 0, so the workers compute on CPUs; "
            "set worker.gpus (1 on GPU nodes) to plan them on GPUs"
        )
    if config.worker.offload_params and worker.device == "cpu":
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
        transport=_transport(config, groups),
        worker=worker,
        servers=servers,
        checks=checks,
        notes=tuple(notes),
        checkpoint_keep_last=config.checkpoint.keep_last if config.checkpoint.dir is not None else 0,
        host_budget=host_budget,
        device_fraction=config.worker.optimizer_on_device_fraction,
        device_fraction_fit=(
            worker.device_fraction_fit(cluster.device_memory_bytes)
            if worker.device == "cuda" and cluster.device_memory_bytes is not None
            else None
        ),
        kept_gathered_units=config.worker.kept_gathered_units,
        kept_gathered_fit=(
            kept_gathered_fit(config, parts, worker.units, cluster.device_memory_bytes)
            if worker.device == "cuda" and cluster.device_memory_bytes is not None and worker.reshard_after_forward
            else None
        ),
    )


def kept_gathered_fit(config: TrainConfig, parts: PlanParts, units: int, device_memory_bytes: int) -> int:
    """The largest ``tuning.worker.kept_gathered_units`` (up to ``units``) whose worker plan's
    device total fits ``device_memory_bytes``; 0 where even none fits. Each unit kept
    adds to the units gathered at once, so the totals only grow with it."""

    def fits(kept: int) -> bool:
        variant = dataclasses.replace(config, worker=dataclasses.replace(config.worker, kept_gathered_units=kept))
        return parts(variant)[0].device_peak_bytes <= device_memory_bytes

    low, high = 0, units
    if not fits(low):
        return 0
    while low < high:  # fits(low) holds; the answer lies in [low, high]
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low


def plan_parts(
    config: TrainConfig, cluster: ClusterDescription, task: TrainingTask | None = None
) -> tuple[Layout, PlanParts]:
    """The layout of ``config``'s model (or ``task``'s), and the worker's and state servers'
    plans of any config that differs from it only in sizes the model does not depend on
    (the weight window, the slots, the RAM tier's budget): the model is built once."""
    model, _, layout = _layout(config, task)
    device = _worker_device(config)
    transport = _transport(config, cluster.groups(config))
    activations = activation_bytes_estimate(config, model)

    # The servers' plans depend on the variant's server section only (the worker settings
    # a variant changes are the window, the slots and the gathered units): planned once each.
    servers_of: dict[str, tuple[ServerPlan, ...]] = {}

    def parts(variant: TrainConfig) -> tuple[WorkerPlan, tuple[ServerPlan, ...]]:
        worker = plan_worker(variant, layout, model, device, transport, activations)
        key = repr(variant.state_server)
        if key not in servers_of:
            servers_of[key] = tuple(plan_server(variant, layout, s, transport) for s in range(layout.num_servers))
        return worker, servers_of[key]

    return layout, parts


def _layout(config: TrainConfig, task: TrainingTask | None = None) -> tuple[torch.nn.Module, list[Unit], Layout]:
    """The meta-device model, its FSDP2 units and the layout every worker computes
    (shapes only; nothing allocated, nothing read)."""
    from cargohold.cluster.sections import config_layout
    from cargohold.services.worker.param_groups import resolve_param_groups

    try:
        model, units, layout = config_layout(config, task)
    except LayoutError as error:
        raise ConfigError(f"the model cannot be laid out: {error}") from error
    resolve_param_groups(config.optim, layout.params)  # a pattern matching nothing is refused here too
    return model, units, layout


def _worker_device(config: TrainConfig) -> str:
    """Where the workers compute: on CUDA when they reserve GPUs (``worker.gpus``)."""
    return "cuda" if config.worker.on_gpus else "cpu"


def budgeted_config(config: TrainConfig, task: TrainingTask | None = None) -> TrainConfig:
    """What a run starts with: ``config`` with the split of ``cluster.host_memory_bytes``
    applied (unchanged without one; ConfigError when the run cannot fit it). Workers are
    planned on GPUs when they reserve them (worker.gpus), on one node with the state
    servers."""
    if config.cluster.host_memory_bytes is None:
        return config
    return apply_host_budget(config, plan_parts(config, ClusterDescription(), task)[1])


def _transport(config: TrainConfig, groups: Sequence[NodeGroup]) -> str:
    """Shared memory where a worker and a state server share a node (tuning.worker.shared_memory);
    a GPU worker's is page-locked too."""
    if config.worker.shared_memory == "off":
        return "grpc"
    if len(groups) == 1 and groups[0].count == 1:
        return "shared_memory"
    return "mixed" if any(g.workers and g.servers for g in groups) else "grpc"
