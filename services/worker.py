"""A training worker: one per accelerator, holding only the low-precision weights and a
gradient buffer; the optimizer state lives on the state servers.

One step: forward/backward into a flat gradient buffer, reduce-scatter it among workers
(each keeps 1/W, averaged), all-reduce the squared norm for clipping, push each segment
of the shard to the state server that owns it, fetch the updated weights of those
segments, all-gather the weights. The class is a plain object; the launcher runs it as a
Ray actor.
"""

from __future__ import annotations

import logging
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from cargohold.cluster.config import TrainConfig
from cargohold.services.data import batch_for_step, load_tokens
from cargohold.services.errors import TrainingError
from cargohold.services.layout import ShardLayout, layout_for_module, parameter_views
from cargohold.services.metrics import WorkerMetrics
from cargohold.services.models.gpt import GPT
from cargohold.services.node import node_ip
from cargohold.services.optim import global_norm_from_squares, sum_of_squares
from cargohold.services.shard_state import WIRE_DTYPES, ShardSpec
from cargohold.services.transport.grpc_client import StateServerClient

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StepReport:
    """What one worker did in one step; the launcher aggregates these."""

    rank: int
    step: int
    loss: float
    """Mean loss over all workers' batches (identical on every rank)."""
    global_grad_norm: float
    seconds: float
    phases: dict[str, float] = field(default_factory=dict)
    applied: int = 0
    """Segments whose push was applied (not ignored as a repeat)."""


def resolve_device(requested: str) -> torch.device:
    """``auto`` picks CUDA when this process sees a GPU, else the CPU."""
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise TrainingError("worker.device is 'cuda' but this worker sees no GPU; set worker.device=cpu")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build_model(config: TrainConfig) -> GPT:
    """The model with its deterministic fp32 initialisation (same on every rank)."""
    torch.manual_seed(config.seed)
    return GPT(config.model)


class TrainingWorker:
    def __init__(self, config: TrainConfig, *, rank: int, run_id: str, server_addresses: list[str]) -> None:
        torch.set_num_threads(config.worker.torch_threads)
        self.config = config
        self.rank = rank
        self.run_id = run_id
        self.world_size = config.worker.num_workers
        self.device = resolve_device(config.worker.device)
        self.compute_dtype = WIRE_DTYPES[config.worker.compute_dtype]
        self.wire_dtype = WIRE_DTYPES[config.worker.grad_wire_dtype]

        model = build_model(config)
        self.layout: ShardLayout = layout_for_module(
            model, num_workers=self.world_size, num_servers=len(server_addresses)
        )
        initial = torch.zeros(self.layout.total, dtype=torch.float32)
        for view, param in zip(parameter_views(self.layout, initial), model.parameters()):
            view.copy_(param.detach())
        self.segments = self.layout.segments_of_worker(rank)
        self.shard_start, self.shard_stop = self.layout.worker_range(rank)
        # fp32 initial values of this worker's segments, sent once at registration.
        self._initial_shard = initial[self.shard_start : self.shard_stop].clone()

        self.flat_weights = initial.to(device=self.device, dtype=self.compute_dtype)
        self.flat_grad = torch.zeros_like(self.flat_weights)
        del initial
        for param, weight, grad in zip(
            model.parameters(),
            parameter_views(self.layout, self.flat_weights),
            parameter_views(self.layout, self.flat_grad),
        ):
            param.data = weight
            param.grad = grad  # backward accumulates into the flat buffer in place
        self.model = model.train()
        shard_size = self.layout.worker_shard_size
        self._grad_shard = torch.empty(shard_size, dtype=self.wire_dtype, device=self.device)
        self._weight_shard = torch.empty(shard_size, dtype=self.compute_dtype, device=self.device)
        self._host_grad_shard = self._host_buffer(shard_size, self.wire_dtype)

        self.tokens = load_tokens(
            config.data.corpus_path, config.data.corpus_bytes, config.data.seed,
            seq_len=config.model.block_size,
        )
        self.clients = [
            StateServerClient(address, chunk_bytes=config.state_server.chunk_bytes,
                              timeout_s=config.state_server.rpc_timeout_s)
            for address in server_addresses
        ]
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.segments)), thread_name_prefix="push")
        self.metrics = WorkerMetrics(rank)
        if config.metrics.enabled:
            self.metrics.start(host=node_ip())
        self._report_resident_bytes()

    # --- lifecycle -----------------------------------------------------------------
    def rendezvous_address(self) -> tuple[str, int]:
        """Host and a free port for torch.distributed's TCP store (called on rank 0)."""
        host = node_ip()
        with socket.socket() as probe:
            probe.bind((host, 0))
            return host, probe.getsockname()[1]

    def init_process_group(self, host: str, port: int, timeout_s: float = 300.0) -> None:
        import datetime

        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend, init_method=f"tcp://{host}:{port}", rank=self.rank,
            world_size=self.world_size, timeout=datetime.timedelta(seconds=timeout_s),
        )

    def register_shards(self) -> int:
        """Register this worker's segments with their servers; returns the common step."""
        steps = set()
        for segment in self.segments:
            spec = ShardSpec(
                run_id=self.run_id,
                shard_id=segment.segment_id,
                start=segment.start,
                numel=segment.numel,
                fragments=tuple((f.segment_start, f.length) for f in segment.fragments),
                grad_dtype=self.config.worker.grad_wire_dtype,
                hyper=self.config.optim.hyper_params(),
            )
            local = slice(segment.start - self.shard_start, segment.stop - self.shard_start)
            for client in self.clients:
                client.wait_ready()
            step, _ = self.clients[segment.server].register(spec, self._initial_shard[local])
            steps.add(step)
        self._initial_shard = torch.empty(0)
        if len(steps) > 1:
            raise TrainingError(f"rank {self.rank}: registered segments are at different steps {sorted(steps)}")
        return steps.pop() if steps else 0

    def metrics_address(self) -> str:
        return self.metrics.address if self.metrics.serving else ""

    def flat_weights_cpu(self) -> torch.Tensor:
        return self.flat_weights.detach().to("cpu", copy=True)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
        for client in self.clients:
            client.close()
        self.metrics.stop()
        if dist.is_initialized():
            dist.destroy_process_group()

    # --- the step ------------------------------------------------------------------
    def train_step(self, step: int) -> StepReport:
        phases: dict[str, float] = {}
        started = time.perf_counter()
        mark = started

        def lap(phase: str) -> None:
            nonlocal mark
            now = time.perf_counter()
            phases[phase] = now - mark
            self.metrics.add_phase(phase, now - mark)
            mark = now

        x, y = batch_for_step(
            self.tokens, step=step, rank=self.rank, world_size=self.world_size,
            batch_size=self.config.data.batch_size, seq_len=self.config.model.block_size,
            seed=self.config.data.seed,
        )
        self.flat_grad.zero_()
        _, loss = self.model(x.to(self.device), y.to(self.device))
        loss.backward()
        lap("compute")

        reduce_input = self.flat_grad if self.flat_grad.dtype == self.wire_dtype else self.flat_grad.to(self.wire_dtype)
        dist.reduce_scatter_single(self._grad_shard, reduce_input, op=dist.ReduceOp.SUM)
        self._grad_shard.div_(self.world_size)
        totals = torch.tensor([sum_of_squares(self._grad_shard), float(loss.detach())], dtype=torch.float64,
                              device=self.device)
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
        global_norm = global_norm_from_squares(float(totals[0]))
        mean_loss = float(totals[1]) / self.world_size
        host_grad = self._to_host(self._grad_shard)
        lap("reduce")

        lr = self.config.optim.lr_at(step, self.config.steps)
        outcomes = list(self._pool.map(
            lambda seg: self._push_and_fetch(seg, step, host_grad, global_norm, lr), self.segments
        ))
        lap("push")
        dist.all_gather_single(self.flat_weights, self._weight_shard)
        lap("gather")

        seconds = time.perf_counter() - started
        self.metrics.observe_step(seconds, mean_loss)
        return StepReport(
            rank=self.rank, step=step, loss=mean_loss, global_grad_norm=global_norm,
            seconds=seconds, phases=phases, applied=sum(outcomes),
        )

    def _push_and_fetch(self, segment, step: int, host_grad: torch.Tensor, global_norm: float, lr: float) -> bool:
        local = slice(segment.start - self.shard_start, segment.stop - self.shard_start)
        client = self.clients[segment.server]
        gradient = host_grad[local]
        outcome = client.push(self.run_id, segment.segment_id, step, gradient, global_norm=global_norm, lr=lr)
        self.metrics.record_sent("PushGradient", gradient.numel() * gradient.element_size())
        weights = client.fetch(self.run_id, segment.segment_id, step, self.config.worker.compute_dtype, segment.numel)
        self.metrics.record_received("FetchWeights", weights.numel() * weights.element_size())
        self._weight_shard[local].copy_(weights, non_blocking=True)
        return outcome.applied

    # --- memory helpers --------------------------------------------------------------
    def _host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Pinned on a GPU node so device-to-host copies run at full PCIe speed."""
        if self.device.type == "cuda":
            return torch.empty(numel, dtype=dtype, pin_memory=True)
        return torch.empty(0, dtype=dtype)

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda":
            return tensor
        self._host_grad_shard.copy_(tensor, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        return self._host_grad_shard

    def resident_bytes(self) -> dict[str, int]:
        """Bytes of the buffers this worker holds for training, by kind."""
        def size(t: torch.Tensor) -> int:
            return t.numel() * t.element_size()

        return {
            "weights": size(self.flat_weights),
            "gradients": size(self.flat_grad),
            "grad_shard": size(self._grad_shard) + size(self._weight_shard) + size(self._host_grad_shard),
        }

    def _report_resident_bytes(self) -> None:
        for kind, nbytes in self.resident_bytes().items():
            self.metrics.set_resident_bytes(kind, nbytes)

