"""How much of a state server its callers can hold, and for how long.

gRPC Python runs every call on a thread of one pool and waits on the peer with no
timeout of its own: a caller that stops sending, or stops reading, keeps its thread
until the deadline the caller itself chose. So a state server

- runs health checks and refusals on a small pool of their own (:class:`OnPoolServicer`,
  :func:`refusal`): a probe is answered while every handler thread is busy;
- admits at most ``max_calls`` state-server calls at once and refuses the next with
  RESOURCE_EXHAUSTED before reading it (:class:`CallLimiter`), rather than queueing
  without bound;
- cancels a call whose peer has not sent its next message, or taken the server's, for
  ``message_timeout_s`` (the time the server spends computing does not count);
- pings idle connections (keepalive) and drops those whose peer no longer answers: a
  host that died without closing its connection;
- on its bulk socket (services/server/bulk_server.py), gives a connection
  ``hello_timeout_s`` for its whole hello and holds at most ``max_calls`` connections
  not yet authenticated, the oldest dropped for a new one;
- maps at most what ``mapping`` allows of the workers' shared memory
  (services/transport/shm.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import grpc

from cargohold.services.core.errors import CargoholdError, ConfigError
from cargohold.services.transport.shm import MappingLimits

logger = logging.getLogger(__name__)

QUICK_THREADS = 2
"""Threads for health checks and refusals, which take microseconds each."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CallLimits:
    max_calls: int = 1024
    """State-server calls admitted at once (health checks aside); the next is refused."""
    message_timeout_s: float = 60.0
    """Longest wait for the peer's next message, or for it to take the server's."""
    keepalive_s: float = 30.0
    """A connection quiet this long is pinged."""
    keepalive_timeout_s: float = 20.0
    """A ping not answered within this closes the connection, cancelling its calls."""
    hello_timeout_s: float = 10.0
    """A bulk socket connection whose TLS handshake and hello are not whole by then is
    closed, however the bytes trickle in."""
    mapping: MappingLimits | None = None
    """What the workers' shared memory may take; None: :meth:`MappingLimits.for_host`."""

    def __post_init__(self) -> None:
        for name in ("max_calls", "message_timeout_s", "keepalive_s", "keepalive_timeout_s", "hello_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"call limit {name} must be positive, got {getattr(self, name)!r}")

    def server_options(self) -> list[tuple[str, int]]:
        """gRPC server options for the keepalive pings."""
        return [
            ("grpc.keepalive_time_ms", round(self.keepalive_s * 1000)),
            ("grpc.keepalive_timeout_ms", round(self.keepalive_timeout_s * 1000)),
            # grpcio (1.85) holds a ping's answer to this deadline, not keepalive_timeout_ms:
            # without it a stopped peer was dropped only after its default minute.
            ("grpc.http2.ping_timeout_ms", round(self.keepalive_timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),  # idle connections are pinged too
            ("grpc.http2.max_pings_without_data", 0),  # a stalled stream sends no data
        ]


class StalledCallError(CargoholdError):
    """The peer sent (or took) no message for longer than the message timeout; the
    server cancelled the call."""


class _OnPool:
    """A handler behaviour that gRPC runs on ``pool`` rather than on the server's own
    (gRPC's ``experimental_thread_pool`` hook, which it reads off the behaviour)."""

    def __init__(self, behavior: Callable[..., Any], pool: ThreadPoolExecutor) -> None:
        self._behavior = behavior
        self.experimental_thread_pool = pool
        self.experimental_non_blocking = getattr(behavior, "experimental_non_blocking", False)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._behavior(*args, **kwargs)


class OnPoolServicer:
    """Every method of a generated-stub servicer, run on ``pool`` (for ``add_*_to_server``)."""

    def __init__(self, servicer: object, pool: ThreadPoolExecutor) -> None:
        self._servicer = servicer
        self._pool = pool

    def __getattr__(self, name: str) -> _OnPool:
        return _OnPool(getattr(self._servicer, name), self._pool)


def refusal(code: grpc.StatusCode, details: str, pool: ThreadPoolExecutor | None = None) -> grpc.RpcMethodHandler:
    """A handler that ends any call with ``code`` before reading its body, on ``pool``.

    Streaming on both sides whatever the method's shape: gRPC reads no request message
    for a streaming handler until it asks for one (for a unary one it receives and parses
    the whole message first), and a client of any shape sees only the status.
    """

    def abort(_requests: Iterator[bytes], context: grpc.ServicerContext) -> None:
        context.abort(code, details)  # raises: the call ends here

    return grpc.stream_stream_rpc_method_handler(abort if pool is None else _OnPool(abort, pool))


class _Call:
    """One admitted call, as the watchdog sees it."""

    __slots__ = ("rpc", "context", "stalled")

    def __init__(self, rpc: str, context: grpc.ServicerContext) -> None:
        self.rpc = rpc
        self.context = context
        self.stalled = False


class _Watchdog:
    """Cancels calls that have waited on their peer for longer than ``timeout_s``; one
    thread per server, waking a few times per timeout."""

    def __init__(self, timeout_s: float, on_stall: Callable[[str], None]) -> None:
        self.timeout_s = timeout_s
        self._on_stall = on_stall
        self._lock = threading.Lock()
        self._deadlines: dict[_Call, float] = {}
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="state-server-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join()

    @contextmanager
    def waiting(self, call: _Call) -> Iterator[None]:
        """The block waits on the peer: it may last ``timeout_s`` at most."""
        with self._lock:
            self._deadlines[call] = time.monotonic() + self.timeout_s
        try:
            yield
        finally:
            with self._lock:
                self._deadlines.pop(call, None)

    def requests(self, requests: Iterator[Any], call: _Call) -> Iterator[Any]:
        """``requests``, each wait for the next one watched."""
        while True:
            try:
                with self.waiting(call):
                    request = next(requests, None)
            except grpc.RpcError:  # gRPC's word for a cancelled call
                if not call.stalled:
                    raise
            if call.stalled:
                raise StalledCallError(f"{call.rpc}: no request message for {self.timeout_s:g} s; cancelled")
            if request is None:
                return
            yield request

    def responses(self, responses: Iterator[Any], call: _Call) -> Iterator[Any]:
        """``responses``, each wait for the peer to take one watched (gRPC asks for the
        next one once the last has gone out). Closes ``responses`` when it stops early."""
        try:
            for response in responses:
                with self.waiting(call):
                    yield response
        finally:
            close = getattr(responses, "close", None)
            if close is not None:
                close()

    def _run(self) -> None:
        while not self._stopped.wait(min(1.0, self.timeout_s / 4)):
            now = time.monotonic()
            with self._lock:
                expired = [call for call, deadline in self._deadlines.items() if deadline <= now]
                for call in expired:
                    del self._deadlines[call]
            for call in expired:
                call.stalled = True
                logger.warning(
                    "%s from %s: no message for %g s; cancelling it", call.rpc, call.context.peer(), self.timeout_s
                )
                self._on_stall(call.rpc)
                call.context.cancel()


class CallLimiter(grpc.ServerInterceptor):
    """Admits at most ``limits.max_calls`` calls to ``service`` at once and watches each
    one's peer (other services, such as health checks, pass untouched).

    A call counts from its admission until gRPC has finished it. Every admitted handler
    is served as streaming requests, so that gRPC reads nothing before the handler runs:
    the single message of a unary call is read here, under the watchdog, and the handler
    is always called, which is where the call's slot is handed back.
    """

    def __init__(
        self,
        limits: CallLimits,
        service: str,
        *,
        quick: ThreadPoolExecutor,
        on_limit: Callable[[str, grpc.StatusCode], None],
    ) -> None:
        """``quick`` runs the refusals; ``on_limit(rpc, code)`` is told of every call
        refused (RESOURCE_EXHAUSTED) or cancelled for a stalled peer (DEADLINE_EXCEEDED)."""
        self._max_calls = limits.max_calls
        self._prefix = f"/{service}/"
        self._quick = quick
        self._on_limit = on_limit
        self._lock = threading.Lock()
        self._in_flight = 0
        self._watchdog = _Watchdog(
            limits.message_timeout_s, lambda rpc: on_limit(rpc, grpc.StatusCode.DEADLINE_EXCEEDED)
        )

    @property
    def in_flight(self) -> int:
        """Calls admitted and not yet finished."""
        with self._lock:
            return self._in_flight

    def start(self) -> None:
        self._watchdog.start()

    def stop(self) -> None:
        self._watchdog.stop()

    def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None], details: Any
    ) -> grpc.RpcMethodHandler | None:
        method: str = details.method
        if not method.startswith(self._prefix):
            return continuation(details)
        handler = continuation(details)
        if handler is None:
            return None
        rpc = method[len(self._prefix) :]
        with self._lock:
            admitted = self._in_flight < self._max_calls
            if admitted:
                self._in_flight += 1
        if not admitted:
            self._on_limit(rpc, grpc.StatusCode.RESOURCE_EXHAUSTED)
            return refusal(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{rpc}: this state server already has {self._max_calls} calls in flight; try again later",
                self._quick,
            )
        return self._watched(handler, rpc)

    def _release(self) -> None:
        with self._lock:
            self._in_flight -= 1

    def _admit(self, rpc: str, context: grpc.ServicerContext) -> _Call:
        if not context.add_callback(self._release):  # the call has already finished
            self._release()
        return _Call(rpc, context)

    def _watched(self, handler: grpc.RpcMethodHandler, rpc: str) -> grpc.RpcMethodHandler:
        watchdog = self._watchdog
        if handler.response_streaming:
            respond = handler.stream_stream if handler.request_streaming else handler.unary_stream

            def serve_stream(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
                call = self._admit(rpc, context)
                argument = watchdog.requests(requests, call)
                if not handler.request_streaming:
                    argument = _single(argument, call, context)
                return watchdog.responses(respond(argument, context), call)

            return grpc.stream_stream_rpc_method_handler(
                serve_stream, handler.request_deserializer, handler.response_serializer
            )
        answer = handler.stream_unary if handler.request_streaming else handler.unary_unary

        def serve(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            call = self._admit(rpc, context)
            argument = watchdog.requests(requests, call)
            if not handler.request_streaming:
                argument = _single(argument, call, context)
            return answer(argument, context)

        return grpc.stream_unary_rpc_method_handler(serve, handler.request_deserializer, handler.response_serializer)


def _single(requests: Iterator[Any], call: _Call, context: grpc.ServicerContext) -> Any:
    """The one message of a unary request."""
    try:
        request = next(requests, None)
    except StalledCallError as error:
        context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(error))
    if request is None:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{call.rpc}: the request message is missing")
    return request
