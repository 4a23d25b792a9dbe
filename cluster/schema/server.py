"""``state_server.*``: the state servers and the tiers their optimizer state lives in."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from cargohold.cluster.schema.checks import non_negative, positive
from cargohold.cluster.schema.tuning import tuning
from cargohold.services.core.errors import ConfigError
from cargohold.services.core.wire import DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES, MIN_CHUNK_BYTES
from cargohold.services.tiers.partitions import MAX_PARTITION_BYTES, derived_partition_bytes, staging_bytes

WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "[::]"})
"""Addresses that serve every interface of a node."""


@dataclass(kw_only=True, slots=True)
class TierConfig:
    """Where a state server keeps its optimizer state: RAM, spilling to NVMe files when a
    RAM budget is set."""

    nvme_paths: list[str] = field(default_factory=list)
    """Directories for partition files, one per drive (no RAID needed); partitions are spread
    round-robin over them, under `<path>/<run_id>/server-<i>/`."""
    ram_budget_bytes: int | None = None
    """Hard limit on the memory a state server's optimizer state may use, staging buffers
    included; null keeps all state in RAM."""
    partition_bytes: int | None = tuning(None)
    """Optimizer state (12 bytes per parameter) per partition, the unit that moves between RAM
    and disk; null derives it from the RAM tier: 256 MiB, or the largest power of two whose
    staging buffers take at most a quarter of `ram_budget_bytes`."""
    buffer_count: int = tuning(3)
    """Staging buffers of one partition each that disk partitions stream through: 2
    double-buffers, 3 overlaps a read, an update and a write."""
    io_threads: int = tuning(4)
    """Threads issuing the NVMe tier's reads and writes."""
    direct_io: Literal["auto", "on", "off"] = tuning("auto")
    """O_DIRECT for partition files: auto uses it where the filesystem accepts it, on requires it, off never uses it."""

    def __post_init__(self) -> None:
        if self.partition_bytes is not None and self.partition_bytes < 4096:
            raise ConfigError(f"tuning.state_server.tier.partition_bytes must be >= 4096, got {self.partition_bytes}")
        if self.buffer_count < 2:
            raise ConfigError(f"tuning.state_server.tier.buffer_count must be >= 2, got {self.buffer_count}")
        positive("tuning.state_server.tier.io_threads", self.io_threads)
        if any(not p for p in self.nvme_paths):
            raise ConfigError("state_server.tier.nvme_paths must not contain an empty path")
        if len(set(self.nvme_paths)) != len(self.nvme_paths):
            raise ConfigError(f"state_server.tier.nvme_paths lists a path twice: {self.nvme_paths}")
        if self.ram_budget_bytes is None:
            return
        positive("state_server.tier.ram_budget_bytes", self.ram_budget_bytes)
        if not self.nvme_paths:
            raise ConfigError(
                "state_server.tier.ram_budget_bytes is set but state_server.tier.nvme_paths is empty; "
                "name at least one directory for the state that does not fit"
            )
        staging = self.staging_bytes()
        if self.ram_budget_bytes < staging:
            raise ConfigError(
                f"state_server.tier.ram_budget_bytes={self.ram_budget_bytes} cannot hold the "
                f"{self.buffer_count} staging buffers ({staging} bytes); raise it, or lower "
                "tuning.state_server.tier.partition_bytes or tuning.state_server.tier.buffer_count"
            )

    def partition_size(self) -> int:
        """Bytes of state per partition: ``partition_bytes``, or derived from the RAM tier's
        budget (without one, segments stay whole and the size is not used)."""
        if self.partition_bytes is not None:
            return self.partition_bytes
        if self.ram_budget_bytes is None:
            return MAX_PARTITION_BYTES
        return derived_partition_bytes(self.ram_budget_bytes, self.buffer_count)

    def staging_bytes(self) -> int:
        """Memory of the staging buffers: ``buffer_count`` partitions in their file layout,
        and as many buffers for a partition's staged gradient (fp32 at most)."""
        return staging_bytes(self.partition_size(), self.buffer_count)


@dataclass(kw_only=True, slots=True)
class StateServerConfig:
    num_servers: int = 1
    """State servers; each owns a contiguous range of the flat parameter buffer."""
    cpus: float = 1.0
    """Ray CPUs reserved per state server; the CPU AdamW update runs on this many threads
    (at least 1)."""
    bind_host: str | None = None
    """Address the gRPC and metrics servers bind; None binds the node's own IP. A wildcard
    (0.0.0.0, ::) needs `allow_wildcard_bind`."""
    allow_wildcard_bind: bool = False
    """Let `bind_host` be a wildcard address, serving on every interface of the node (a
    warning is logged): only behind a network that admits nobody else."""
    rpc_threads: int = tuning(8)
    """gRPC handler threads per state server; each may hold two segments' weights for a
    fetch, so a host budget lowers them (to 2) before it refuses a run."""
    chunk_bytes: int = tuning(DEFAULT_CHUNK_BYTES)
    """Bytes per streamed message, or per checksummed chunk on the bulk socket; between 4
    KiB and 32 MiB."""
    data_plane: Literal["socket", "grpc"] = tuning("socket")
    """How gradients and weights travel between workers and state servers on other nodes:
    `socket`, over a TCP socket each server opens beside its gRPC port (a port of its own,
    on the same host, chosen free), each transfer granted over gRPC with the same token,
    TLS and limits; `grpc`, in chunks of gRPC streams (about half as fast). Workers on a
    server's own node use shared memory either way."""
    rpc_timeout_s: float = tuning(300.0)
    """Deadline of each call from a worker."""
    max_concurrent_calls: int = tuning(1024)
    """Calls a state server admits at once (health checks aside); the next is refused at
    once with RESOURCE_EXHAUSTED, not queued. A worker has at most 16 calls in flight, so
    keep this at least 16 x the workers that call one server; at least `rpc_threads`."""
    message_timeout_s: float = tuning(60.0)
    """A call whose peer sends no message, or takes none, for this long is cancelled (the
    server's own work between messages does not count)."""
    resources: dict[str, float] = field(default_factory=dict)
    """Extra Ray custom resources each state server's bundle asks for."""
    tier: TierConfig = field(default_factory=TierConfig)

    @property
    def torch_threads(self) -> int:
        """Threads the CPU AdamW update runs on: the CPUs Ray reserves for the server."""
        return max(1, int(self.cpus))

    def __post_init__(self) -> None:
        positive("state_server.num_servers", self.num_servers)
        positive("tuning.state_server.rpc_threads", self.rpc_threads)
        non_negative("state_server.cpus", self.cpus)
        if not MIN_CHUNK_BYTES <= self.chunk_bytes <= MAX_CHUNK_BYTES:
            raise ConfigError(
                f"tuning.state_server.chunk_bytes must be between {MIN_CHUNK_BYTES} and {MAX_CHUNK_BYTES}, "
                f"got {self.chunk_bytes}"
            )
        positive("tuning.state_server.rpc_timeout_s", self.rpc_timeout_s)
        if self.max_concurrent_calls < self.rpc_threads:
            raise ConfigError(
                f"tuning.state_server.max_concurrent_calls ({self.max_concurrent_calls}) must be at least "
                f"tuning.state_server.rpc_threads ({self.rpc_threads}): threads beyond it would never run a call"
            )
        positive("tuning.state_server.message_timeout_s", self.message_timeout_s)
        if self.bind_host in WILDCARD_HOSTS and not self.allow_wildcard_bind:
            raise ConfigError(
                f"state_server.bind_host {self.bind_host!r} serves every interface of the node; "
                "bind the node's own address (null) or set state_server.allow_wildcard_bind=true"
            )
