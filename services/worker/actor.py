"""A training worker: one Ray actor per accelerator, holding 1/W of the model.

The model is built on the meta device, sharded with FSDP2 per transformer block and at
the root, and only this worker's chunk of each parameter is ever materialised (in the
compute dtype; in host memory with ``worker.offload_params``). The optimizer state lives
on the state servers. This class is the thin shell: process group, clients, shared
memory, metrics, lifecycle; the step itself is :class:`~cargohold.services.worker.step.ShardedStep`.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import time

import torch
import torch.distributed as dist

from cargohold.cluster.schema.train import TrainConfig
from cargohold.services.core.errors import ConfigError, TrainingError
from cargohold.services.core.layout import Layout
from cargohold.services.core.loss_scale import LossScaleState
from cargohold.services.core.node import node_ip
from cargohold.services.data.seeds import dropout_seed
from cargohold.services.metrics.worker import WorkerMetrics
from cargohold.services.segments.segment_holder import SegmentHolder
from cargohold.services.segments.segment_registry import SegmentRegistry
from cargohold.services.segments.weight_buffers import WeightBuffers
from cargohold.services.tiers.storage import TieredStorage
from cargohold.services.transport import shm
from cargohold.services.transport.auth import tls_files
from cargohold.services.transport.grpc_client import StateServerClient
from cargohold.services.worker.colocated_collectives import SharedMemoryGroup
from cargohold.services.worker.device_port import LocalPort, SplitPort
from cargohold.services.worker.host_allocator import check_loaded_allocator, worker_allocator
from cargohold.services.worker.model_setup import (
    exchange_buffers,
    resolve_device,
    sharded_model,
    share_collectives,
    step_policy,
    weight_window,
)
from cargohold.services.worker.param_groups import resolve_param_groups
from cargohold.services.worker.preemption import PreemptionNotice
from cargohold.services.worker.sharding import local_tensors
from cargohold.services.worker.state_port import ExchangeBuffers, PortConfig, RemotePort, StatePort
from cargohold.services.worker.step import ShardedStep
from cargohold.services.worker.step_report import EvalReport, StepReport
from cargohold.services.worker.task import TrainingTask

logger = logging.getLogger(__name__)
SHUTDOWN_WAIT_S = 60.0
"""How long shutdown waits for a delayed update still in flight."""


def rendezvous_store(host: str, world_size: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """Rank 0's TCP store, listening on ``host`` at a port the kernel picks (``.port``)."""
    return dist.TCPStore(host, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)


class TrainingWorker(SegmentHolder):
    """One worker; :class:`SegmentHolder`'s calls read, save and restore its device
    segments (``worker.optimizer_on_device_fraction``), which its own registry holds."""

    def __init__(
        self,
        config: TrainConfig,
        *,
        rank: int,
        run_id: str,
        auth_token: str | None = None,
        task: TrainingTask,
    ) -> None:
        """``config``: the run's whole config, as the launcher sends it; the worker is the one
        service that takes it whole, and hands each part the sections it reads. ``task``:
        what to train (the launcher's, e.g. the model and data the config names). The state
        servers' addresses come with :meth:`init_process_group`, so that a worker starts
        while the servers do."""
        torch.set_num_threads(config.worker.torch_threads)
        check_loaded_allocator(worker_allocator(config.worker, config.cluster))
        self.config = config
        self.rank = rank
        self.run_id = run_id
        self.world_size = config.worker.num_workers
        self.device = resolve_device(config.worker)
        # The device segments' state: on the GPU, or in this process's memory on a CPU worker.
        super().__init__(
            SegmentRegistry(TieredStorage(device=self.device), WeightBuffers(device=self.device)), f"worker{rank}"
        )
        self._auth_token = auth_token
        self.task = task
        self.data = self.task.open_data()
        self.eval_set = self.task.open_eval()
        self.metrics = WorkerMetrics(rank)
        if config.metrics.enabled:
            self.metrics.start(host=node_ip(), port=config.metrics.port_for("worker", rank, config))
        self.step: ShardedStep | None = None
        self.preemption = PreemptionNotice(f"worker {rank}")
        self._store: dist.TCPStore | None = None
        self._collectives: SharedMemoryGroup | None = None

    # --- lifecycle -----------------------------------------------------------------
    def rendezvous_address(self, timeout_s: float = 300.0) -> tuple[str, int]:
        """Open torch.distributed's TCP store on a port the kernel picks and return its host
        and port (called on rank 0). The store keeps its socket bound: probing a free port
        and binding it later let another process take it in between (EADDRINUSE)."""
        host = node_ip()
        self._store = rendezvous_store(host, self.world_size, datetime.timedelta(seconds=timeout_s))
        return host, self._store.port

    def init_process_group(
        self,
        host: str,
        port: int,
        server_addresses: list[str],
        server_node_ids: list[str] | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        """Join the workers' process group, then shard the model (FSDP2 needs the group)
        and connect to the state servers at ``server_addresses`` (on the Ray nodes
        ``server_node_ids``: shared memory where one is this worker's)."""
        if len(server_addresses) != self.config.state_server.num_servers:
            raise TrainingError(
                f"{len(server_addresses)} server addresses for state_server.num_servers="
                f"{self.config.state_server.num_servers}"
            )
        timeout = datetime.timedelta(seconds=timeout_s)
        if self._store is None:
            self._store = dist.TCPStore(host, port, self.world_size, is_master=False, timeout=timeout)
        dist.init_process_group(
            process_group_backend(self.device),
            store=self._store,
            rank=self.rank,
            world_size=self.world_size,
            timeout=timeout,
        )
        config = self.config
        model, units, layout = sharded_model(self.task, config.worker, config.state_server.num_servers, self.device)
        self._collectives = share_collectives(units, layout, config.worker, self.device.type, self.run_id)
        shared = self._colocated_servers(server_node_ids)
        buffers = exchange_buffers(
            config.worker,
            config.push_dtype,
            layout,
            shared_name=shm.region_name(self.run_id, f"rank{self.rank}") if shared else None,
            pin=self.device.type == "cuda",
        )
        report_pageable(buffers, self.rank, self.metrics)
        clients = [
            StateServerClient(
                address,
                chunk_bytes=config.state_server.chunk_bytes,
                timeout_s=config.state_server.rpc_timeout_s,
                auth_token=self._auth_token,
                tls=tls_files(config.security),
                bulk=config.state_server.data_plane == "socket",
            )
            for address in server_addresses
        ]
        for client in clients:  # once each, before any segment is registered or joined
            client.wait_ready()
        param_groups = resolve_param_groups(config.optim, layout.params)
        port_config = PortConfig(
            optim=config.optim, push_dtype=config.push_dtype, compute_dtype=config.worker.compute_dtype
        )
        state_port: StatePort = RemotePort(
            port_config, self.run_id, clients, buffers, shared, self.metrics, param_groups
        )
        if layout.device_segments(self.rank):
            state_port = SplitPort(state_port, LocalPort(port_config, self.run_id, param_groups, self.registry))
        self.step = ShardedStep(
            model,
            units,
            layout,
            self.rank,
            state_port,
            buffers,
            step_policy(config.optim, config.worker),
            device=self.device,
            loss=self.task.loss,
            window=weight_window(
                config.worker, model, units, layout, rank=self.rank, run_id=self.run_id, observer=self.metrics
            ),
        )
        self._report_resident_bytes()

    @property
    def layout(self) -> Layout:
        return self._step().layout

    def register_segments(self) -> int:
        """Fill the local shards with the initial values and register this worker's
        segments with their servers; returns the common update count."""
        with torch.device("meta"):
            shapes = self.task.build()
        updates = self._step().register(self.task.initial_values(shapes))
        self._report_resident_bytes()  # the device segments' state exists now
        return updates

    def join_segments(self) -> int:
        """The common update count of this worker's segments, which their holders already
        have (restored from a checkpoint, or kept through a live recovery): nothing is
        drawn or sent; :meth:`load_weights` brings their weights."""
        return self._step().join()

    def metrics_address(self) -> str:
        return self.metrics.address if self.metrics.serving else ""

    def load_weights(self, loss_scale: LossScaleState | None = None) -> None:
        """Fetch the servers' current weights (after a restore) into the local shards;
        ``loss_scale``: where the checkpoint's dynamic loss scale stood (fp16)."""
        step = self._step()
        step.load_weights()
        if loss_scale is not None and step.loss_scale is not None:
            step.loss_scale = loss_scale

    def loss_scale(self) -> LossScaleState | None:
        """Where the dynamic loss scale stands (fp16 compute; None otherwise)."""
        return self._step().loss_scale

    def settle(self) -> None:
        """Wait for the updates still in flight (before a checkpoint, or reading the servers' state)."""
        self._step().settle()

    def local_weights(self) -> torch.Tensor:
        """This worker's range of the flat space: the newest weights in the compute dtype."""
        return self._step().newest_weights()

    def shutdown(self) -> None:
        """Stop after the work in flight; a delayed update's fetches get ``SHUTDOWN_WAIT_S``
        (a dead server can block them for good)."""
        self.leave_group()
        self.registry.close()
        self.metrics.stop()

    def leave_group(self) -> None:
        """Close everything :meth:`init_process_group` made (the step, the connections to
        the servers, the exchange buffers, the weight files, the process group) after the
        work in flight, keeping the process, its data and its metrics endpoint: a worker
        that outlived a lost peer joins the next group with the peer's replacement (a live
        recovery) without starting a process again."""
        if self.step is not None:
            try:
                self.step.settle(timeout=SHUTDOWN_WAIT_S)
            except TimeoutError:
                logger.warning("a delayed update was still in flight after %ss; stopping anyway", SHUTDOWN_WAIT_S)
            self.step.close()
            self.step.port.close()
            self.step.buffers.close()
            self.step = None
        if self._collectives is not None:
            self._collectives.close()
            self._collectives = None
        if dist.is_initialized():
            dist.destroy_process_group()
        self._store = None

    # --- the step ------------------------------------------------------------------
    def train_step(self, step: int) -> StepReport:
        """One step on the micro-batches of data step ``step``."""
        config = self.config
        micros = range(config.data.micro_batches)
        batches = [self.data.batch(step, self.rank, micro) for micro in micros]
        seeds = [dropout_seed(config.seed, step, self.rank, micro) for micro in micros]
        started = time.perf_counter()
        lr = config.optim.lr_at(step, config.steps)
        with self.preemption.stepping():
            report = self._step().run(step, batches, lr, dropout_seeds=seeds)
        for phase, seconds in report.phases.items():
            self.metrics.add_phase(phase, seconds)
        self.metrics.observe_step(
            time.perf_counter() - started, report.loss, skipped=report.skipped, loss_scale=report.loss_scale
        )
        return dataclasses.replace(report, leaving=True) if self.preemption.received else report

    def evaluate(self, step: int) -> EvalReport:
        """Validate on the held-out set (``eval.*``) after data step ``step``."""
        held_out = self.eval_set
        if held_out is None:
            raise TrainingError("evaluate was called but eval.path and eval.split are not set")
        started = time.perf_counter()
        batches = (held_out.batch(index, self.rank) for index in range(held_out.num_batches))
        loss = self._step().evaluate(batches, held_out.num_batches)
        return EvalReport(step=step, loss=loss, seconds=time.perf_counter() - started)

    def resident_bytes(self) -> dict[str, int]:
        """Bytes of the buffers this worker holds for training between steps, by kind
        (the metric's kinds: "optimizer" only with device segments)."""
        step = self._step()
        tensors = local_tensors(step.model, step.layout)
        if step.window is not None:  # the root's, and at most the window's blocks and its read buffers
            tensors = tensors[: len(step.layout.unit_params(0))]
        weights = sum(t.numel() * t.element_size() for t in tensors)
        if step.window is not None:
            weights += step.window.host_bytes
        held = {"weights": weights, "exchange": step.buffers.nbytes}
        if self._collectives is not None:
            held["collectives"] = self._collectives.nbytes
        if step.layout.device_segments(self.rank):
            held["optimizer"] = self.registry.resident_bytes()
        return held

    def _report_resident_bytes(self) -> None:
        for kind, nbytes in self.resident_bytes().items():
            self.metrics.set_resident_bytes(kind, nbytes)

    def _step(self) -> ShardedStep:
        if self.step is None:
            raise TrainingError(f"worker {self.rank} has not joined its process group yet")
        return self.step

    def _colocated_servers(self, server_node_ids: list[str] | None) -> set[int]:
        if self.config.worker.shared_memory == "off" or not server_node_ids or not shm.available():
            return set()
        import ray

        here = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        return {index for index, node in enumerate(server_node_ids) if node == here}


def process_group_backend(device: torch.device) -> str:
    """NCCL between CUDA workers, gloo between CPU ones; where this torch has no NCCL, a
    clear error now rather than one from deep inside torch.distributed."""
    if device.type != "cuda":
        return "gloo"
    if not dist.is_nccl_available():
        raise ConfigError(
            "CUDA workers (worker.gpus above 0) need NCCL and this torch has none "
            "(torch.distributed.is_nccl_available() is False); install a CUDA build of torch with NCCL, or set "
            "worker.gpus=0 to train on CPUs"
        )
    return "nccl"


def report_pageable(buffers: ExchangeBuffers, rank: int, metrics: WorkerMetrics) -> None:
    """Warn (once: buffers are made once per worker) and count exchange buffers that a GPU
    worker asked to page-lock and could not: it still trains, its copies are synchronous."""
    if buffers.pin_refused is None:
        return
    logger.warning(
        "worker %d: exchange buffers left pageable, so copies to and from the GPU are synchronous: %s",
        rank,
        buffers.pin_refused,
    )
    metrics.record_page_lock_fallback(buffers.pin_refused.reason)
