"""The state-server process: owns the segment registry, serves it over gRPC on the node's
own address and exports its metrics. A plain class; the launcher runs it as a Ray actor.

Its optimizer state lives in the tiers ``config.tier`` describes: all in RAM by default,
spilling to files under ``config.tier.nvme_paths`` when a RAM budget is set. A path that
cannot be created, written or read fails the constructor, naming it.
"""

from __future__ import annotations

import logging
import time

import torch

from cargohold.cluster.schema.server import WILDCARD_HOSTS, StateServerConfig
from cargohold.services.core.node import node_ip
from cargohold.services.metrics.server import StateServerMetrics
from cargohold.services.segments.segment_holder import SegmentHolder
from cargohold.services.segments.segment_registry import SegmentRegistry
from cargohold.services.segments.weight_buffers import WeightBuffers
from cargohold.services.server.grpc_server import GrpcStateServer
from cargohold.services.tiers.storage import TieredStorage
from cargohold.services.transport.auth import TlsFiles
from cargohold.services.transport.limits import CallLimits

logger = logging.getLogger(__name__)

QUIET_S = 0.2
"""How long a state server must see no call in flight before a live recovery reads its
segments' standing: a killed worker's last calls have ended, and it starts none."""


class StateServer(SegmentHolder):
    """A state server: serves its registry over gRPC; :class:`SegmentHolder`'s calls read,
    save and restore it."""

    def __init__(
        self,
        config: StateServerConfig,
        *,
        run_id: str,
        server_index: int,
        metrics_enabled: bool = True,
        metrics_port: int = 0,
        auth_token: str | None = None,
        tls: TlsFiles | None = None,
    ) -> None:
        torch.set_num_threads(config.torch_threads)
        host = config.bind_host or node_ip()
        if host in WILDCARD_HOSTS:
            logger.warning(
                "state server %d serves gRPC and metrics on every interface (%s): anyone who can "
                "reach this node can try its token",
                server_index,
                host,
            )
        self.server_index = server_index
        self.metrics = StateServerMetrics(f"state-server-{server_index}")
        # Prepared weights wait for fetches, which at most rpc_threads calls serve at once.
        super().__init__(
            SegmentRegistry(
                TieredStorage(config.tier, server_index=server_index, observer=self.metrics),
                WeightBuffers(2 * config.rpc_threads),
            ),
            f"server{server_index}",
        )
        if metrics_enabled:
            self.metrics.start(host=host, port=metrics_port)
        self._grpc = GrpcStateServer(
            self.registry,
            self.metrics,
            run_id=run_id,
            host=host,
            max_workers=config.rpc_threads,
            auth_token=auth_token,
            tls=tls,
            limits=CallLimits(max_calls=config.max_concurrent_calls, message_timeout_s=config.message_timeout_s),
            bulk=config.data_plane == "socket",
        )
        self._grpc.start()

    def address(self) -> str:
        """host:port of the gRPC API."""
        return self._grpc.address

    def node_id(self) -> str:
        """The Ray node this server runs on ("" outside Ray); workers on the same node
        use shared memory."""
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""

    def quiet(self, timeout_s: float, for_s: float = QUIET_S) -> bool:
        """Wait, up to ``timeout_s``, until no call has been in flight for ``for_s`` (health
        checks aside): after a worker is lost, the calls it had begun end before its
        segments' standing is read
        (:meth:`~cargohold.services.segments.segment_holder.SegmentHolder.standing`).
        True when quiet."""
        deadline = time.monotonic() + timeout_s
        quiet_since = None
        while time.monotonic() < deadline:
            if self._grpc.calls_in_flight:
                quiet_since = None
            elif quiet_since is None:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= for_s:
                return True
            time.sleep(0.01)
        return False

    def metrics_address(self) -> str:
        return self.metrics.address if self.metrics.serving else ""

    def stop(self) -> None:
        """Stop serving, then stop the tier I/O and delete this server's partition files."""
        self._grpc.stop()
        self.metrics.stop()
        self.registry.close()
