"""The gRPC server of a state server: binds its address, puts the token check, the call
limits and the health service in front of the handlers (services/server/servicer.py),
and serves the bulk socket beside it."""

from __future__ import annotations

import logging
from concurrent import futures

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cargohold.services.core.errors import CargoholdError
from cargohold.services.metrics.server import StateServerMetrics
from cargohold.services.segments.segment_registry import SegmentRegistry
from cargohold.services.server.bulk_server import BulkServer
from cargohold.services.server.servicer import StateServerServicer
from cargohold.services.transport.auth import TlsFiles, TokenAuthInterceptor
from cargohold.services.transport.codec import MAX_MESSAGE_BYTES, SERVICE_NAME
from cargohold.services.transport.health import CheckOnlyHealth
from cargohold.services.transport.limits import (
    QUICK_THREADS,
    CallLimiter,
    CallLimits,
    OnPoolServicer,
)
from cargohold.services.transport.shm import RegionCache
from cargohold.v1 import state_server_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)


class GrpcStateServer:
    """A gRPC server on ``host:port`` serving the StateServer and health services."""

    def __init__(
        self,
        registry: SegmentRegistry,
        metrics: StateServerMetrics,
        *,
        run_id: str,
        host: str,
        port: int = 0,
        max_workers: int = 8,
        auth_token: str | None = None,
        tls: TlsFiles | None = None,
        limits: CallLimits | None = None,
        bulk: bool = False,
    ) -> None:
        """``run_id``: the one run it serves (its token is that run's); ``auth_token``:
        calls must carry it (health checks excepted); ``tls``: serve mutual TLS only.
        ``max_workers`` threads run the state-server calls, as many as ``limits`` (the
        defaults when None) admits at once; health checks and refusals run on threads of
        their own, so that a probe is answered while all are busy. ``bulk``: serve the
        bulk socket too (on ``host``, a port of its own; OpenBulk names it), under the
        same token, TLS and limits."""
        limits = limits or CallLimits()
        self.servicer = StateServerServicer(registry, metrics, run_id, regions=RegionCache(limits.mapping))
        self._quick = futures.ThreadPoolExecutor(max_workers=QUICK_THREADS, thread_name_prefix="state-server-quick")
        self._limiter = CallLimiter(
            limits, SERVICE_NAME, quick=self._quick, on_limit=lambda rpc, code: metrics.record_error(rpc, code.name)
        )
        # Token first: a call without it is refused before it is counted.
        interceptors: list[grpc.ServerInterceptor] = [self._limiter]
        if auth_token is not None:
            interceptors.insert(0, TokenAuthInterceptor(auth_token, self._quick))
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="state-server-rpc"),
            interceptors=interceptors,
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                *limits.server_options(),
            ],
        )
        pb_grpc.add_StateServerServicer_to_server(self.servicer, self._server)
        self._health = CheckOnlyHealth()
        health_pb2_grpc.add_HealthServicer_to_server(OnPoolServicer(self._health, self._quick), self._server)
        target = f"{host}:{port}"
        bound = (
            self._server.add_secure_port(target, tls.server_credentials())
            if tls is not None
            else self._server.add_insecure_port(target)
        )
        if bound == 0:
            raise CargoholdError(f"state server could not bind {host}:{port}")
        self.address = f"{host}:{bound}"
        if bulk:
            self.servicer.bulk = BulkServer(
                host,
                metrics=metrics,
                count=self.servicer.count_bulk,
                token=auth_token,
                tls=tls.server_context() if tls is not None else None,
                timeout_s=limits.message_timeout_s,
                hello_timeout_s=limits.hello_timeout_s,
                max_tickets=limits.max_calls,
                max_connections=limits.max_calls,
                max_unauthenticated=limits.max_calls,
                max_transfers=max_workers,
            )

    @property
    def calls_in_flight(self) -> int:
        """State-server calls admitted and not yet finished (health checks aside), bulk
        socket transfers included."""
        bulk = self.servicer.bulk
        return self._limiter.in_flight + (bulk.transfers_in_flight if bulk is not None else 0)

    def start(self) -> None:
        self._limiter.start()
        self._server.start()
        if self.servicer.bulk is not None:
            self.servicer.bulk.start()
        for service in ("", SERVICE_NAME):
            self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        logger.info("state server listening on %s", self.address)

    def stop(self, grace: float = 1.0) -> None:
        self._health.enter_graceful_shutdown()
        self._server.stop(grace).wait()
        if self.servicer.bulk is not None:
            self.servicer.bulk.stop()
        self._limiter.stop()
        self._quick.shutdown()
        self.servicer.close()
