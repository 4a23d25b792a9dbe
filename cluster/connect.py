"""What a run needs from its surroundings before any actor starts: the Ray cluster (the
running one, the one ``cluster.address`` names, or one started in this process), checked
for the GPUs and the host memory the run asks of it, and the token its calls carry."""

from __future__ import annotations

import logging
import math
import os
import secrets

import ray
import torch

from cargohold.cluster.plan.budget import check_budget_memory
from cargohold.cluster.schema.train import TrainConfig
from cargohold.services.core.errors import ConfigError

logger = logging.getLogger(__name__)


def resolve_auth_token(env_name: str | None) -> str | None:
    """The token state-server calls carry: from the environment variable ``env_name``
    (the launcher's is always ``CARGOHOLD_AUTH_TOKEN``), else fresh for this run; None:
    none (a process that serves without one). Never logged; actors receive it as an
    argument, outside the config."""
    if env_name is None:
        return None
    return os.environ.get(env_name) or secrets.token_urlsafe(32)


def connect_ray(config: TrainConfig) -> bool:
    """Use the running Ray, join ``cluster.address``, or start one in-process.

    Returns True when this call started Ray (and so must shut it down).
    """
    if ray.is_initialized() or config.cluster.address is not None:
        owns = not ray.is_initialized()
        if owns:
            ray.init(address=config.cluster.address, log_to_driver=True)
        _warn_if_short_of_gpus(config)
        return owns
    # Ray's own GPU detection (NVML) can see none where torch sees them; this process's
    # count is the node's, and a shortfall fails now rather than after the start-up timeout.
    gpus = torch.cuda.device_count()
    _check_gpus(config, gpus, gpus, "this node (torch.cuda.device_count())")
    needed = config.worker.num_workers * config.worker.cpus + config.state_server.num_servers * config.state_server.cpus
    ray.init(
        address="local",  # a new cluster even when another runs on this machine
        num_cpus=config.cluster.num_cpus or max(1, math.ceil(needed)),
        num_gpus=gpus,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=True,
    )
    return True


def _check_gpus(config: TrainConfig, largest: float, total: float, where: str) -> None:
    """ConfigError where no node has ``worker.gpus`` GPUs or all of them together fall
    short of the workers' (``largest``: the most on one node, ``total``: on all)."""
    per_worker, workers = config.worker.gpus, config.worker.num_workers
    if per_worker and (largest < per_worker or total < per_worker * workers):
        raise ConfigError(
            f"worker.gpus={per_worker:g} x worker.num_workers={workers} needs {per_worker * workers:g} GPUs, "
            f"{where} has {total:g} (at most {largest:g} on one node); lower worker.gpus or "
            "worker.num_workers, or set worker.gpus=0 to train on CPUs"
        )


def check_budget_on_cluster(config: TrainConfig) -> None:
    """The host budget against the memory of the Ray cluster's live nodes, as Ray reports
    it (each node's ``memory`` and ``object_store_memory`` resources: what was free when
    it started)."""
    nodes = [node["Resources"] for node in ray.nodes() if node["Alive"]]
    memory = int(sum(node.get("memory", 0.0) + node.get("object_store_memory", 0.0) for node in nodes))
    check_budget_memory(config, memory, f"the Ray cluster ({len(nodes)} live node(s), as Ray reports their memory)")


def _warn_if_short_of_gpus(config: TrainConfig) -> None:
    """On a cluster this process joined, nodes may still be joining: warn, and leave the
    placement group to wait (tuning.cluster.startup_timeout_s)."""
    counts = [node["Resources"].get("GPU", 0.0) for node in ray.nodes() if node["Alive"]]
    try:
        _check_gpus(config, max(counts, default=0.0), sum(counts), "the Ray cluster")
    except ConfigError as short:
        logger.warning(
            "%s; waiting up to %gs (tuning.cluster.startup_timeout_s) for nodes to join",
            short,
            config.cluster.startup_wait_s,
        )
