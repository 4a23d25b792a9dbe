"""Start a run on Ray: connect (or start an in-process cluster), reserve a placement
group that keeps state servers next to the workers, start the actors, drive the steps,
and tear everything down, on success or failure.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import ray
import torch
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cargohold.cluster.config import TrainConfig
from cargohold.cluster.prometheus_sd import Target, write_file_sd
from cargohold.services.errors import TrainingError
from cargohold.services.state_server import StateServer
from cargohold.services.worker import StepReport, TrainingWorker

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class TrainResult:
    run_id: str
    losses: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    server_addresses: list[str] = field(default_factory=list)
    metrics_addresses: list[str] = field(default_factory=list)
    worker_resident_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes rank 0 holds for training, by kind (weights, gradients, grad_shard)."""


class TrainingSession:
    """The actors of one run. ``start()``, then ``step()`` repeatedly, then ``close()``.

    Usable as a context manager; tests use it to inspect weights and server state
    between steps.
    """

    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        self.run_id = config.run_id or f"run-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        self.step_count = 0
        self.servers: list = []
        self.workers: list = []
        self.server_addresses: list[str] = []
        self._placement: PlacementGroup | None = None
        self._owns_ray = False
        self._auth_token = resolve_auth_token(config.security.auth_token_env)

    def __enter__(self) -> TrainingSession:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        cfg = self.config
        self._owns_ray = connect_ray(cfg)
        timeout = cfg.cluster.startup_timeout_s
        worker_bundle = {"CPU": cfg.worker.cpus, "GPU": cfg.worker.gpus, **cfg.worker.resources}
        server_bundle = {"CPU": cfg.state_server.cpus, **cfg.state_server.resources}
        bundles = [server_bundle] * cfg.state_server.num_servers + [worker_bundle] * cfg.worker.num_workers
        self._placement = placement_group(
            [{k: v for k, v in b.items() if v} for b in bundles], strategy=cfg.cluster.placement_strategy
        )
        if not self._placement.wait(timeout_seconds=timeout):
            raise TrainingError(
                f"Ray could not place {len(bundles)} bundles ({cfg.state_server.num_servers} state servers "
                f"x {server_bundle}, {cfg.worker.num_workers} workers x {worker_bundle}) within {timeout}s "
                f"with strategy {cfg.cluster.placement_strategy}; lower worker.cpus/state_server.cpus or "
                "add nodes"
            )

        def on_bundle(index: int) -> PlacementGroupSchedulingStrategy:
            return PlacementGroupSchedulingStrategy(placement_group=self._placement, placement_group_bundle_index=index)

        server_cls = ray.remote(StateServer)
        self.servers = [
            server_cls.options(
                num_cpus=cfg.state_server.cpus, resources=dict(cfg.state_server.resources),
                scheduling_strategy=on_bundle(i), name=f"{self.run_id}-state-server-{i}",
            ).remote(cfg.state_server, server_index=i, metrics_enabled=cfg.metrics.enabled,
                     metrics_port=cfg.metrics.port_for("state_server", i, cfg),
                     auth_token=self._auth_token, tls=cfg.security.tls())
            for i in range(cfg.state_server.num_servers)
        ]
        self.server_addresses = _get([s.address.remote() for s in self.servers], timeout, "starting state servers")
        server_nodes = _get([s.node_id.remote() for s in self.servers], timeout, "starting state servers")

        worker_cls = ray.remote(TrainingWorker)
        first_worker_bundle = cfg.state_server.num_servers
        self.workers = [
            worker_cls.options(
                num_cpus=cfg.worker.cpus, num_gpus=cfg.worker.gpus, resources=dict(cfg.worker.resources),
                scheduling_strategy=on_bundle(first_worker_bundle + rank), name=f"{self.run_id}-worker-{rank}",
            ).remote(cfg, rank=rank, run_id=self.run_id, server_addresses=self.server_addresses,
                     server_node_ids=server_nodes, auth_token=self._auth_token)
            for rank in range(cfg.worker.num_workers)
        ]
        host, port = _get(self.workers[0].rendezvous_address.remote(), timeout, "starting workers")
        _get([w.init_process_group.remote(host, port) for w in self.workers], timeout,
             "forming the worker process group")
        steps = set(_get([w.register_shards.remote() for w in self.workers], timeout, "registering shards"))
        if len(steps) != 1:
            raise TrainingError(f"workers' shards are at different steps {sorted(steps)}")
        self.step_count = steps.pop()
        logger.info("run %s: %d workers, %d state servers at %s", self.run_id, len(self.workers),
                    len(self.servers), ", ".join(self.server_addresses))
        targets = self.metrics_targets()
        logger.info("metrics endpoints: %s", ", ".join(f"{t.role}-{t.index} {t.address}" for t in targets))
        if cfg.metrics.file_sd_path:
            write_file_sd(cfg.metrics.file_sd_path, self.run_id, targets)

    def step(self) -> StepReport:
        """Run the next step on every worker; returns rank 0's report."""
        step = self.step_count + 1
        reports: list[StepReport] = _get([w.train_step.remote(step) for w in self.workers], None, f"step {step}")
        self.step_count = step
        return reports[0]

    def worker_weights(self, rank: int = 0) -> torch.Tensor:
        return ray.get(self.workers[rank].flat_weights_cpu.remote())

    def server_snapshots(self) -> list[dict[int, dict[str, torch.Tensor]]]:
        return ray.get([s.snapshot.remote(self.run_id) for s in self.servers])

    def metrics_targets(self) -> list[Target]:
        """Every actor's metrics endpoint, state servers first."""
        roles = [("state_server", i) for i in range(len(self.servers))] + [("worker", r) for r in range(len(self.workers))]
        addresses = ray.get([a.metrics_address.remote() for a in self.servers + self.workers])
        return [Target(address=a, role=role, index=i) for a, (role, i) in zip(addresses, roles) if a]

    def metrics_addresses(self) -> list[str]:
        return [t.address for t in self.metrics_targets()]

    def worker_resident_bytes(self) -> dict[str, int]:
        return ray.get(self.workers[0].resident_bytes.remote())

    def close(self) -> None:
        """Stop actors and release the placement group; shut Ray down if we started it."""
        for actor, method in [(w, "shutdown") for w in self.workers] + [(s, "stop") for s in self.servers]:
            try:
                ray.get(getattr(actor, method).remote(), timeout=30)
            except Exception as error:  # teardown must go on; the cause was already raised
                logger.warning("teardown of an actor failed: %s", error)
            ray.kill(actor)
        self.workers, self.servers = [], []
        if self._placement is not None:
            remove_placement_group(self._placement)
            self._placement = None
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = False


def train(config: TrainConfig, on_step: Callable[[StepReport], None] | None = None) -> TrainResult:
    """Run ``config.steps`` steps and return the losses and timings."""
    with TrainingSession(config) as session:
        result = TrainResult(run_id=session.run_id, server_addresses=list(session.server_addresses),
                             metrics_addresses=session.metrics_addresses(),
                             worker_resident_bytes=session.worker_resident_bytes())
        while session.step_count < config.steps:
            report = session.step()
            result.losses.append(report.loss)
            result.step_seconds.append(report.seconds)
            if on_step is not None:
                on_step(report)
        return result


def resolve_auth_token(env_name: str | None) -> str | None:
    """The token state-server calls carry: from the environment, else fresh for this run.
    Never logged; actors receive it as an argument, outside the config."""
    if env_name is None:
        return None
    return os.environ.get(env_name) or secrets.token_urlsafe(32)


def connect_ray(config: TrainConfig) -> bool:
    """Use the running Ray, join ``cluster.address``, or start one in-process.

    Returns True when this call started Ray (and so must shut it down).
    """
    if ray.is_initialized():
        return False
    if config.cluster.address is not None:
        ray.init(address=config.cluster.address, log_to_driver=True)
        return True
    needed = (config.worker.num_workers * config.worker.cpus
              + config.state_server.num_servers * config.state_server.cpus)
    ray.init(
        address="local",  # a new cluster even when another runs on this machine
        num_cpus=config.cluster.num_cpus or max(1, math.ceil(needed)),
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=True,
    )
    return True


def _get(refs, timeout: float | None, what: str):
    """ray.get that fails as soon as any one call fails, instead of waiting in list order
    for calls that may be blocked in a collective with the failed one."""
    pending = list(refs) if isinstance(refs, list) else [refs]
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while pending:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
            if not ready:
                raise TrainingError(f"timed out after {timeout}s {what}")
            ray.get(ready[0])
        return ray.get(refs)
    except ray.exceptions.RayActorError as error:
        raise TrainingError(f"an actor died while {what}: {error}") from error
    except ray.exceptions.RayTaskError as error:
        raise TrainingError(f"{what} failed: {error.cause if error.cause else error}") from error
