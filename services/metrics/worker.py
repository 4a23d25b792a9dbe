"""A training worker's metrics."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from cargohold.services.metrics.endpoint import MetricsEndpoint, TransportBytes, check_label
from cargohold.services.metrics.names import (
    PAGE_LOCK_REASONS,
    PHASES,
    TIER_OPS,
    WORKER_LOSS,
    WORKER_LOSS_SCALE,
    WORKER_MEMORY_KINDS,
    WORKER_PAGE_LOCK_FALLBACKS,
    WORKER_PHASE_SECONDS,
    WORKER_RESIDENT_BYTES,
    WORKER_SKIPPED_STEPS,
    WORKER_STEP_BUCKETS,
    WORKER_STEP_SECONDS,
    WORKER_STEPS,
    WORKER_WEIGHT_FILE_BYTES,
    WORKER_WEIGHT_WAIT_SECONDS,
)


class WorkerMetrics(MetricsEndpoint):
    """Metrics of one training worker: step time and loss, phase breakdown, memory."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self._rank = str(rank)
        self.transport = TransportBytes(self.registry, "rank", self._rank)
        labels = ["rank"]
        self._step_seconds = Histogram(
            WORKER_STEP_SECONDS,
            "Wall time of one training step.",
            labels,
            buckets=WORKER_STEP_BUCKETS,
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
        check_label("op", op, TIER_OPS)
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
        check_label("phase", phase, PHASES)
        self._phase_seconds.labels(rank=self._rank, phase=phase).inc(seconds)

    def set_resident_bytes(self, kind: str, nbytes: int) -> None:
        """Set the bytes held for `kind`: "weights" (FSDP2's local shards), "exchange" (the
        gradient and weight buffers the state servers read and write), "optimizer" (the
        AdamW state of its device segments, `worker.optimizer_on_device_fraction`) or
        "collectives" (its shared-memory region for FSDP2's collectives, CPU workers on
        one host)."""
        check_label("kind", kind, WORKER_MEMORY_KINDS)
        self._resident.labels(rank=self._rank, kind=kind).set(nbytes)

    def record_page_lock_fallback(self, reason: str) -> None:
        """Count exchange buffers left pageable, for `reason` (PAGE_LOCK_REASONS)."""
        check_label("reason", reason, PAGE_LOCK_REASONS)
        self._page_lock_fallbacks.labels(rank=self._rank, reason=reason).inc()


# Checkpoint and recovery times: a snapshot takes milliseconds, a write or a restart of a
# large run minutes.
