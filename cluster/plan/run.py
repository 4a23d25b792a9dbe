"""The whole plan of a run: the model laid out as every worker lays it out, the worker
and each state server planned, where the workers compute and how pushes and fetches
travel, and the checks against the cluster."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from cargohold.cluster.config import TrainConfig
from cargohold.cluster.plan.activations import activation_bytes_estimate
from cargohold.cluster.plan.checks import Check, check_cluster
from cargohold.cluster.plan.description import ClusterDescription, NodeGroup
from cargohold.cluster.plan.server import ServerPlan, plan_server
from cargohold.cluster.plan.worker import WorkerPlan, plan_worker
from cargohold.services.errors import ConfigError, LayoutError
from cargohold.services.layout import Layout

if TYPE_CHECKING:
    from cargohold.services.sharding import Unit


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
    transport = _transport(config, groups)
    worker = plan_worker(config, layout, model, device, transport, activation_bytes_estimate(config, model))
    servers = tuple(plan_server(config, layout, s, transport) for s in range(layout.num_servers))
    checks = check_cluster(config, cluster, groups, worker, servers)
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
    from cargohold.services.param_groups import resolve_param_groups

    try:
        model, units, layout = model_layout(config)
    except LayoutError as error:
        raise ConfigError(f"the model cannot be laid out: {error}") from error
    resolve_param_groups(config.optim, layout.params)  # a pattern matching nothing is refused here too
    return model, units, layout


def _worker_device(config: TrainConfig, cluster: ClusterDescription) -> str:
    requested = config.worker.device
    if requested == "auto":  # a plan cannot look for GPUs: the cluster description says
        return "cuda" if cluster.device_memory_bytes is not None else "cpu"
    return requested


def _transport(config: TrainConfig, groups: Sequence[NodeGroup]) -> str:
    """Shared memory where a worker and a state server share a node (worker.shared_memory);
    a GPU worker's is page-locked too."""
    if config.worker.shared_memory == "off":
        return "grpc"
    if len(groups) == 1 and groups[0].count == 1:
        return "shared_memory"
    return "mixed" if any(g.workers and g.servers for g in groups) else "grpc"
