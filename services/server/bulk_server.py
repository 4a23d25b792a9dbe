"""A state server's bulk socket (wire format: services/transport/bulk.py): a listener on
the gRPC server's host, the tickets OpenBulk grants, and a thread per connection that
moves one tensor and hands it to the segment exactly as the gRPC handlers do.

What a caller can hold here, as for gRPC calls (docs/operations.md):

- ``max_tickets`` tickets granted and not yet redeemed; the next OpenBulk is refused with
  RESOURCE_EXHAUSTED. A ticket admits one connection, once, within ``timeout_s``.
- ``max_unauthenticated`` connections whose hello has not checked out yet (anyone who
  can reach the port can open them); a new one drops the oldest of them, the slowest to
  authenticate, so a flood of strangers cannot keep a worker's connection out. Each has
  ``hello_timeout_s`` for its whole TLS handshake and hello, however the bytes trickle
  in (a thread closes it then).
- ``max_connections`` authenticated connections at once; the next is answered
  RESOURCE_EXHAUSTED after its hello (the client then streams over gRPC).
- a connection that stalls mid-body for ``timeout_s`` is closed; a push whose body did
  not arrive whole and intact changes nothing.
- ``max_transfers`` transfers hold a buffer and move bytes at once (the gRPC server's
  handler threads); the others wait before their first status, holding none. A push's
  buffer is kept for the next one when its gradient is applied (:class:`BufferPool`).
"""

from __future__ import annotations

import hmac
import logging
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import torch

from cargohold.services.core.errors import CargoholdError, ServerBusyError
from cargohold.services.core.segment_spec import UpdateOutcome
from cargohold.services.core.wire import WIRE_DTYPES
from cargohold.services.metrics.server import StateServerMetrics
from cargohold.services.transport.bulk import (
    HELLO,
    OUTCOME,
    TICKET_BYTES,
    Direction,
    PeerGoneError,
    configure,
    receive_exactly,
    receive_tensor,
    send_status,
    send_tensor,
    transfer_mac,
    unpack_hello,
)
from cargohold.services.transport.codec import new_buffer, raw_bytes
from cargohold.services.transport.status import status_number, status_of

logger = logging.getLogger(__name__)

RPC_OF = {Direction.PUSH: "PushGradient.bulk", Direction.FETCH: "FetchWeights.bulk"}
"""The names transfers are counted under (metrics, errors)."""


@dataclass(frozen=True, slots=True)
class PushJob:
    numel: int
    dtype: str
    apply: Callable[[torch.Tensor], UpdateOutcome]
    """Stage or apply the gradient received whole and intact (handed over until it
    returns: a stage keeps its own copy, in RAM or beside the partition's file, so the
    receive buffer goes back to the pool either way)."""


class BufferPool:
    """Receive buffers kept from push to push: a new one's page faults cost as much as
    moving its bytes over loopback (measured: 65-90 ms per 256 MiB here, against ~100 ms
    for the transfer). At most ``limit`` wait (the transfers at once, so the memory held
    never exceeds what the pushes of one busy moment use anyway); a push takes the
    smallest that fits and uses its first bytes."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._idle: list[torch.Tensor] = []

    def take(self, numel: int, dtype: str, *, what: str) -> torch.Tensor:
        """Bytes (uint8) for at least ``numel`` x ``dtype``."""
        nbytes = numel * WIRE_DTYPES[dtype].itemsize
        with self._lock:
            for index, buffer in enumerate(self._idle):  # smallest first
                if buffer.numel() >= nbytes:
                    return self._idle.pop(index)
        return new_buffer(numel, dtype, what=what).view(torch.uint8)

    def give(self, buffer: torch.Tensor) -> None:
        """Hand back what :meth:`take` returned, once nothing reads it."""
        with self._lock:
            self._idle.append(buffer)
            self._idle.sort(key=torch.Tensor.numel)
            if len(self._idle) > self._limit:
                del self._idle[0]


@dataclass(frozen=True, slots=True)
class FetchJob:
    weights: Callable[[], torch.Tensor]
    """The weights to send (the caller's only reference)."""
    recycle: Callable[[torch.Tensor], None]
    """Hand them back once sent."""


@dataclass(frozen=True, slots=True)
class Grant:
    """What one ticket admits: a transfer validated by OpenBulk."""

    direction: Direction
    run_id: str
    segment_id: int
    update: int
    nbytes: int
    chunk_bytes: int
    job: PushJob | FetchJob
    expires: float


@dataclass(eq=False, slots=True)
class _Connection:
    """One accepted connection, as the acceptor, its thread and the hello watch see it."""

    sock: socket.socket
    """What to shut to end it: the TLS socket once wrapped."""
    hello_by: float
    """When its hello must be whole (``time.monotonic()``)."""
    dropped: tuple[grpc.StatusCode, str] | None = None
    """How it is counted and why the server closed it before its hello checked out."""
    authenticated: bool = False
    thread: threading.Thread = field(init=False)


class BulkServer:
    """The listener and its connections; :meth:`grant` is OpenBulk's half."""

    def __init__(
        self,
        host: str,
        *,
        metrics: StateServerMetrics,
        count: Callable[[Direction, int], None],
        token: str | None,
        tls: ssl.SSLContext | None,
        timeout_s: float,
        hello_timeout_s: float,
        max_tickets: int,
        max_connections: int,
        max_unauthenticated: int,
        max_transfers: int,
    ) -> None:
        """``count(direction, nbytes)`` is told of every transfer completed."""
        host = host.strip("[]")
        self._listener = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.port: int = self._listener.getsockname()[1]
        self._metrics = metrics
        self._count = count
        self._token = token
        self._tls = tls
        self._timeout_s = timeout_s
        self._hello_timeout_s = hello_timeout_s
        self._max_tickets = max_tickets
        self._max_connections = max_connections
        self._max_unauthenticated = max_unauthenticated
        self._transfers = threading.BoundedSemaphore(max_transfers)
        self._pool = BufferPool(max_transfers)
        self._lock = threading.Lock()
        self._hello_due = threading.Condition(self._lock)
        """Told when a connection starts waiting for its hello, and at stop."""
        self._stopping = False
        self._tickets: dict[bytes, Grant] = {}
        self._connections: set[_Connection] = set()
        self._waiting: dict[_Connection, None] = {}
        """The connections whose hello has not checked out, oldest first."""
        self._authenticated = 0
        self._moving = 0
        """Transfers moving bytes or applying them now."""
        self._acceptor = threading.Thread(target=self._accept, name="state-server-bulk-accept", daemon=True)
        self._watch = threading.Thread(target=self._watch_hellos, name="state-server-bulk-hello", daemon=True)

    @property
    def connections(self) -> int:
        """Connections open now."""
        with self._lock:
            return len(self._connections)

    @property
    def transfers_in_flight(self) -> int:
        """Transfers moving bytes or applying them now (a lost worker's push may still be
        applied after its process died)."""
        with self._lock:
            return self._moving

    def grant(
        self,
        direction: Direction,
        run_id: str,
        segment_id: int,
        update: int,
        nbytes: int,
        chunk_bytes: int,
        job: PushJob | FetchJob,
    ) -> bytes:
        """A one-time ticket for a validated transfer."""
        ticket = secrets.token_bytes(TICKET_BYTES)
        now = time.monotonic()
        grant = Grant(direction, run_id, segment_id, update, nbytes, chunk_bytes, job, now + self._timeout_s)
        with self._lock:
            for expired in [t for t, g in self._tickets.items() if g.expires <= now]:
                del self._tickets[expired]
            if len(self._tickets) >= self._max_tickets:
                raise ServerBusyError(
                    f"this state server already has {self._max_tickets} bulk transfers granted; try again later"
                )
            self._tickets[ticket] = grant
        return ticket

    def start(self) -> None:
        self._acceptor.start()
        self._watch.start()

    def stop(self) -> None:
        """Close the listener and every connection; their transfers fail, changing nothing."""
        _shut(self._listener)
        self._listener.close()
        if self._acceptor.is_alive():
            self._acceptor.join()
        with self._lock:
            self._stopping = True
            self._hello_due.notify()
            live = list(self._connections)
        if self._watch.is_alive():
            self._watch.join()
        for connection in live:
            _shut(connection.sock)
        for connection in live:
            connection.thread.join(self._timeout_s)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # the listener was closed: stop
                return
            connection = _Connection(conn, time.monotonic() + self._hello_timeout_s)
            connection.thread = threading.Thread(
                target=self._serve, args=(connection,), name="state-server-bulk", daemon=True
            )
            with self._lock:
                if len(self._waiting) >= self._max_unauthenticated:
                    self._drop(
                        next(iter(self._waiting)),
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        "dropped for a newer connection: too many without a hello",
                    )
                self._connections.add(connection)
                self._waiting[connection] = None
                self._hello_due.notify()
            connection.thread.start()

    def _drop(self, connection: _Connection, code: grpc.StatusCode, why: str) -> None:
        """Close a connection whose hello has not checked out (holding the lock); its
        thread then counts it as ``code``."""
        connection.dropped = (code, why)
        del self._waiting[connection]
        _shut(connection.sock)

    def _watch_hellos(self) -> None:
        """Close each connection whose hello is not whole by its deadline."""
        with self._lock:
            while not self._stopping:
                now = time.monotonic()
                while self._waiting and (oldest := next(iter(self._waiting))).hello_by <= now:
                    self._drop(
                        oldest, grpc.StatusCode.DEADLINE_EXCEEDED, f"no whole hello within {self._hello_timeout_s:g} s"
                    )
                timeout = next(iter(self._waiting)).hello_by - now if self._waiting else None
                self._hello_due.wait(timeout)

    def _serve(self, connection: _Connection) -> None:
        peer = "?"
        try:
            host, port = connection.sock.getpeername()[:2]
            peer = f"{host}:{port}"
            configure(connection.sock, self._timeout_s)
            if self._tls is not None:
                sock = self._tls.wrap_socket(connection.sock, server_side=True, do_handshake_on_connect=False)
                with self._lock:
                    connection.sock = sock  # what the hello watch shuts from now on
                    if connection.dropped:  # while the socket changed hands
                        raise PeerGoneError(connection.dropped[1])
                sock.do_handshake()
            grant = self._redeem(connection, peer)
            if grant is not None:
                with self._transfers:
                    with self._lock:
                        self._moving += 1
                    try:
                        self._transfer(connection.sock, grant, peer)
                    finally:
                        with self._lock:
                            self._moving -= 1
        except (PeerGoneError, OSError) as error:  # before the hello checked out (or a status to a peer gone)
            self._count_failure(connection, peer, error)
        except Exception:  # a bug: report it, keep serving
            logger.exception("bulk connection from %s failed", peer)
            self._metrics.record_error("bulk", grpc.StatusCode.INTERNAL.name)
        finally:
            with self._lock:
                self._connections.discard(connection)
                self._waiting.pop(connection, None)
                self._authenticated -= connection.authenticated
            connection.sock.close()

    def _count_failure(self, connection: _Connection, peer: str, error: Exception) -> None:
        """Count a connection that failed before its hello checked out: closed by the
        server (``dropped``), or by its peer, a failed TLS handshake. Logged at DEBUG only:
        a stranger's flood would otherwise be a line per connection (the metrics count
        them, and a worker sees its own failure)."""
        code, why = connection.dropped or (grpc.StatusCode.UNAVAILABLE, str(error))
        logger.debug("bulk connection from %s: %s", peer, why)
        self._metrics.record_error("bulk", code.name)

    def _redeem(self, connection: _Connection, peer: str) -> Grant | None:
        """The grant of a valid hello's ticket (used up) once the connection counts as
        authenticated; None, after telling the peer why, for anything else. Nothing after
        the hello is read either way."""
        sock = connection.sock
        hello = bytearray(HELLO.size)
        receive_exactly(sock, memoryview(hello))
        with self._lock:
            if connection.dropped:  # the watch closed it as the last bytes came
                raise PeerGoneError(connection.dropped[1])
            del self._waiting[connection]
        parsed = unpack_hello(bytes(hello))
        grant = None
        if parsed is None:
            reason = "not a bulk hello of this version"
        else:
            ticket, mac = parsed
            with self._lock:
                grant = self._tickets.pop(ticket, None)
            if grant is None:
                reason = "unknown or used ticket"
            elif grant.expires <= time.monotonic():
                reason, grant = "expired ticket", None
            else:
                expected = transfer_mac(
                    self._token, ticket, grant.direction, grant.run_id, grant.segment_id, grant.update, grant.nbytes
                )
                if not hmac.compare_digest(mac, expected):
                    reason, grant = "wrong ticket MAC (missing or wrong auth token)", None
        if grant is None:
            logger.warning("bulk connection from %s refused: %s", peer, reason)
            self._metrics.record_error("bulk", grpc.StatusCode.UNAUTHENTICATED.name)
            send_status(sock, status_number(grpc.StatusCode.UNAUTHENTICATED), reason.encode())
            return None
        with self._lock:
            connection.authenticated = self._authenticated < self._max_connections
            self._authenticated += connection.authenticated
        if not connection.authenticated:
            self._metrics.record_error("bulk", grpc.StatusCode.RESOURCE_EXHAUSTED.name)
            details = f"this state server already has {self._max_connections} bulk connections; try again later"
            send_status(sock, status_number(grpc.StatusCode.RESOURCE_EXHAUSTED), details.encode())
            return None
        return grant

    def _transfer(self, sock: socket.socket, grant: Grant, peer: str) -> None:
        rpc = RPC_OF[grant.direction]
        what = f"{rpc} of segment {grant.segment_id} update {grant.update} with {peer}"
        try:
            if isinstance(grant.job, PushJob):
                self._push(sock, grant, grant.job, what)
            else:
                weights = grant.job.weights()
                try:
                    send_status(sock, 0)
                    send_tensor(sock, raw_bytes(weights), grant.chunk_bytes)
                finally:
                    grant.job.recycle(weights)
                self._count(grant.direction, grant.nbytes)
        except PeerGoneError as error:  # a push is applied only once whole and intact
            logger.warning("%s failed%s: %s", what, ", nothing applied" if rpc == RPC_OF[Direction.PUSH] else "", error)
            self._metrics.record_error(rpc, grpc.StatusCode.UNAVAILABLE.name)
        except CargoholdError as error:
            code = status_of(error)
            self._metrics.record_error(rpc, code.name)
            send_status(sock, status_number(code), str(error).encode())

    def _push(self, sock: socket.socket, grant: Grant, job: PushJob, what: str) -> None:
        buffer = self._pool.take(job.numel, job.dtype, what=what)
        try:
            gradient = buffer[: grant.nbytes].view(WIRE_DTYPES[job.dtype])
            send_status(sock, 0)
            receive_tensor(sock, raw_bytes(gradient), grant.chunk_bytes, what=what)
            outcome = job.apply(gradient)
        finally:
            self._pool.give(buffer)
        self._count(grant.direction, grant.nbytes)
        send_status(sock, 0, OUTCOME.pack(outcome.updates, outcome.applied, outcome.seconds))


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
