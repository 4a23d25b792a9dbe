"""One host-memory budget for a run (``cluster.host_memory_bytes``): what every process of
the run may hold in host RAM together, each process's runtime included. The planner
splits it: the driver and each worker take what they need (their runtime, buffers,
weight window and exchange slots: fixed by the model and the config), each state server
its runtime and a step's transfers, and what is left is divided among the state servers
as their RAM tier (``state_server.tier.ram_budget_bytes``), the rest of the optimizer
state going to the NVMe tier. Where the fixed part does not fit, the servers' handler
threads, the exchange slots and the weight window are lowered first (to 2, 1 and 2:
overlap and reads ahead are traded for memory); where it still does not fit, the run is
refused before it starts. With an NVMe tier the partition size follows the RAM tier
each server gets (:func:`.partitions.derived_partition_bytes`).

A run applies the split to its config (:func:`apply_host_budget`) before anything starts,
so the processes keep the sizes the plan printed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from cargohold.cluster.plan.runtime import DRIVER_RUNTIME_BYTES
from cargohold.cluster.plan.server import ServerPlan
from cargohold.cluster.plan.worker import WorkerPlan
from cargohold.cluster.schema.train import TrainConfig
from cargohold.cluster.sizes import format_bytes
from cargohold.services.core.errors import ConfigError
from cargohold.services.tiers.partitions import derived_partition_bytes, staging_bytes

MiB = 1 << 20

PlanParts = Callable[[TrainConfig], tuple[WorkerPlan, tuple[ServerPlan, ...]]]
"""The worker's and the state servers' plans of a config (:func:`.run.plan_parts`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class HostBudget:
    """``cluster.host_memory_bytes`` split over the run's processes."""

    budget_bytes: int
    driver_bytes: int
    num_workers: int
    worker_bytes: int
    """Each worker's host peak (runtime included)."""
    num_servers: int
    server_bytes: int
    """Each state server's host peak besides its RAM tier (runtime, a step's transfers or
    start-up's registration)."""
    tier_bytes: int
    """Each state server's RAM tier: ``state_server.tier.ram_budget_bytes``, or with no
    NVMe tier the whole state it holds."""
    weight_window: int
    exchange_slots: int
    rpc_threads: int
    """Each state server's handler threads (``tuning.state_server.rpc_threads``)."""
    partition_bytes: int | None
    """Each state server's partition size (None without an NVMe tier: segments stay whole)."""
    fits: bool

    @property
    def need_bytes(self) -> int:
        return (
            self.driver_bytes
            + self.num_workers * self.worker_bytes
            + self.num_servers * (self.server_bytes + self.tier_bytes)
        )


def split_host_budget(config: TrainConfig, plan_parts: PlanParts) -> tuple[HostBudget, TrainConfig]:
    """The split of ``config.cluster.host_memory_bytes`` and the config that keeps it (the
    window, the slots, the servers' handler threads, the RAM tier's budget and partition
    size set); ``fits`` False when even the least settings leave the servers' RAM tier too
    little (the config returned is then the least one, for the plan to show)."""
    budget = config.cluster.host_memory_bytes
    if budget is None:
        raise ConfigError("cluster.host_memory_bytes is not set")
    tier = config.state_server.tier
    # A server's share of the budget bounds its RAM tier, and so its partitions; the split
    # is taken again with smaller ones where the tier it leaves is smaller.
    share = budget // config.state_server.num_servers
    largest = tier.partition_bytes or derived_partition_bytes(share, tier.buffer_count)

    def trial(settings: tuple[int, int, int]) -> tuple[HostBudget, TrainConfig]:
        split, least = _split(config, plan_parts, settings, largest)
        if tier.nvme_paths and tier.partition_bytes is None:
            smaller = derived_partition_bytes(split.tier_bytes, tier.buffer_count)
            if smaller < largest:
                split, least = _split(config, plan_parts, settings, smaller)
        return split, least

    ordered = list(_settings(config))
    split, least = trial(ordered[0])
    if not split.fits and len(ordered) > 1:
        split, least = trial(ordered[-1])  # where the least settings do not fit, none do
        if split.fits:
            split, least = next((t for t in map(trial, ordered[1:-1]) if t[0].fits), (split, least))
    if split.fits:
        derived = split.tier_bytes if tier.nvme_paths else None
        if tier.ram_budget_bytes is not None and tier.ram_budget_bytes != derived:
            raise ConfigError(
                f"state_server.tier.ram_budget_bytes is derived from cluster.host_memory_bytes "
                f"({derived} here), but the config sets it to {tier.ram_budget_bytes}; unset one of them"
            )
        return split, _with(least, ram_budget=derived)
    return split, least


def _split(
    config: TrainConfig, plan_parts: PlanParts, settings: tuple[int, int, int], partition: int
) -> tuple[HostBudget, TrainConfig]:
    """The split at ``settings`` (:func:`_settings`) and ``partition`` bytes per partition,
    and the config that has them, its RAM tier at the least (staging only) where there is
    an NVMe tier."""
    window, slots, threads = settings
    budget = config.cluster.host_memory_bytes
    assert budget is not None
    tier = config.state_server.tier
    on_nvme = bool(tier.nvme_paths)
    least = staging_bytes(partition, tier.buffer_count) if on_nvme else 0
    cut = partition if on_nvme else None  # without an NVMe tier segments stay whole
    trial = _with(config, window=window, slots=slots, threads=threads, partition=cut, ram_budget=least or None)
    worker, servers = plan_parts(trial)
    server_fixed = max(s.runtime_bytes + max(s.step_bytes, s.registration_bytes) for s in servers)
    fixed = DRIVER_RUNTIME_BYTES + config.worker.num_workers * worker.host_peak_bytes
    fixed += len(servers) * server_fixed
    if on_nvme:
        tier_bytes = max((budget - fixed) // len(servers) // MiB * MiB, least)
    else:  # every state in RAM: the tier's size is the state's
        tier_bytes = max(s.ram_bytes for s in servers)
    split = HostBudget(
        budget_bytes=budget,
        driver_bytes=DRIVER_RUNTIME_BYTES,
        num_workers=config.worker.num_workers,
        worker_bytes=worker.host_peak_bytes,
        num_servers=len(servers),
        server_bytes=server_fixed,
        tier_bytes=tier_bytes,
        weight_window=window,
        exchange_slots=slots,
        rpc_threads=threads,
        partition_bytes=partition if on_nvme else None,
        fits=fixed + len(servers) * tier_bytes <= budget,
    )
    return split, trial


def apply_host_budget(config: TrainConfig, plan_parts: PlanParts) -> TrainConfig:
    """``config`` with the split of ``cluster.host_memory_bytes`` applied (unchanged when
    it is not set); raises ConfigError, naming the key and what the run needs, when the
    run cannot fit it."""
    if config.cluster.host_memory_bytes is None:
        return config
    split, effective = split_host_budget(config, plan_parts)
    if not split.fits:
        raise ConfigError(
            f"cluster.host_memory_bytes={split.budget_bytes} ({format_bytes(split.budget_bytes)}) cannot hold "
            f"this run: {describe(split)}; raise it, add nvme_paths, or lower data.batch_size, "
            "worker.max_unit_params or the worker and server counts"
        )
    return effective


def check_budget_memory(config: TrainConfig, memory_bytes: int, where: str) -> None:
    """Refuse a host budget larger than ``memory_bytes``, the memory of ``where`` (the
    machine or the cluster the run's processes run on): a split of memory the processes
    do not have would give the state servers a RAM tier they cannot hold."""
    budget = config.cluster.host_memory_bytes
    if budget is not None and budget > memory_bytes:
        raise ConfigError(
            f"cluster.host_memory_bytes={budget} ({format_bytes(budget)}) is more than {where} has: {memory_bytes} "
            f"({format_bytes(memory_bytes)}); set it to what the run's processes may use of that memory"
        )


def describe(split: HostBudget) -> str:
    """The split in one line."""
    tier = "RAM tier" if split.tier_bytes else "no RAM tier"
    partitions = f" in partitions of {format_bytes(split.partition_bytes)}" if split.partition_bytes else ""
    return (
        f"driver {format_bytes(split.driver_bytes)} + {split.num_workers} worker(s) x "
        f"{format_bytes(split.worker_bytes)} (weight window {split.weight_window}, "
        f"{split.exchange_slots} exchange slot(s)) + {split.num_servers} state server(s) x "
        f"({format_bytes(split.server_bytes)} with {split.rpc_threads} handler threads + {tier} "
        f"{format_bytes(split.tier_bytes)}{partitions}) = "
        f"{format_bytes(split.need_bytes)}"
    )


def _settings(config: TrainConfig) -> Iterator[tuple[int, int, int]]:
    """(weight window, exchange slots, server handler threads) from the configured ones
    down to (2, 1, 2): the threads first (halved: each may hold two segments' weights for
    a fetch), then the slots, then the window (only with weights on NVMe)."""
    worker = config.worker
    windows = range(worker.weight_window, 1, -1) if worker.weights_nvme_path is not None else [worker.weight_window]
    threads = [config.state_server.rpc_threads]
    while threads[-1] > 2:
        threads.append(max(2, threads[-1] // 2))
    for window in windows:
        for slots in range(worker.exchange_slots, 0, -1):
            for count in threads:
                yield window, slots, count


def _with(
    config: TrainConfig,
    *,
    window: int | None = None,
    slots: int | None = None,
    threads: int | None = None,
    partition: int | None = None,
    ram_budget: int | None,
) -> TrainConfig:
    """``config`` with the settings given (those left out kept, but the RAM tier's budget)."""
    worker = dataclasses.replace(
        config.worker,
        weight_window=window or config.worker.weight_window,
        exchange_slots=slots or config.worker.exchange_slots,
    )
    tier = dataclasses.replace(
        config.state_server.tier,
        ram_budget_bytes=ram_budget,
        partition_bytes=partition or config.state_server.tier.partition_bytes,
    )
    server = dataclasses.replace(config.state_server, rpc_threads=threads or config.state_server.rpc_threads, tier=tier)
    return dataclasses.replace(config, worker=worker, state_server=server)
