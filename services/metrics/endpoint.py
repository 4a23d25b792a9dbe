"""A process's private Prometheus registry, served over HTTP, and the byte counters both
ends of the transport share."""

from __future__ import annotations

import threading
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter

from cargohold.services.core.errors import CargoholdError, ConfigError
from cargohold.services.metrics.http import MetricsHTTPServer
from cargohold.services.metrics.names import TRANSPORT_RECEIVED_BYTES, TRANSPORT_RPCS, TRANSPORT_SENT_BYTES

_STOP_JOIN_TIMEOUT_S = 5.0
HTTP_THREADS = 4
"""Connections an endpoint serves at once; more wait for a thread."""
HTTP_TIMEOUT_S = 10.0
"""A scrape connection idle this long is closed (Prometheus's own scrape timeout is 10 s)."""


def check_label(label: str, value: str, allowed: Iterable[str]) -> None:
    """Refuse a label value outside its fixed set: a typo would silently start a new series."""
    if value not in allowed:
        raise ConfigError(f"unknown metric label {label}={value!r}; allowed values: {sorted(allowed)}")


class MetricsEndpoint:
    """A private registry and the HTTP endpoint that serves it at `/metrics`."""

    def __init__(self) -> None:
        # auto_describe makes a second registration of the same name fail at once.
        self.registry = CollectorRegistry(auto_describe=True)
        self._server: MetricsHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def start(
        self, host: str = "127.0.0.1", port: int = 0, *, threads: int = HTTP_THREADS, timeout_s: float = HTTP_TIMEOUT_S
    ) -> None:
        """Serve the registry on `host:port` from a daemon thread; port 0 picks a free port.
        At most `threads` connections are served at once, each closed after `timeout_s`
        without traffic (see `metrics.http`)."""
        if self._server is not None:
            raise CargoholdError(f"metrics endpoint already serving on {self.address}")
        self._server = MetricsHTTPServer(host, port, self.registry, threads=threads, timeout_s=timeout_s)
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-http-accept", daemon=True)
        self._thread.start()

    @property
    def serving(self) -> bool:
        return self._server is not None

    @property
    def address(self) -> str:
        """The bound `host:port` (the real port when started with port 0), IPv6 in brackets."""
        if self._server is None:
            raise CargoholdError("metrics endpoint is not serving; call start() first")
        host, port = self._server.server_address[:2]
        host = host.decode() if isinstance(host, bytes) else str(host)
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def stop(self) -> None:
        """Stop serving and release the port; a no-op when not serving."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is None:
            return
        server.close()
        if thread is not None:
            thread.join(timeout=_STOP_JOIN_TIMEOUT_S)


class TransportBytes:
    """The byte counters both ends of the transport share, under one identity label: a
    series per transport path (`TRANSPORT_RPCS`), made up front, so a transfer is counted
    with ``transport.sent[rpc].inc(nbytes)`` and nothing else runs (an unknown path is a
    KeyError)."""

    def __init__(self, registry: CollectorRegistry, identity: str, value: str) -> None:
        received = Counter(
            TRANSPORT_RECEIVED_BYTES,
            "Payload bytes received over the transport, by RPC.",
            [identity, "rpc"],
            registry=registry,
        )
        sent = Counter(
            TRANSPORT_SENT_BYTES,
            "Payload bytes sent over the transport, by RPC.",
            [identity, "rpc"],
            registry=registry,
        )
        self.received: dict[str, Counter] = {rpc: received.labels(value, rpc) for rpc in TRANSPORT_RPCS}
        self.sent: dict[str, Counter] = {rpc: sent.labels(value, rpc) for rpc in TRANSPORT_RPCS}
