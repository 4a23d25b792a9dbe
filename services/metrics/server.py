"""The state server's metrics."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from cargohold.services.metrics.endpoint import MetricsEndpoint, TransportBytes, check_label
from cargohold.services.metrics.names import (
    OPTIMIZER_BUCKETS,
    OPTIMIZER_DUPLICATE_PUSHES,
    OPTIMIZER_STEP_SECONDS,
    OPTIMIZER_STEPS,
    PREFETCH_RESULTS,
    RPC_ERRORS,
    STATE_RESIDENT_BYTES,
    TIER_IO_SECONDS,
    TIER_IO_WAIT_SECONDS,
    TIER_OPS,
    TIER_PLAN_PARTITIONS,
    TIER_PREDICTED_IO_SECONDS,
    TIER_PREFETCH,
    TIER_QUEUE_DEPTH,
    TIER_READ_BYTES,
    TIER_WRITE_BYTES,
    TIERS,
)


class StateServerMetrics(MetricsEndpoint):
    """Metrics of one state server: traffic, segment updates, resident state, RPC errors."""

    def __init__(self, server_id: str) -> None:
        super().__init__()
        self._server_id = server_id
        self.transport = TransportBytes(self.registry, "server", server_id)
        labels = ["server"]
        self.update_seconds = Histogram(
            OPTIMIZER_STEP_SECONDS,
            "Time to apply one segment update (Adam over the segment, tier I/O included).",
            labels,
            buckets=OPTIMIZER_BUCKETS,
            registry=self.registry,
        ).labels(server=server_id)
        self.updates_applied = Counter(
            OPTIMIZER_STEPS,
            "Segment updates applied.",
            labels,
            registry=self.registry,
        ).labels(server=server_id)
        self.duplicate_pushes = Counter(
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

    def record_tier_io(self, op: str, nbytes: int, seconds: float) -> None:
        """Count one NVMe tier transfer ("read" or "write") of `nbytes` taking `seconds`."""
        check_label("op", op, TIER_OPS)
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
            check_label("tier", tier, TIERS)
            self._planned[tier].set(count)
        self._predicted.set(predicted_io_seconds)

    def set_resident_bytes(self, tier: str, nbytes: int) -> None:
        """Set the bytes of state resident in `tier` ("ram" or "nvme")."""
        check_label("tier", tier, TIERS)
        self._resident.labels(server=self._server_id, tier=tier).set(nbytes)

    def record_error(self, rpc: str, code: str) -> None:
        """Count one failed `rpc`, by its status code name."""
        self._errors.labels(server=self._server_id, rpc=rpc, code=code).inc()
