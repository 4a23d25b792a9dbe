"""The driver's metrics."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from cargohold.services.metrics.endpoint import MetricsEndpoint
from cargohold.services.metrics.names import (
    CHECKPOINT_BYTES,
    CHECKPOINT_LINKED_BYTES,
    CHECKPOINT_STALL_SECONDS,
    CHECKPOINT_WRITE_SECONDS,
    CHECKPOINTS,
    DATA_DOCUMENTS,
    EVAL_LOSS,
    EVAL_PERPLEXITY,
    EVAL_STEP,
    FAILURES,
    LIVE_RECOVERIES,
    PREEMPTIONS,
    RECOVERY_SECONDS,
    RESTARTS,
    STEPS_RECOMPUTED,
)

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
        self._restarts = Counter(
            RESTARTS, "Recoveries after a failure, live or from a checkpoint.", registry=self.registry
        )
        self._live = Counter(
            LIVE_RECOVERIES,
            "Of the recoveries, lost workers replaced from the state servers' live state (no checkpoint read).",
            registry=self.registry,
        )
        self._recomputed = Counter(
            STEPS_RECOMPUTED,
            "Completed steps computed again after a recovery (0 for a live one).",
            registry=self.registry,
        )
        self._preemptions = Counter(
            PREEMPTIONS,
            "Preemption notices acted on: the workers replaced at a step boundary, before the lost one failed.",
            registry=self.registry,
        )
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

    def record_preemption(self) -> None:
        self._preemptions.inc()

    def observe_recovery(self, seconds: float, recomputed: int, *, live: bool = False) -> None:
        """A recovery that took ``seconds`` and computes ``recomputed`` completed steps again."""
        self._restarts.inc()
        self._recomputed.inc(recomputed)
        if live:
            self._live.inc()
        self._recovery.observe(seconds)
