"""The HTTP server behind every ``/metrics`` endpoint: a fixed pool of threads, and a
deadline on every connection.

prometheus_client's ``start_http_server`` starts a thread per connection and never
times one out, so every connection a peer opens and leaves idle holds a thread (and a
socket) for as long as the peer likes. Here ``threads`` threads serve connections; while
all are busy, new connections wait in the kernel's listen backlog (no thread, no Python
memory). A connection is closed ``timeout_s`` after it was accepted, however its bytes
trickle in or out (the accept loop looks at least every half second, ``serve_forever``'s
poll interval). And while a connection waits for a thread, the one that has been sending
its request the longest (at least ``SLOW_REQUEST_S``) is closed to free one: peers
trickling a request a byte at a time cannot keep a scrape waiting for more than about
that. The application is still prometheus_client's (``make_wsgi_app``).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app

logger = logging.getLogger(__name__)

_ACCEPT_POLL_S = 0.1
"""How often the accept loop looks for connections past their deadline, and whether the
server stops."""
SLOW_REQUEST_S = 0.5
"""A connection still sending its request after this may be closed for one waiting."""


@dataclass(eq=False, slots=True)
class _Connection:
    sock: socket.socket
    accepted: float
    """``time.monotonic()`` at accept."""
    requested: bool = False
    """Its request line and headers are in: it is being answered."""


class _Handler(WSGIRequestHandler):
    """One request per connection, with the server's timeout on every read and write."""

    server: MetricsHTTPServer

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.timeout_s)  # every read and write of the request

    def parse_request(self) -> bool:
        """Read the request's headers, then mark the connection as being answered."""
        parsed = super().parse_request()
        self.server.requested(self.connection)
        return parsed

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not logged."""


class MetricsHTTPServer(WSGIServer):
    """Serves ``registry`` at ``/metrics`` on ``host:port`` (port 0: a free one) from
    :meth:`serve_forever`, on ``threads`` threads."""

    request_queue_size = 16
    """The listen backlog: connections waiting for a thread, beyond which the kernel
    refuses them."""

    def __init__(self, host: str, port: int, registry: CollectorRegistry, *, threads: int, timeout_s: float) -> None:
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.timeout_s = timeout_s
        self._slots = threading.BoundedSemaphore(threads)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="metrics-http")
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._served: dict[socket.socket, _Connection] = {}
        """The connections on a thread, oldest first."""
        super().__init__((host.strip("[]"), port), _Handler)
        self.set_app(make_wsgi_app(registry))

    def process_request(self, request: Any, client_address: Any) -> None:
        """Hand the connection to a free thread, waiting for one (the connections after
        this one wait in the backlog meanwhile) and freeing one from the slowest request."""
        connection = _Connection(request, time.monotonic())
        while not self._slots.acquire(timeout=_ACCEPT_POLL_S):
            if self._closing.is_set():
                self.shutdown_request(request)
                return
            self.service_actions()
            self._close_slowest_request()
        with self._lock:
            self._served[request] = connection
        self._pool.submit(self._serve, request, client_address)

    def service_actions(self) -> None:
        """Close the connections past their deadline (run by the accept loop)."""
        now = time.monotonic()
        with self._lock:
            late = [c for c in self._served.values() if now - c.accepted >= self.timeout_s]
        for connection in late:
            _shut(connection.sock)

    def requested(self, request: socket.socket) -> None:
        """The request on ``request`` is whole: it is being answered."""
        with self._lock:
            connection = self._served.get(request)
            if connection is not None:
                connection.requested = True

    def _close_slowest_request(self) -> None:
        now = time.monotonic()
        with self._lock:
            slow = [c for c in self._served.values() if not c.requested and now - c.accepted >= SLOW_REQUEST_S]
        if slow:
            _shut(slow[0].sock)

    def _serve(self, request: socket.socket, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except OSError as error:  # a peer too slow (the timeout) or gone: not our failure
            logger.debug("metrics connection from %s ended: %s", client_address, error)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            with self._lock:
                del self._served[request]
            self.shutdown_request(request)
            self._slots.release()

    def close(self) -> None:
        """Stop :meth:`serve_forever` (from another thread), end the connections being
        served (a peer in the middle of a request would otherwise hold the close for its
        whole timeout) and release the port."""
        self._closing.set()
        self.shutdown()
        with self._lock:
            served = list(self._served.values())
        for connection in served:
            _shut(connection.sock)
        self._pool.shutdown(wait=True)
        self.server_close()


def _shut(sock: socket.socket) -> None:
    """End a connection another thread serves: its reads and writes fail at once."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # already closed
        pass
