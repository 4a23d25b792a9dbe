"""The catalogue: every metric name cargohold exports, the fixed values of its labels,
and the histogram buckets. Dashboards and alerts may use no other ``cargohold_`` name."""

from __future__ import annotations

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
LIVE_RECOVERIES = "cargohold_live_recoveries_total"
STEPS_RECOMPUTED = "cargohold_steps_recomputed_total"
PREEMPTIONS = "cargohold_preemptions_total"
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
    LIVE_RECOVERIES,
    STEPS_RECOMPUTED,
    PREEMPTIONS,
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
TRANSPORT_RPCS: tuple[str, ...] = tuple(
    f"{rpc}{path}" for rpc in ("PushGradient", "FetchWeights") for path in ("", ".shm", ".bulk")
) + ("CommitStep.shm", "RegisterShard")
"""The transport counters' `rpc` label: the call, and the path its bytes took (chunks over
gRPC, the worker's shared memory, the bulk socket); a commit carries bytes only when it
writes the weights into shared memory; a registration, the segment's initial weights."""
WORKER_MEMORY_KINDS: frozenset[str] = frozenset({"weights", "exchange", "optimizer", "collectives"})
PAGE_LOCK_REASONS: tuple[str, ...] = ("no_cuda", "cuda_error", "pin_failed")
"""Why exchange buffers stayed pageable (the worker's page_lock reports one)."""

# One segment update on a state server runs from ~100 us (a small segment in RAM) to tens of
# seconds (a large segment paged in from NVMe under contention); roughly 1-2.5-5 per decade.
OPTIMIZER_BUCKETS = (
    1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
# A whole training step spans a whole round trip to the state servers: 10 ms to minutes.
WORKER_STEP_BUCKETS = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip
