"""Every Prometheus metric cargohold exports, in one file.

Each process (a state server or a training worker) owns one metrics object with its own
`CollectorRegistry` rather than prometheus_client's global default registry, so that a
test (or one process hosting several roles) can hold several without their values
mixing or their names clashing. The registry is served over HTTP on an explicit host,
127.0.0.1 unless told otherwise: a metrics port open on every interface is an easy leak.

Every series carries one identity label, `server` (state servers) or `rank` (workers),
bound at construction. The transport byte counters have the same names on both sides so
a dashboard can sum traffic over the cluster and split it by that label.

Per-step numbers belong here, not in the logs.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from cargohold.services.errors import CargoholdError, ConfigError
from cargohold.services.metrics_http import MetricsHTTPServer
from cargohold.services.page_lock import REASONS

# Metric names, as a Prometheus user queries them: counters with their `_total` suffix,
# histograms by their base name (a query adds `_bucket`, `_sum` or `_count`).
TRANSPORT_RECEIVED_BYTES = "cargohold_transport_received_bytes_total"
TRANSPORT_SENT_BYTES = "cargohold_transport_sent_bytes_total"
OPTIMIZER_STEP_SECONDS = "cargohold_optimizer_step_seconds"
OPTIMIZER_STEPS = "cargohold_optimizer_steps_total"
OPTIMIZER_DUPLICATE_PUSHES = "cargohold_optimizer_duplicate_pushes_total"
STATE_RESIDENT_BYTES = "cargohold_state_resident_bytes"
RPC_ERRORS = "cargohold_rpc_errors_total"
WORKER_STEP_SECONDS = "cargohold_worker_step_seconds"
WORKER_PHASE_SECONDS = "cargohold_worker_phase_seconds_total"
WORKER_STEPS = "cargohold_worker_steps_total"
WORKER_LOSS = "cargohold_worker_loss"
WORKER_SKIPPED_STEPS = "cargohold_worker_skipped_steps_total"
WORKER_LOSS_SCALE = "cargohold_worker_loss_scale"
WORKER_RESIDENT_BYTES = "cargohold_worker_resident_bytes"
WORKER_PAGE_LOCK_FALLBACKS = "cargohold_worker_page_lock_fallbacks_total"
WORKER_WEIGHT_FILE_BYTES = "cargohold_worker_weight_file_bytes_total"
WORKER_WEIGHT_WAIT_SECONDS = "cargohold_worker_weight_wait_seconds_total"
TIER_READ_BYTES = "cargohold_tier_read_bytes_total"
TIER_WRITE_BYTES = "cargohold_tier_write_bytes_total"
TIER_IO_SECONDS = "cargohold_tier_io_seconds_total"
TIER_QUEUE_DEPTH = "cargohold_tier_queue_depth"
TIER_PREFETCH = "cargohold_tier_prefetch_total"
TIER_IO_WAIT_SECONDS = "cargohold_tier_io_wait_seconds_total"
TIER_PLAN_PARTITIONS = "cargohold_tier_plan_partitions"
TIER_PREDICTED_IO_SECONDS = "cargohold_tier_predicted_io_seconds"
CHECKPOINT_STALL_SECONDS = "cargohold_checkpoint_stall_seconds"
CHECKPOINT_WRITE_SECONDS = "cargohold_checkpoint_write_seconds"
CHECKPOINT_BYTES = "cargohold_checkpoint_bytes_total"
CHECKPOINT_LINKED_BYTES = "cargohold_checkpoint_linked_bytes_total"
CHECKPOINTS = "cargohold_checkpoints_total"
FAILURES = "cargohold_failures_total"
RESTARTS = "cargohold_restarts_total"
RECOVERY_SECONDS = "cargohold_recovery_seconds"
EVAL_LOSS = "cargohold_eval_loss"
DATA_DOCUMENTS = "cargohold_data_documents"
EVAL_PERPLEXITY = "cargohold_eval_perplexity"
EVAL_STEP = "cargohold_eval_step"

METRIC_NAMES: tuple[str, ...] = (
    TRANSPORT_RECEIVED_BYTES,
    TRANSPORT_SENT_BYTES,
    OPTIMIZER_STEP_SECONDS,
    OPTIMIZER_STEPS,
    OPTIMIZER_DUPLICATE_PUSHES,
    STATE_RESIDENT_BYTES,
    RPC_ERRORS,
    WORKER_STEP_SECONDS,
    WORKER_PHASE_SECONDS,
    WORKER_STEPS,
    WORKER_LOSS,
    WORKER_SKIPPED_STEPS,
    WORKER_LOSS_SCALE,
    WORKER_RESIDENT_BYTES,
    WORKER_PAGE_LOCK_FALLBACKS,
    WORKER_WEIGHT_FILE_BYTES,
    WORKER_WEIGHT_WAIT_SECONDS,
    TIER_READ_BYTES,
    TIER_WRITE_BYTES,
    TIER_IO_SECONDS,
    TIER_QUEUE_DEPTH,
    TIER_PREFETCH,
    TIER_IO_WAIT_SECONDS,
    TIER_PLAN_PARTITIONS,
    TIER_PREDICTED_IO_SECONDS,
    CHECKPOINT_STALL_SECONDS,
    CHECKPOINT_WRITE_SECONDS,
    CHECKPOINT_BYTES,
    CHECKPOINT_LINKED_BYTES,
    CHECKPOINTS,
    FAILURES,
    RESTARTS,
    RECOVERY_SECONDS,
    EVAL_LOSS,
    EVAL_PERPLEXITY,
    EVAL_STEP,
    DATA_DOCUMENTS,
)
"""Every metric family cargohold exports; dashboards may use no other `cargohold_` name.

The exposition adds companion series a query may also use: `_bucket`, `_sum` and `_count`
for a histogram, and `_created` for a counter (its name without `_total`) or histogram.
"""

TIERS: frozenset[str] = frozenset({"ram", "nvme"})
TIER_OPS: frozenset[str] = frozenset({"read", "write"})
PREFETCH_RESULTS: frozenset[str] = frozenset({"hit", "miss"})
PHASES: frozenset[str] = frozenset({"compute", "reduce", "update"})
WORKER_MEMORY_KINDS: frozenset[str] = frozenset({"weights", "exchange", "optimizer", "collectives"})
PAGE_LOCK_REASONS: frozenset[str] = frozenset(REASONS)

# One segment update on a state server runs from ~100 us (a small segment in RAM) to tens of
# seconds (a large segment paged in from NVMe under contention); roughly 1-2.5-5 per decade.
_OPTIMIZER_BUCKETS = (
    1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
# A whole training step spans a whole round trip to the state servers: 10 ms to minutes.
_WORKER_STEP_BUCKETS = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip

_STOP_JOIN_TIMEOUT_S = 5.0
HTTP_THREADS = 4
"""Connections an endpoint serves at once; more wait for a thread."""
HTTP_TIMEOUT_S = 10.0
"""A scrape connection idle this long is closed (Prometheus's own scrape timeout is 10 s)."""


def _check_label(label: str, value: str, allowed: Iterable[str]) -> None:
    """Refuse a label value outside its fixed set: a typo would silently start a new series."""
    if value not in allowed:
        raise ConfigError(f"unknown metric label {label}={value!r}; allowed values: {sorted(allowed)}")


class MetricsEndpoint:
    """A private registry and the HTTP endpoint that serves it at `/metrics`."""

    def __init__(self) -> None:
        # auto_describe makes a second registration of the same name fail at once.
        self.registry = CollectorRegistry(auto_describe=True)
        self._server: MetricsHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def start(
        self, host: str = "127.0.0.1", port: int = 0, *, threads: int = HTTP_THREADS, timeout_s: float = HTTP_TIMEOUT_S
    ) -> None:
        """Serve the registry on `host:port` from a daemon thread; port 0 picks a free port.
        At most `threads` connections are served at once, each closed after `timeout_s`
        without traffic (see `metrics_http`)."""
        if self._server is not None:
            raise CargoholdError(f"metrics endpoint already serving on {self.address}")
        self._server = MetricsHTTPServer(host, port, self.registry, threads=threads, timeout_s=timeout_s)
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-http-accept", daemon=True)
        self._thread.start()

    @property
    def serving(self) -> bool:
        return self._server is not None

    @property
    def address(self) -> str:
        """The bound `host:port` (the real port when started with port 0), IPv6 in brackets."""
        if self._server is None:
            raise CargoholdError("metrics endpoint is not serving; call start() first")
        host, port = self._server.server_address[:2]
        host = host.decode() if isinstance(host, bytes) else str(host)
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def stop(self) -> None:
        """Stop serving and release the port; a no-op when not serving."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is None:
            return
        server.close()
        if thread is not None:
            thread.join(timeout=_STOP_JOIN_TIMEOUT_S)


class _TransportBytes:
    """The byte counters both sides of the transport share, under one identity label."""

    def __init__(self, registry: CollectorRegistry, identity: str, value: str) -> None:
        self._identity = {identity: value}
        self._received = Counter(
            TRANSPORT_RECEIVED_BYTES,
            "Payload bytes received over the transport, by RPC.",
            [identity, "rpc"],
            registry=registry,
        )
        self._sent = Counter(
            TRANSPORT_SENT_BYTES,
            "Payload bytes sent over the transport, by RPC.",
            [identity, "rpc"],
            registry=registry,
        )

    def received(self, rpc: str, nbytes: int) -> None:
        self._received.labels(rpc=rpc, **self._identity).inc(nbytes)

    def sent(self, rpc: str, nbytes: int) -> None:
        self._sent.labels(rpc=rpc, **self._identity).inc(nbytes)


class StateServerMetrics(MetricsEndpoint):
    """Metrics of one state server: traffic, segment updates, resident state, RPC errors."""

    def __init__(self, server_id: str) -> None:
        super().__init__()
        self._server_id = server_id
        self._transport = _TransportBytes(self.registry, "server", server_id)
        labels = ["server"]
        self._step_seconds = Histogram(
            OPTIMIZER_STEP_SECONDS,
            "Time to apply one segment update (Adam over the segment, tier I/O included).",
            labels,
            buckets=_OPTIMIZER_BUCKETS,
            registry=self.registry,
        ).labels(server=server_id)
        self._steps = Counter(
            OPTIMIZER_STEPS,
            "Segment updates applied.",
            labels,
            registry=self.registry,
        ).labels(server=server_id)
        self._duplicates = Counter(
            OPTIMIZER_DUPLICATE_PUSHES,
            "Gradient pushes ignored because the segment had already applied that update.",
            labels,
            registry=self.registry,
        ).labels(server=server_id)
        self._resident = Gauge(
            STATE_RESIDENT_BYTES,
            "Bytes of optimizer state held, by storage tier.",
            ["server", "tier"],
            registry=self.registry,
        )
        self._errors = Counter(
            RPC_ERRORS,
            "RPCs that failed, by RPC and status code.",
            ["server", "rpc", "code"],
            registry=self.registry,
        )
        self._init_tier_metrics(server_id)

    def _init_tier_metrics(self, server_id: str) -> None:
        """The NVMe tier's series; every label value is created up front so a dashboard
        sees zeros, not gaps, on a server that never touched disk."""
        labels = ["server"]
        self._tier_bytes = {
            "read": Counter(
                TIER_READ_BYTES, "Bytes the NVMe tier read from partition files.", labels, registry=self.registry
            ).labels(server=server_id),
            "write": Counter(
                TIER_WRITE_BYTES, "Bytes the NVMe tier wrote to partition files.", labels, registry=self.registry
            ).labels(server=server_id),
        }
        io_seconds = Counter(
            TIER_IO_SECONDS,
            "Seconds spent in NVMe tier transfers, by operation.",
            ["server", "op"],
            registry=self.registry,
        )
        self._tier_seconds = {op: io_seconds.labels(server=server_id, op=op) for op in TIER_OPS}
        self._tier_queue = Gauge(
            TIER_QUEUE_DEPTH, "NVMe tier transfers queued or running.", labels, registry=self.registry
        ).labels(server=server_id)
        prefetch = Counter(
            TIER_PREFETCH,
            "Disk partitions an update found already staged (hit) or had to wait to start reading (miss).",
            ["server", "result"],
            registry=self.registry,
        )
        self._prefetch = {r: prefetch.labels(server=server_id, result=r) for r in PREFETCH_RESULTS}
        self._io_wait = Counter(
            TIER_IO_WAIT_SECONDS,
            "Seconds segment updates stood still waiting for tier I/O.",
            labels,
            registry=self.registry,
        ).labels(server=server_id)
        planned = Gauge(
            TIER_PLAN_PARTITIONS,
            "Partitions the tier planner places in each tier.",
            ["server", "tier"],
            registry=self.registry,
        )
        self._planned = {t: planned.labels(server=server_id, tier=t) for t in TIERS}
        self._predicted = Gauge(
            TIER_PREDICTED_IO_SECONDS,
            "Disk seconds per step the planner predicts from measured bandwidth.",
            labels,
            registry=self.registry,
        ).labels(server=server_id)

    def record_received(self, rpc: str, nbytes: int) -> None:
        """Count `nbytes` of payload received by `rpc`."""
        self._transport.received(rpc, nbytes)

    def record_sent(self, rpc: str, nbytes: int) -> None:
        """Count `nbytes` of payload sent by `rpc`."""
        self._transport.sent(rpc, nbytes)

    def record_tier_io(self, op: str, nbytes: int, seconds: float) -> None:
        """Count one NVMe tier transfer ("read" or "write") of `nbytes` taking `seconds`."""
        _check_label("op", op, TIER_OPS)
        self._tier_bytes[op].inc(nbytes)
        self._tier_seconds[op].inc(seconds)

    def set_tier_queue_depth(self, depth: int) -> None:
        """Set the number of NVMe tier transfers queued or running."""
        self._tier_queue.set(depth)

    def record_prefetch(self, hit: bool) -> None:
        """Count one disk partition an update found staged (hit) or not (miss)."""
        self._prefetch["hit" if hit else "miss"].inc()

    def add_tier_io_wait(self, seconds: float) -> None:
        """Add time an update waited on tier I/O."""
        self._io_wait.inc(seconds)

    def set_tier_plan(self, partitions: dict[str, int], predicted_io_seconds: float) -> None:
        """Publish the planner's decision: partitions per tier and predicted disk seconds per step."""
        for tier, count in partitions.items():
            _check_label("tier", tier, TIERS)
            self._planned[tier].set(count)
        self._predicted.set(predicted_io_seconds)

    def observe_update(self, seconds: float) -> None:
        """Record one applied segment update and how long it took."""
        self._step_seconds.observe(seconds)
        self._steps.inc()

    def record_duplicate(self) -> None:
        """Count one repeated push that was ignored (a retry after a lost reply)."""
        self._duplicates.inc()

    def set_resident_bytes(self, tier: str, nbytes: int) -> None:
        """Set the bytes of state resident in `tier` ("ram" or "nvme")."""
        _check_label("tier", tier, TIERS)
        self._resident.labels(server=self._server_id, tier=tier).set(nbytes)

    def record_error(self, rpc: str, code: str) -> None:
        """Count one failed `rpc`, by its status code name."""
        self._errors.labels(server=self._server_id, rpc=rpc, code=code).inc()


class WorkerMetrics(MetricsEndpoint):
    """Metrics of one training worker: step time and loss, phase breakdown, memory."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self._rank = str(rank)
        self._transport = _TransportBytes(self.registry, "rank", self._rank)
        labels = ["rank"]
        self._step_seconds = Histogram(
            WORKER_STEP_SECONDS,
            "Wall time of one training step.",
            labels,
            buckets=_WORKER_STEP_BUCKETS,
            registry=self.registry,
        ).labels(rank=self._rank)
        self._phase_seconds = Counter(
            WORKER_PHASE_SECONDS,
            "Seconds spent in each phase of the training step.",
            ["rank", "phase"],
            registry=self.registry,
        )
        self._steps = Counter(
            WORKER_STEPS,
            "Training steps completed.",
            labels,
            registry=self.registry,
        ).labels(rank=self._rank)
        self._loss = Gauge(
            WORKER_LOSS,
            "Loss of the latest completed step.",
            labels,
            registry=self.registry,
        ).labels(rank=self._rank)
        self._skipped = Counter(
            WORKER_SKIPPED_STEPS,
            "Steps whose update was skipped: a non-finite gradient norm (optim.nonfinite: skip), or with "
            "fp16 compute scaled gradients that overflowed.",
            labels,
            registry=self.registry,
        ).labels(rank=self._rank)
        self._loss_scale = Gauge(
            WORKER_LOSS_SCALE,
            "The dynamic loss scale of the latest step (fp16 compute only).",
            labels,
            registry=self.registry,
        ).labels(rank=self._rank)
        self._resident = Gauge(
            WORKER_RESIDENT_BYTES,
            "Bytes of model data the worker holds, by kind.",
            ["rank", "kind"],
            registry=self.registry,
        )
        self._weight_file_bytes = Counter(
            WORKER_WEIGHT_FILE_BYTES,
            "Bytes of the worker's weight files (worker.weights_nvme_path) read and written.",
            ["rank", "op"],
            registry=self.registry,
        )
        self._weight_wait = Counter(
            WORKER_WEIGHT_WAIT_SECONDS,
            "Seconds forward and backward waited for a block's weights to be read from its file.",
            labels,
            registry=self.registry,
        ).labels(rank=self._rank)
        self._page_lock_fallbacks = Counter(
            WORKER_PAGE_LOCK_FALLBACKS,
            "Exchange buffers a GPU worker could not page-lock and uses pageable, by reason.",
            ["rank", "reason"],
            registry=self.registry,
        )

    def record_weight_io(self, op: str, nbytes: int) -> None:
        """Count `nbytes` of the worker's weight files read or written (weights on NVMe)."""
        _check_label("op", op, TIER_OPS)
        self._weight_file_bytes.labels(rank=self._rank, op=op).inc(nbytes)

    def add_weight_wait(self, seconds: float) -> None:
        """Add time the step waited for a block's weights to be read (weights on NVMe)."""
        self._weight_wait.inc(seconds)

    def observe_step(
        self, seconds: float, loss: float, *, skipped: bool = False, loss_scale: float | None = None
    ) -> None:
        """Record one completed training step: its duration and its loss, whether its
        update was skipped, and the loss scale it computed with (fp16)."""
        self._step_seconds.observe(seconds)
        self._steps.inc()
        self._loss.set(loss)
        if skipped:
            self._skipped.inc()
        if loss_scale is not None:
            self._loss_scale.set(loss_scale)

    def add_phase(self, phase: str, seconds: float) -> None:
        """Add `seconds` to the time spent in `phase`."""
        _check_label("phase", phase, PHASES)
        self._phase_seconds.labels(rank=self._rank, phase=phase).inc(seconds)

    def set_resident_bytes(self, kind: str, nbytes: int) -> None:
        """Set the bytes held for `kind`: "weights" (FSDP2's local shards), "exchange" (the
        gradient and weight buffers the state servers read and write), "optimizer" (the
        AdamW state of its device segments, `worker.optimizer_on_device_fraction`) or
        "collectives" (its shared-memory region for FSDP2's collectives, CPU workers on
        one host)."""
        _check_label("kind", kind, WORKER_MEMORY_KINDS)
        self._resident.labels(rank=self._rank, kind=kind).set(nbytes)

    def record_sent(self, rpc: str, nbytes: int) -> None:
        """Count `nbytes` of payload sent by `rpc`."""
        self._transport.sent(rpc, nbytes)

    def record_received(self, rpc: str, nbytes: int) -> None:
        """Count `nbytes` of payload received by `rpc`."""
        self._transport.received(rpc, nbytes)

    def record_page_lock_fallback(self, reason: str) -> None:
        """Count exchange buffers left pageable, for `reason` (services/page_lock.py REASONS)."""
        _check_label("reason", reason, PAGE_LOCK_REASONS)
        self._page_lock_fallbacks.labels(rank=self._rank, reason=reason).inc()


# Checkpoint and recovery times: a snapshot takes milliseconds, a write or a restart of a
# large run minutes.
_LAUNCHER_BUCKETS = (
    0.001, 0.01, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0,
)  # fmt: skip


class LauncherMetrics(MetricsEndpoint):
    """Metrics of the driver: checkpoints, failures and recoveries of a run, and its
    validations."""

    def __init__(self) -> None:
        super().__init__()
        self._stall = Histogram(
            CHECKPOINT_STALL_SECONDS,
            "Seconds a checkpoint held training up (the snapshot).",
            buckets=_LAUNCHER_BUCKETS,
            registry=self.registry,
        )
        self._write = Histogram(
            CHECKPOINT_WRITE_SECONDS,
            "Seconds from a checkpoint's start to its manifest landing.",
            buckets=_LAUNCHER_BUCKETS,
            registry=self.registry,
        )
        self._bytes = Counter(
            CHECKPOINT_BYTES, "Bytes of checkpoint files written (or copied).", registry=self.registry
        )
        self._linked = Counter(
            CHECKPOINT_LINKED_BYTES,
            "Bytes of NVMe-tier partition files checkpoints hard-linked instead of writing.",
            registry=self.registry,
        )
        self._checkpoints = Counter(CHECKPOINTS, "Checkpoints completed.", registry=self.registry)
        self._failures = Counter(FAILURES, "Run failures (an actor died or a step failed).", registry=self.registry)
        self._restarts = Counter(RESTARTS, "Restarts from a checkpoint after a failure.", registry=self.registry)
        self._recovery = Histogram(
            RECOVERY_SECONDS,
            "Seconds from a failure to training again.",
            buckets=_LAUNCHER_BUCKETS,
            registry=self.registry,
        )

        self._eval_loss = Gauge(
            EVAL_LOSS,
            "Mean loss over the held-out set's counted tokens, at the last validation.",
            registry=self.registry,
        )
        self._eval_perplexity = Gauge(
            EVAL_PERPLEXITY,
            "Perplexity (exp of the loss) of the held-out set, at the last validation.",
            registry=self.registry,
        )
        self._eval_step = Gauge(EVAL_STEP, "The data step the last validation followed.", registry=self.registry)
        self._documents = Gauge(
            DATA_DOCUMENTS,
            "Rows of whole documents (data.packing): documents kept, sequences, padding tokens, and "
            "over-long documents truncated, dropped, split or dropped without a counted target (by what).",
            ["what"],
            registry=self.registry,
        )

    def observe_documents(self, summary: dict[str, int]) -> None:
        for what, count in summary.items():
            self._documents.labels(what=what).set(count)

    def observe_eval(self, step: int, loss: float, perplexity: float) -> None:
        self._eval_loss.set(loss)
        self._eval_perplexity.set(perplexity)
        self._eval_step.set(step)

    def observe_checkpoint(
        self, stall_seconds: float, write_seconds: float, nbytes: int, linked_bytes: int = 0
    ) -> None:
        """``nbytes`` written or copied, ``linked_bytes`` hard-linked (not moved)."""
        self._stall.observe(stall_seconds)
        self._write.observe(write_seconds)
        self._bytes.inc(nbytes)
        self._linked.inc(linked_bytes)
        self._checkpoints.inc()

    def record_failure(self) -> None:
        self._failures.inc()

    def observe_recovery(self, seconds: float) -> None:
        self._restarts.inc()
        self._recovery.observe(seconds)
