"""Teardown's last step: remove what a killed actor could not, each folder on its own node."""

from __future__ import annotations

import logging

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cargohold.cluster.schema.train import TrainConfig
from cargohold.services.tiers.folders import remove_tier_folders

logger = logging.getLogger(__name__)


def sweep_tier_folders(
    config: TrainConfig, run_id: str, placement: PlacementGroup, servers: int, *, servers_too: bool = True
) -> None:
    """A state server's NVMe tier folder of ``run_id``, a worker's weight files: each
    removed on its own node (the actor's bundle of ``placement``: the ``servers`` state
    servers' first, then the workers') after the actors stop; ``servers_too`` False: the
    workers' only (they were replaced, the servers go on)."""
    server_roots = list(config.state_server.tier.nvme_paths) if servers_too else []
    weight_roots = [config.worker.weights_nvme_path] if config.worker.weights_nvme_path else []
    folders = [(index, server_roots, f"server-{index}") for index in range(servers)] + [
        (servers + rank, weight_roots, f"worker-{rank}") for rank in range(config.worker.num_workers)
    ]
    sweep = ray.remote(num_cpus=0)(remove_tier_folders)
    on_node = [(PlacementGroupSchedulingStrategy(placement, index), roots, name) for index, roots, name in folders]
    refs = [
        sweep.options(scheduling_strategy=strategy).remote(roots, run_id, folder)
        for strategy, roots, folder in on_node
        if roots
    ]
    try:
        ray.get(refs, timeout=60)
    except Exception as error:  # teardown must go on
        logger.warning("could not remove the tier folders of run %s: %s", run_id, error)
