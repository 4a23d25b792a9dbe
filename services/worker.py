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
import math
import queue
import socket
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from cargohold.cluster.config import TrainConfig
from cargohold.services.bucketing import BucketReadiness
from cargohold.services.data import batch_for_step, dropout_seed, load_tokens
from cargohold.services.errors import TrainingError
from cargohold.services.flat_params import move_into_flat
from cargohold.services.layout import Segment, ShardLayout, layout_for_module, parameter_views
from cargohold.services.metrics import WorkerMetrics
from cargohold.services.models.gpt import GPT
from cargohold.services.models.hf import build_hf_model
from cargohold.services.node import node_ip
from cargohold.services.optim import global_norm_from_squares, sum_of_squares
from cargohold.services.shard_state import WIRE_DTYPES, ShardSpec
from cargohold.services.transport.grpc_client import StateServerClient
from cargohold.services.transport.shm import SHM_ROOT, SharedRegion

logger = logging.getLogger(__name__)
SHUTDOWN_WAIT_S = 60.0
"""How long shutdown waits for a delayed update still in flight."""


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
    skipped: bool = False
    """The gradient norm was not finite and the update was skipped (optim.nonfinite)."""


def resolve_device(requested: str) -> torch.device:
    """``auto`` picks CUDA when this process sees a GPU, else the CPU."""
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise TrainingError("worker.device is 'cuda' but this worker sees no GPU; set worker.device=cpu")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build_model(config: TrainConfig) -> torch.nn.Module:
    """The model with its deterministic fp32 initialisation (same on every rank): the
    transformers causal LM that ``hf`` names, else the built-in GPT."""
    torch.manual_seed(config.seed)
    if config.hf.enabled:
        return build_hf_model(config.hf)
    return GPT(config.model)


def layout_for_config(config: TrainConfig, model: torch.nn.Module) -> ShardLayout:
    """The shard layout every worker (and every test reference) derives from the config."""
    wire_bytes = WIRE_DTYPES[config.worker.grad_wire_dtype].itemsize
    return layout_for_module(
        model,
        num_workers=config.worker.num_workers,
        num_servers=config.state_server.num_servers,
        bucket_elements=max(1, config.worker.bucket_bytes // wire_bytes),
    )


def segment_spec(config: TrainConfig, run_id: str, segment: Segment) -> ShardSpec:
    """What a state server is told about one segment it owns."""
    return ShardSpec(
        run_id=run_id,
        shard_id=segment.segment_id,
        start=segment.start,
        numel=segment.numel,
        fragments=tuple((f.segment_start, f.length) for f in segment.fragments),
        grad_dtype=config.worker.grad_wire_dtype,
        hyper=config.optim.hyper_params(),
    )


class TrainingWorker:
    def __init__(self, config: TrainConfig, *, rank: int, run_id: str, server_addresses: list[str],
                 server_node_ids: list[str] | None = None, auth_token: str | None = None) -> None:
        torch.set_num_threads(config.worker.torch_threads)
        self.config = config
        self.rank = rank
        self.run_id = run_id
        self.world_size = config.worker.num_workers
        self.device = resolve_device(config.worker.device)
        self.compute_dtype = WIRE_DTYPES[config.worker.compute_dtype]
        self.wire_dtype = WIRE_DTYPES[config.worker.grad_wire_dtype]

        if len(server_addresses) != config.state_server.num_servers:
            raise TrainingError(
                f"{len(server_addresses)} server addresses for state_server.num_servers="
                f"{config.state_server.num_servers}"
            )
        model = build_model(config)
        self.layout: ShardLayout = layout_for_config(config, model)
        self.segments = self.layout.segments_of_worker(rank)
        self.pieces = self.layout.worker_pieces(rank)
        # The parameters move into the flat weights one by one (never two copies of the
        # model); the fp32 initial values of this worker's pieces are sent once at
        # registration.
        self.flat_weights, self._initial_shard = move_into_flat(
            model, self.layout, self.pieces, dtype=self.compute_dtype, device=self.device)
        self.flat_grad = torch.zeros_like(self.flat_weights)
        for param, grad in zip(model.parameters(), parameter_views(self.layout, self.flat_grad)):
            param.grad = grad  # backward accumulates into the flat buffer in place
        self.model = model.train()
        # With a delayed update the next weights are gathered here during compute.
        self._spare_weights = torch.empty_like(self.flat_weights) if config.worker.delayed_update else None
        self._pending: Future | None = None
        self._updates = 0  # updates the servers applied; set by register_shards
        self._readiness = BucketReadiness(self.layout)
        self._ready: queue.SimpleQueue[int] = queue.SimpleQueue()
        for index, param in enumerate(model.parameters()):
            param.register_post_accumulate_grad_hook(self._on_gradient(index))
        self._events = {}  # bucket -> CUDA event recorded when backward finished it
        shard_size = self.layout.worker_shard_size
        # Servers on this node read gradients from, and write weights into, shared memory.
        self._shm_servers = self._colocated_servers(server_node_ids)
        self._shm: SharedRegion | None = None
        if self._shm_servers:
            wire, compute = self.wire_dtype.itemsize, self.compute_dtype.itemsize
            self._shm = SharedRegion.create(f"{run_id}-rank{rank}-{uuid.uuid4().hex[:8]}",
                                            shard_size * (wire + compute))
            self._grad_shard = self._shm.tensor(self.wire_dtype, 0, shard_size)
            self._weight_shard = self._shm.tensor(self.compute_dtype, shard_size * wire, shard_size)
        else:
            self._grad_shard = torch.empty(shard_size, dtype=self.wire_dtype, device=self.device)
            self._weight_shard = torch.empty(shard_size, dtype=self.compute_dtype, device=self.device)
        self._host_grad_shard = self._host_buffer(shard_size, self.wire_dtype)

        self.tokens = load_tokens(
            config.data.corpus_path, config.data.corpus_bytes, config.data.seed,
            seq_len=config.model.block_size,
        )
        self.clients = [
            StateServerClient(address, chunk_bytes=config.state_server.chunk_bytes,
                              timeout_s=config.state_server.rpc_timeout_s, auth_token=auth_token,
                              tls=config.security.tls())
            for address in server_addresses
        ]
        self._pool = ThreadPoolExecutor(max_workers=max(1, min(16, len(self.segments))), thread_name_prefix="push")
        # One thread issues every collective, so all ranks issue them in the same order.
        self._comm = ThreadPoolExecutor(max_workers=1, thread_name_prefix="collectives")
        self.metrics = WorkerMetrics(rank)
        if config.metrics.enabled:
            self.metrics.start(host=node_ip(), port=config.metrics.port_for("worker", rank, config))
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
            spec = segment_spec(self.config, self.run_id, segment)
            for client in self.clients:
                client.wait_ready()
            step, _ = self.clients[segment.server].register(spec, self._initial_shard[self._local(segment)])
            steps.add(step)
        self._initial_shard = torch.empty(0)
        if len(steps) > 1:
            raise TrainingError(f"rank {self.rank}: registered segments are at different steps {sorted(steps)}")
        self._updates = steps.pop() if steps else 0
        return self._updates

    def metrics_address(self) -> str:
        return self.metrics.address if self.metrics.serving else ""

    def load_weights(self) -> None:
        """Fetch the servers' current weights (after a restore) and gather them."""
        def fetch(segment) -> int:
            self._fetch(segment, self._updates)
            return 0

        transfers = [self._pool.submit(fetch, segment) for segment in self.segments]
        self._comm.submit(self._gather, transfers, self.flat_weights).result()

    def settle(self) -> None:
        """Wait for a delayed update still in flight (before a checkpoint), keeping the
        weights the next step computes on."""
        if self._pending is not None:
            self._pending.exception()

    def flat_weights_cpu(self) -> torch.Tensor:
        """The newest weights (with a delayed update, after waiting for the last one)."""
        self._adopt_pending_weights()
        return self.flat_weights.detach().to("cpu", copy=True)

    def shutdown(self) -> None:
        """Stop after the work in flight. A delayed update's gather still running
        collectives must end before the process group and shared memory go (else the
        collective thread touches freed state: a segfault at teardown); it is given
        ``SHUTDOWN_WAIT_S``, since a dead peer can block it for good."""
        if self._pending is not None:
            try:
                self._pending.exception(timeout=SHUTDOWN_WAIT_S)
            except TimeoutError:
                logger.warning("a delayed update was still in flight after %ss; stopping anyway", SHUTDOWN_WAIT_S)
        self._pool.shutdown(wait=True)
        self._comm.shutdown(wait=False, cancel_futures=True)
        if self._shm is not None:
            self._shm.close()
        for client in self.clients:
            client.close()
        self.metrics.stop()
        if dist.is_initialized():
            dist.destroy_process_group()

    # --- the step ------------------------------------------------------------------
    def train_step(self, step: int) -> StepReport:
        """One step on the batch of data step ``step``. Buckets are reduced and pushed as
        backward completes them; with clipping on (or non-finite gradients checked), the
        servers stage them until the global norm is known, then CommitStep applies them.

        Server shards count *updates*, which fall behind data steps when a step with a
        non-finite gradient is skipped (``optim.nonfinite: skip``)."""
        phases: dict[str, float] = {}
        started = mark = time.perf_counter()

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
        policy = self.config.optim.nonfinite
        defer = self.config.optim.max_grad_norm > 0 or policy != "ignore"
        lr = self.config.optim.lr_at(step, self.config.steps)
        torch.manual_seed(dropout_seed(self.config.seed, step, self.rank))  # CPU and every GPU
        update = self._updates + 1
        self.flat_grad.zero_()
        self._readiness.reset()
        self._events.clear()
        delayed = self._delayed(step)
        shipping = self._comm.submit(self._reduce_and_ship, update, lr, defer, delayed)
        _, loss = self.model(x.to(self.device), y.to(self.device))
        loss.backward()
        for index in self._readiness.release_rest():
            self._enqueue(index)
        lap("compute")

        sum_squares, transfers = shipping.result()
        totals = torch.tensor([sum_squares, float(loss.detach())], dtype=torch.float64, device=self.device)
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
        global_norm = global_norm_from_squares(float(totals[0]))
        mean_loss = float(totals[1]) / self.world_size
        lap("reduce")

        skipped = not math.isfinite(global_norm) and policy != "ignore"
        if skipped:
            for future in transfers:  # the staged gradients are replaced by the next push
                future.result()
            if policy == "fail":
                raise TrainingError(
                    f"the gradient norm of step {step} is {global_norm}; set optim.nonfinite=skip to "
                    "skip such steps, or lower optim.lr"
                )
            logger.warning("step %d: gradient norm %s, update skipped", step, global_norm)
            applied = self._adopt_pending_weights()
        elif delayed:
            applied = self._finish_delayed(update, transfers, global_norm, lr, defer)
        else:
            if defer:
                transfers = self._commit(transfers, update, global_norm, lr, fetch=True)
            gathering = self._comm.submit(self._gather, transfers, self.flat_weights)
            applied = gathering.result()
        if not skipped:
            self._updates = update
        lap("push")

        seconds = time.perf_counter() - started
        self.metrics.observe_step(seconds, mean_loss)
        return StepReport(
            rank=self.rank, step=step, loss=mean_loss, global_grad_norm=global_norm,
            seconds=seconds, phases=phases, applied=applied, skipped=skipped,
        )

    def _commit(self, staged: list[Future], step: int, global_norm: float, lr: float, *,
                fetch: bool) -> list[Future]:
        """Once every staged push landed, commit each segment (and fetch its weights)."""
        for future in staged:
            future.result()
        return [self._pool.submit(self._commit_and_fetch, seg, step, global_norm, lr, fetch)
                for seg in self.segments]

    def _gather(self, transfers: list[Future], target: torch.Tensor) -> int:
        """On the collectives thread: all-gather each bucket's weights into ``target`` as
        soon as this worker's segments of it are fetched. Returns the updates applied."""
        applied = 0
        works = []
        for bucket in self.layout.buckets:
            for segment, future in zip(self.segments, transfers):
                if segment.bucket == bucket.index:
                    applied += future.result()
            offset = self.layout.piece_offset(bucket.index)
            works.append(dist.all_gather_single(
                target[bucket.start : bucket.stop],
                self._weight_shard[offset : offset + bucket.piece_size], async_op=True,
            ))
        for work in works:
            work.wait()
        return applied

    # --- one-step delayed parameter update ------------------------------------------
    def _finish_delayed(self, step: int, staged: list[Future], global_norm: float, lr: float,
                        defer: bool) -> int:
        """DPU: this step's gradients were computed on the weights of two updates ago.
        Switch the model to the weights the previous step's update produced (fetched and
        gathered during this step's compute), then start this step's update and let its
        weights arrive during the next step."""
        applied = self._adopt_pending_weights()
        if defer:
            staged = self._commit(staged, step, global_norm, lr, fetch=False)
        fetches = [self._pool.submit(self._await_and_fetch, seg, future, step)
                   for seg, future in zip(self.segments, staged)]
        self._pending = self._comm.submit(self._gather, fetches, self._spare_weights)
        return applied

    def _await_and_fetch(self, segment, update: Future, step: int) -> bool:
        applied = update.result()
        self._fetch(segment, step)
        return applied

    def _adopt_pending_weights(self) -> int:
        """Wait for the weights of the last update and point the parameters at them."""
        if self._pending is None:
            return 0
        applied = self._pending.result()
        self._pending = None
        self.flat_weights, self._spare_weights = self._spare_weights, self.flat_weights
        for param, weight in zip(self.model.parameters(), parameter_views(self.layout, self.flat_weights)):
            param.data = weight
        return applied

    def _on_gradient(self, index: int):
        def hook(_param: torch.Tensor) -> None:
            if self.config.worker.overlap:
                for bucket in self._readiness.mark(index):
                    self._enqueue(bucket)
        return hook

    def _enqueue(self, bucket: int) -> None:
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self._events[bucket] = event
        self._ready.put(bucket)

    def _delayed(self, step: int) -> bool:
        """Whether data step ``step`` uses the delayed update (past the warm-up)."""
        worker = self.config.worker
        return worker.delayed_update and step > worker.delayed_update_after_steps

    def _reduce_and_ship(self, step: int, lr: float, defer: bool, delayed: bool) -> tuple[float, list[Future]]:
        """On the collectives thread: reduce each bucket as it completes and hand its
        segments to the transfer pool. Returns the shard's sum of squares and the transfers."""
        sum_squares = 0.0
        transfers: dict[int, Future] = {}
        for _ in self.layout.buckets:
            bucket = self.layout.buckets[self._ready.get()]
            if bucket.index in self._events:
                self._events[bucket.index].synchronize()
            offset = self.layout.piece_offset(bucket.index)
            piece = self._grad_shard[offset : offset + bucket.piece_size]
            grads = self.flat_grad[bucket.start : bucket.stop]
            dist.reduce_scatter_single(piece, grads.to(self.wire_dtype), op=dist.ReduceOp.SUM)
            piece.div_(self.world_size)
            sum_squares += sum_of_squares(piece)
            host = self._to_host(piece, offset)
            for segment in self.segments:
                if segment.bucket == bucket.index:
                    transfers[segment.segment_id] = self._pool.submit(
                        self._push, segment, step, host, offset, lr, defer, delayed
                    )
        return sum_squares, [transfers[s.segment_id] for s in self.segments]

    def _push(self, segment, step: int, host_piece: torch.Tensor, piece_offset: int, lr: float,
              defer: bool, delayed: bool) -> bool:
        start = segment.shard_offset - piece_offset
        gradient = host_piece[start : start + segment.numel]
        client = self.clients[segment.server]
        shm = self._shm_ref(segment, self._grad_shard)
        outcome = client.push(self.run_id, segment.segment_id, step, gradient, lr=lr, defer_update=defer,
                              shm=shm)
        self.metrics.record_sent("PushGradient.shm" if shm else "PushGradient",
                                 gradient.numel() * gradient.element_size())
        if defer:
            return False
        if not delayed:  # the delayed update fetches after the step, during the next one
            self._fetch(segment, step)
        return outcome.applied

    def _commit_and_fetch(self, segment, step: int, global_norm: float, lr: float, fetch: bool) -> bool:
        outcome = self.clients[segment.server].commit(
            self.run_id, segment.segment_id, step, global_norm=global_norm, lr=lr
        )
        if fetch:
            self._fetch(segment, step)
        return outcome.applied

    def _fetch(self, segment, step: int) -> None:
        shm = self._shm_ref(segment, self._weight_shard)
        target = self._weight_shard[self._local(segment)]
        on_cpu = target.device.type == "cpu"
        weights = self.clients[segment.server].fetch(
            self.run_id, segment.segment_id, step, self.config.worker.compute_dtype, segment.numel, shm=shm,
            out=target if on_cpu and shm is None else None,  # chunks land in the shard directly
        )
        nbytes = segment.numel * self.compute_dtype.itemsize
        self.metrics.record_received("FetchWeights.shm" if shm else "FetchWeights", nbytes)
        if weights is not None and not on_cpu:
            target.copy_(weights, non_blocking=True)

    def _shm_ref(self, segment, shard: torch.Tensor) -> tuple[str, int] | None:
        """Where ``segment``'s slice of a shared-memory shard buffer lies, for a co-located server."""
        if segment.server not in self._shm_servers:
            return None
        base = shard.data_ptr() - self._shm.bytes.data_ptr()
        return str(self._shm.path), base + segment.shard_offset * shard.element_size()

    def _colocated_servers(self, server_node_ids: list[str] | None) -> set[int]:
        if (self.config.worker.shared_memory == "off" or not server_node_ids
                or self.device.type != "cpu" or not SHM_ROOT.is_dir()):
            return set()
        import ray

        here = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        return {index for index, node in enumerate(server_node_ids) if node == here}

    def _local(self, segment) -> slice:
        return slice(segment.shard_offset, segment.shard_offset + segment.numel)

    # --- memory helpers --------------------------------------------------------------
    def _host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Pinned on a GPU node so device-to-host copies run at full PCIe speed."""
        if self.device.type == "cuda":
            return torch.empty(numel, dtype=dtype, pin_memory=True)
        return torch.empty(0, dtype=dtype)

    def _to_host(self, piece: torch.Tensor, offset: int) -> torch.Tensor:
        if self.device.type != "cuda":
            return piece
        host = self._host_grad_shard[offset : offset + piece.numel()]
        host.copy_(piece, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        return host

    def resident_bytes(self) -> dict[str, int]:
        """Bytes of the buffers this worker holds for training, by kind."""
        def size(t: torch.Tensor) -> int:
            return t.numel() * t.element_size()

        return {
            "weights": size(self.flat_weights) + (size(self._spare_weights) if self._spare_weights is not None else 0),
            "gradients": size(self.flat_grad),
            "grad_shard": size(self._grad_shard) + size(self._weight_shard) + size(self._host_grad_shard),
        }

    def _report_resident_bytes(self) -> None:
        for kind, nbytes in self.resident_bytes().items():
            self.metrics.set_resident_bytes(kind, nbytes)

