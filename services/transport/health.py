"""The state server's answer to liveness probes: the standard ``grpc.health.v1.Health``
service, ``Check`` only.

The stock servicer (grpcio-health-checking) also serves ``Watch``, a stream that holds a
thread for as long as the caller keeps it open and, while it sends, the lock every
``Check`` needs. Probes are open to callers without the run's token (the kubelet and
orchestrators hold none), so anonymous ``Watch`` streams could hold every thread the
probes run on and freeze the server's health and, behind it, its callers. ``Check`` is
what the kubelet's gRPC probe, ``grpc_health_probe`` and our own clients call; it takes a
lock for a dictionary read and never blocks on the peer. ``Watch`` answers UNIMPLEMENTED
(to a caller with the token; one without is refused first).
"""

from __future__ import annotations

import threading

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

CHECK_METHOD = "/grpc.health.v1.Health/Check"
"""The one health method served to callers without the token."""

Status = int
"""A ``HealthCheckResponse.ServingStatus`` value (protobuf enums are ints)."""


class CheckOnlyHealth(health_pb2_grpc.HealthServicer):
    """Each service's serving status, answered by ``Check``; ``Watch`` is not served."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._status: dict[str, Status] = {}
        self._shutting_down = False

    def set(self, service: str, status: Status) -> None:
        """Report ``service`` ("" for the server as a whole) as ``status``; ignored once
        shutting down, so a late SERVING cannot undo the shutdown."""
        with self._lock:
            if not self._shutting_down:
                self._status[service] = status

    def enter_graceful_shutdown(self) -> None:
        """Report every service NOT_SERVING from now on."""
        with self._lock:
            self._shutting_down = True
            for service in self._status:
                self._status[service] = health_pb2.HealthCheckResponse.NOT_SERVING

    def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        with self._lock:
            status = self._status.get(request.service)
        if status is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no such service: {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext) -> None:
        context.abort(
            grpc.StatusCode.UNIMPLEMENTED, "this state server answers Health/Check only; poll Check instead of Watch"
        )
