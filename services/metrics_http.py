"""The HTTP server behind every ``/metrics`` endpoint: a fixed pool of threads, and a
timeout on every connection.

prometheus_client's ``start_http_server`` starts a thread per connection and never
times one out, so every connection a peer opens and leaves idle holds a thread (and a
socket) for as long as the peer likes. Here ``threads`` threads serve connections; while
all are busy, new connections wait in the kernel's listen backlog (no thread, no Python
memory), and a connection that sends nothing, or takes nothing, for ``timeout_s`` is
closed. The application is still prometheus_client's (``make_wsgi_app``).

A peer that trickles a byte at a time can hold a thread for longer than ``timeout_s``,
but only ``threads`` of them at once.
"""

from __future__ import annotations

import logging
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app

logger = logging.getLogger(__name__)

_ACCEPT_POLL_S = 0.1
"""How often an accept loop waiting for a free thread looks whether the server stops."""


class _Handler(WSGIRequestHandler):
    """One request per connection, with the server's timeout on every read and write."""

    server: MetricsHTTPServer

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.timeout_s)  # every read and write of the request

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
        super().__init__((host.strip("[]"), port), _Handler)
        self.set_app(make_wsgi_app(registry))

    def process_request(self, request: Any, client_address: Any) -> None:
        """Hand the connection to a free thread, waiting for one (the connections after
        this one wait in the backlog meanwhile)."""
        while not self._slots.acquire(timeout=_ACCEPT_POLL_S):
            if self._closing.is_set():
                self.shutdown_request(request)
                return
        self._pool.submit(self._serve, request, client_address)

    def _serve(self, request: socket.socket, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except OSError as error:  # a peer too slow (the timeout) or gone: not our failure
            logger.debug("metrics connection from %s ended: %s", client_address, error)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            self._slots.release()

    def close(self) -> None:
        """Stop :meth:`serve_forever` (from another thread), wait for the connections
        being served (each ends within the timeout) and release the port."""
        self._closing.set()
        self.shutdown()
        self._pool.shutdown(wait=True)
        self.server_close()
