"""The verdict per resource: what the plan needs of it against what the cluster has
(worker and state-server slots, device memory per worker, the run's host budget and the
nodes' RAM it is of, host RAM per node, NVMe per state server and for weight files), with
the shortfall and a remedy when it does not fit."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from cargohold.cluster.plan.budget import HostBudget
from cargohold.cluster.plan.description import ClusterDescription, NodeGroup
from cargohold.cluster.plan.runtime import DRIVER_RUNTIME_BYTES
from cargohold.cluster.plan.server import ServerPlan
from cargohold.cluster.plan.worker import WorkerPlan
from cargohold.cluster.schema.train import TrainConfig
from cargohold.cluster.sizes import format_bytes


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


def check_cluster(
    config: TrainConfig,
    cluster: ClusterDescription,
    groups: Sequence[NodeGroup],
    worker: WorkerPlan,
    servers: Sequence[ServerPlan],
    host_budget: HostBudget | None = None,
) -> tuple[Check, ...]:
    """One check per resource: the slots of ``groups`` against the config's counts, the
    worker's device peak, the host budget, each node group's host RAM and NVMe, and each
    server's NVMe (with a RAM budget only); a resource the cluster does not size is
    reported unchecked."""
    checks = list(_slot_checks(config, groups))
    if worker.device == "cuda":
        checks.append(_device_check(config, cluster, worker))
    if host_budget is not None:
        checks.extend(_budget_checks(host_budget, groups))
    checks.extend(_host_checks(groups, worker, servers))
    if worker.nvme_weight_bytes:
        checks.extend(_weight_file_checks(cluster, groups, worker))
    if config.state_server.tier.ram_budget_bytes is not None:
        checks.extend(
            _check(
                f"NVMe of state server {server.index}",
                server.nvme_need_bytes,
                cluster.nvme_bytes,
                "--nvme",
                "free space, add state_server.tier.nvme_paths, or raise the RAM budget",
            )
            for server in servers
        )
    return tuple(checks)


def _slot_checks(config: TrainConfig, groups: Sequence[NodeGroup]) -> Iterator[Check]:
    for role, want, have in (
        ("worker slots", config.worker.num_workers, sum(g.count * g.workers for g in groups)),
        ("state-server slots", config.state_server.num_servers, sum(g.count * g.servers for g in groups)),
    ):
        yield Check(
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


def _device_check(config: TrainConfig, cluster: ClusterDescription, worker: WorkerPlan) -> Check:
    """A GPU worker's peak against the device memory, with the remedies the config has left."""
    settings = config.worker
    remedies = [
        *(["set worker.offload_params=true"] if not settings.offload_params else []),
        *(["worker.activation_checkpointing=blocks"] if settings.activation_checkpointing == "off" else []),
        *(["set worker.max_unit_params (units below a block)"] if settings.max_unit_params == 0 else []),
        *(["worker.compute_dtype=bfloat16"] if settings.compute_dtype == "float32" else []),
        "add workers",
        "lower data.batch_size or data.block_size",
    ]
    return _check(
        "device memory per worker",
        worker.device_peak_bytes,
        cluster.device_memory_bytes,
        "--device-memory",
        ", ".join(remedies[:-1]) + " or " + remedies[-1],
    )


def _budget_checks(host_budget: HostBudget, groups: Sequence[NodeGroup]) -> Iterator[Check]:
    """The split of ``cluster.host_memory_bytes``, and the budget against the nodes' RAM."""
    yield Check(
        resource="host budget (cluster.host_memory_bytes), cargohold's processes (not Ray's own)",
        need=host_budget.need_bytes,
        available=host_budget.budget_bytes,
        fits=host_budget.fits,
        reason=(
            f"{format_bytes(host_budget.budget_bytes - host_budget.need_bytes)} to spare"
            if host_budget.fits
            else "even the least handler threads, exchange slots (and weight window) leave the state "
            "servers too little; raise it, or lower data.batch_size, worker.max_unit_params or the "
            "worker and server counts"
        ),
    )
    sizes = [group.host_memory_bytes for group in groups]
    if all(size is not None for size in sizes):  # the budget cannot be more than the nodes have
        yield _check(
            "host budget (cluster.host_memory_bytes) against the nodes' RAM",
            host_budget.budget_bytes,
            sum(group.count * (group.host_memory_bytes or 0) for group in groups),
            "--host-memory",
            "lower cluster.host_memory_bytes to what the run's processes may use of it",
        )


def _host_checks(groups: Sequence[NodeGroup], worker: WorkerPlan, servers: Sequence[ServerPlan]) -> Iterator[Check]:
    """Each node group's host RAM: its workers' and servers' peaks (and the driver's runtime
    on the first node)."""
    server_peak = max(s.ram_peak_bytes for s in servers)
    for number, group in enumerate(groups, 1):
        name = f"node group {number} ({group.count} x {group.workers} workers + {group.servers} servers)"
        need = group.workers * worker.host_peak_bytes + group.servers * server_peak
        if number == 1:  # the driver runs on the first node
            need += DRIVER_RUNTIME_BYTES
        yield _check(
            f"host RAM per node, {name}",
            need,
            group.host_memory_bytes,
            "--host-memory",
            "set or lower state_server.tier.ram_budget_bytes, or spread the actors over more nodes",
        )


def _weight_file_checks(
    cluster: ClusterDescription, groups: Sequence[NodeGroup], worker: WorkerPlan
) -> Iterator[Check]:
    """The weight files of each node group's workers against the node's NVMe."""
    for number, group in enumerate(groups, 1):
        if group.workers:
            workers = f"{group.workers} worker{'s' * (group.workers != 1)}"
            yield _check(
                f"NVMe for weight files per node, node group {number} ({workers})",
                group.workers * worker.nvme_weight_bytes,
                cluster.nvme_bytes,
                "--nvme",
                "free space, or put worker.weights_nvme_path on a drive of its own",
            )


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
