"""A training worker: one Ray actor per accelerator, holding 1/W of the model.

The model is built on the meta device, sharded with FSDP2 per transformer block and at
the root, and only this worker's chunk of each parameter is ever materialised (in the
compute dtype; in host memory with ``worker.offload_params``). The optimizer state lives
on the state servers. This class is the thin shell: process group, clients, shared
memory, metrics, lifecycle; the step itself is :class:`~cargohold.services.step.ShardedStep`.
"""

from __future__ import annotations

import datetime
import logging
import socket
import time

import torch
import torch.distributed as dist
from torch import nn

from cargohold.cluster.config import TrainConfig
from cargohold.services.data import batch_for_step, dropout_seed, load_tokens
from cargohold.services.errors import ConfigError, TrainingError
from cargohold.services.layout import ShardLayout
from cargohold.services.metrics import WorkerMetrics
from cargohold.services.models.blocks import apply_activation_checkpointing, transformer_blocks
from cargohold.services.models.build import buffer_values, build_model, parameter_values
from cargohold.services.models.hf import HFCausalLM
from cargohold.services.node import node_ip
from cargohold.services.shard_state import WIRE_DTYPES
from cargohold.services.sharding import Unit, check_unit_order, layout_for_units, shard_units, units_of
from cargohold.services.state_port import ExchangeBuffers, RemotePort
from cargohold.services.step import ShardedStep, StepPolicy, StepReport
from cargohold.services.transport.grpc_client import StateServerClient
from cargohold.services.transport.shm import SHM_ROOT

logger = logging.getLogger(__name__)
SHUTDOWN_WAIT_S = 60.0
"""How long shutdown waits for a delayed update still in flight."""

__all__ = ["StepReport", "TrainingWorker", "exchange_buffers", "model_layout", "resolve_device", "sharded_model", "step_policy"]


def resolve_device(requested: str) -> torch.device:
    """``auto`` picks CUDA when this process sees a GPU, else the CPU."""
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise TrainingError("worker.device is 'cuda' but this worker sees no GPU; set worker.device=cpu")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def model_layout(config: TrainConfig) -> tuple[nn.Module, list[Unit], ShardLayout]:
    """The meta-device model, its FSDP2 units and the layout every process derives from
    the config (workers, launcher, plan, tests)."""
    with torch.device("meta"):
        model = build_model(config)
    units = units_of(model, transformer_blocks(model))
    layout = layout_for_units(model, units, num_workers=config.worker.num_workers,
                              num_servers=config.state_server.num_servers)
    return model, units, layout


def sharded_model(config: TrainConfig, device: torch.device) -> tuple[nn.Module, list[Unit], ShardLayout]:
    """The model sharded with FSDP2 (the process group must exist), local shards
    allocated on ``device`` (host memory when offloaded) but not yet filled."""
    model, units, layout = model_layout(config)
    worker = config.worker
    if worker.offload_params and device.type == "cuda":
        _check_pinned_memory()
    model.to(WIRE_DTYPES[worker.compute_dtype])  # FSDP2 keeps the shards in the dtype it finds
    if worker.activation_checkpointing == "blocks":
        apply_activation_checkpointing([unit.module for unit in units[1:]])
    shard_units(units, compute_dtype=WIRE_DTYPES[worker.compute_dtype],
                reduce_dtype=WIRE_DTYPES[worker.grad_wire_dtype], reshard_after_forward=worker.reshard_after_forward,
                offload=worker.offload_params, pin_memory=device.type == "cuda")
    model.to_empty(device="cpu" if worker.offload_params else device)
    _set_buffers(config, model)
    check_unit_order(model, units)
    return model.train(), units, layout


def _check_pinned_memory() -> None:
    """Offloaded shards live in page-locked memory; refuse clearly where there is none."""
    try:
        torch.empty(1, pin_memory=True)
    except RuntimeError as error:
        raise ConfigError(f"worker.offload_params needs pinned host memory, which this worker cannot "
                          f"allocate ({error}); raise the memlock limit or set worker.offload_params=false") from error


def _set_buffers(config: TrainConfig, model: nn.Module) -> None:
    """Buffers made at construction (Llama's rotary frequencies) are garbage after
    ``to_empty``: recompute them as ``build_model`` would."""
    with torch.device("meta"):
        shapes = build_model(config)
    values = dict(buffer_values(config, shapes))
    if isinstance(model, HFCausalLM):
        model.set_buffers(values)
        return
    with torch.no_grad():
        for name, value in values.items():
            model.get_buffer(name).copy_(value)


def exchange_buffers(config: TrainConfig, layout: ShardLayout, *, shared_name: str | None = None,
                     pin: bool = False) -> ExchangeBuffers:
    """``worker.exchange_slots`` slots of the largest unit, and the whole range's weights
    with the delayed update."""
    worker = config.worker
    return ExchangeBuffers.allocate(
        layout.largest_group, WIRE_DTYPES[worker.grad_wire_dtype], WIRE_DTYPES[worker.compute_dtype],
        slots=worker.exchange_slots, held_numel=layout.worker_size if worker.delayed_update else 0,
        shared_name=shared_name, pin=pin)


def step_policy(config: TrainConfig) -> StepPolicy:
    optim, worker = config.optim, config.worker
    return StepPolicy(staged=optim.max_grad_norm > 0 or optim.nonfinite != "ignore", nonfinite=optim.nonfinite,
                      delayed_after=worker.delayed_update_after_steps if worker.delayed_update else None)


class TrainingWorker:
    def __init__(self, config: TrainConfig, *, rank: int, run_id: str, server_addresses: list[str],
                 server_node_ids: list[str] | None = None, auth_token: str | None = None) -> None:
        torch.set_num_threads(config.worker.torch_threads)
        if len(server_addresses) != config.state_server.num_servers:
            raise TrainingError(f"{len(server_addresses)} server addresses for state_server.num_servers="
                                f"{config.state_server.num_servers}")
        self.config = config
        self.rank = rank
        self.run_id = run_id
        self.world_size = config.worker.num_workers
        self.device = resolve_device(config.worker.device)
        self._server_addresses = server_addresses
        self._server_node_ids = server_node_ids
        self._auth_token = auth_token
        self.tokens = load_tokens(config.data.corpus_path, config.data.corpus_bytes, config.data.seed,
                                  seq_len=config.model.block_size)
        self.metrics = WorkerMetrics(rank)
        if config.metrics.enabled:
            self.metrics.start(host=node_ip(), port=config.metrics.port_for("worker", rank, config))
        self.step: ShardedStep | None = None

    # --- lifecycle -----------------------------------------------------------------
    def rendezvous_address(self) -> tuple[str, int]:
        """Host and a free port for torch.distributed's TCP store (called on rank 0)."""
        host = node_ip()
        with socket.socket() as probe:
            probe.bind((host, 0))
            return host, probe.getsockname()[1]

    def init_process_group(self, host: str, port: int, timeout_s: float = 300.0) -> None:
        """Join the workers' process group, then shard the model (FSDP2 needs the group)."""
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=self.rank,
                                world_size=self.world_size, timeout=datetime.timedelta(seconds=timeout_s))
        model, units, layout = sharded_model(self.config, self.device)
        config = self.config
        shared = self._colocated_servers(self._server_node_ids)
        buffers = exchange_buffers(config, layout, shared_name=f"{self.run_id}-rank{self.rank}" if shared else None,
                                   pin=self.device.type == "cuda")
        clients = [StateServerClient(address, chunk_bytes=config.state_server.chunk_bytes,
                                     timeout_s=config.state_server.rpc_timeout_s, auth_token=self._auth_token,
                                     tls=config.security.tls())
                   for address in self._server_addresses]
        port = RemotePort(config, self.run_id, clients, buffers, shared, self.metrics)
        self.step = ShardedStep(model, units, layout, self.rank, port, buffers, step_policy(config), device=self.device)
        self._report_resident_bytes()

    @property
    def layout(self) -> ShardLayout:
        return self._step().layout

    def register_shards(self) -> int:
        """Fill the local shards with the initial values and register this worker's
        segments with their servers; returns the common update count."""
        with torch.device("meta"):
            shapes = build_model(self.config)
        return self._step().register(lambda names: parameter_values(self.config, shapes, names))

    def metrics_address(self) -> str:
        return self.metrics.address if self.metrics.serving else ""

    def load_weights(self) -> None:
        """Fetch the servers' current weights (after a restore) into the local shards."""
        self._step().load_weights()

    def settle(self) -> None:
        """Wait for a delayed update still in flight (before a checkpoint)."""
        self._step().settle()

    def local_weights(self) -> torch.Tensor:
        """This worker's range of the flat space: the newest weights in the compute dtype."""
        return self._step().newest_weights()

    def shutdown(self) -> None:
        """Stop after the work in flight; a delayed update's fetches get ``SHUTDOWN_WAIT_S``
        (a dead server can block them for good)."""
        if self.step is not None:
            try:
                self.step.settle(timeout=SHUTDOWN_WAIT_S)
            except TimeoutError:
                logger.warning("a delayed update was still in flight after %ss; stopping anyway", SHUTDOWN_WAIT_S)
            self.step.close()
            self.step.port.close()
            self.step.buffers.close()
        self.metrics.stop()
        if dist.is_initialized():
            dist.destroy_process_group()

    # --- the step ------------------------------------------------------------------
    def train_step(self, step: int) -> StepReport:
        """One step on the batch of data step ``step``."""
        config = self.config
        x, y = batch_for_step(self.tokens, step=step, rank=self.rank, world_size=self.world_size,
                              batch_size=config.data.batch_size, seq_len=config.model.block_size,
                              seed=config.data.seed)
        torch.manual_seed(dropout_seed(config.seed, step, self.rank))  # CPU and every GPU
        started = time.perf_counter()
        report = self._step().run(step, x, y, config.optim.lr_at(step, config.steps))
        for phase, seconds in report.phases.items():
            self.metrics.add_phase(phase, seconds)
        self.metrics.observe_step(time.perf_counter() - started, report.loss)
        return report

    def resident_bytes(self) -> dict[str, int]:
        """Bytes of the buffers this worker holds for training between steps, by kind."""
        step = self._step()
        weights = sum(p.to_local().numel() * p.element_size() for p in step.model.parameters())
        return {"weights": weights, "exchange": step.buffers.nbytes}

    def _report_resident_bytes(self) -> None:
        for kind, nbytes in self.resident_bytes().items():
            self.metrics.set_resident_bytes(kind, nbytes)

    def _step(self) -> ShardedStep:
        if self.step is None:
            raise TrainingError(f"worker {self.rank} has not joined its process group yet")
        return self.step

    def _colocated_servers(self, server_node_ids: list[str] | None) -> set[int]:
        if (self.config.worker.shared_memory == "off" or not server_node_ids
                or self.device.type != "cpu" or not SHM_ROOT.is_dir()):
            return set()
        import ray

        here = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        return {index for index, node in enumerate(server_node_ids) if node == here}
