"""Metrics are checked through a real scrape: HTTP on 127.0.0.1, parsed as Prometheus would."""

from __future__ import annotations

import gc
import socket
import threading
import time
import urllib.request
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cargohold.services.core.errors import ConfigError
from cargohold.services.metrics.endpoint import HTTP_THREADS, MetricsEndpoint
from cargohold.services.metrics.launcher import LauncherMetrics
from cargohold.services.metrics.names import METRIC_NAMES
from cargohold.services.metrics.server import StateServerMetrics
from cargohold.services.metrics.worker import WorkerMetrics

pytestmark = pytest.mark.timeout(60)

_HTTP_TIMEOUT_S = 5.0
_IDLE_BOUND_S = 20.0
"""Generous: the server closes an idle connection after 1 s in these tests."""

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _fetch(endpoint: MetricsEndpoint, timeout_s: float = _HTTP_TIMEOUT_S) -> str:
    with urllib.request.urlopen(f"http://{endpoint.address}/metrics", timeout=timeout_s) as reply:
        assert reply.status == 200
        return reply.read().decode("utf-8")


def _samples(endpoint: MetricsEndpoint) -> Samples:
    """Every sample of a scrape, keyed by (sample name, labels)."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(_fetch(endpoint))
        for s in family.samples
    }


def _exported_names(endpoint: MetricsEndpoint) -> set[str]:
    """Family names as a user queries them (counters with `_total`), cargohold's only.

    The text format also carries a `<family>_created` gauge beside each counter and
    histogram; those companions are left out when their family is in the scrape.
    """
    families = list(text_string_to_metric_families(_fetch(endpoint)))
    timed = {f.name for f in families if f.type in ("counter", "histogram")}
    names = set()
    for family in families:
        if family.name.endswith("_created") and family.name[: -len("_created")] in timed:
            continue
        name = f"{family.name}_total" if family.type == "counter" else family.name
        if name.startswith("cargohold_"):
            names.add(name)
    return names


def _key(name: str, **labels: str) -> tuple[str, frozenset[tuple[str, str]]]:
    return name, frozenset(labels.items())


@pytest.fixture
def server() -> Iterator[StateServerMetrics]:
    metrics = StateServerMetrics("ss-0")
    metrics.start()
    yield metrics
    metrics.stop()


@pytest.fixture
def worker() -> Iterator[WorkerMetrics]:
    metrics = WorkerMetrics(3)
    metrics.start()
    yield metrics
    metrics.stop()


def test_default_bind_is_loopback_with_a_real_port(server: StateServerMetrics) -> None:
    host, port = server.address.rsplit(":", 1)
    assert host == "127.0.0.1"
    assert int(port) > 0


def test_state_server_values_round_trip(server: StateServerMetrics) -> None:
    server.transport.received["PushGradient"].inc(1000)
    server.transport.received["PushGradient"].inc(24)
    server.transport.received["FetchWeights"].inc(7)
    server.transport.sent["FetchWeights"].inc(4096)
    server.update_seconds.observe(0.0002)
    server.updates_applied.inc()
    server.update_seconds.observe(2.0)
    server.updates_applied.inc()
    server.update_seconds.observe(2.0)
    server.updates_applied.inc()
    server.duplicate_pushes.inc()
    server.set_resident_bytes("ram", 1 << 20)
    server.set_resident_bytes("nvme", 5 << 30)
    server.set_resident_bytes("ram", 3 << 20)
    server.record_error("PushGradient", "FAILED_PRECONDITION")

    got = _samples(server)
    sid = "ss-0"
    assert got[_key("cargohold_transport_received_bytes_total", server=sid, rpc="PushGradient")] == 1024
    assert got[_key("cargohold_transport_received_bytes_total", server=sid, rpc="FetchWeights")] == 7
    assert got[_key("cargohold_transport_sent_bytes_total", server=sid, rpc="FetchWeights")] == 4096
    assert got[_key("cargohold_optimizer_step_seconds_count", server=sid)] == 3
    assert got[_key("cargohold_optimizer_step_seconds_sum", server=sid)] == pytest.approx(4.0002)
    assert got[_key("cargohold_optimizer_steps_total", server=sid)] == 3
    assert got[_key("cargohold_optimizer_duplicate_pushes_total", server=sid)] == 1
    assert got[_key("cargohold_state_resident_bytes", server=sid, tier="ram")] == 3 << 20
    assert got[_key("cargohold_state_resident_bytes", server=sid, tier="nvme")] == 5 << 30
    assert got[_key("cargohold_rpc_errors_total", server=sid, rpc="PushGradient", code="FAILED_PRECONDITION")] == 1

    buckets = {
        float(dict(labels)["le"]): value
        for (name, labels), value in got.items()
        if name == "cargohold_optimizer_step_seconds_bucket"
    }
    # The buckets must resolve the 100 us .. 30 s range the histogram is meant for.
    assert min(buckets) <= 1e-4 and 30.0 in buckets
    assert buckets[1e-4] == 0
    assert buckets[2.5e-4] == 1
    assert buckets[30.0] == 3

    for (name, labels), _ in got.items():
        if name.startswith("cargohold_"):
            assert ("server", sid) in labels, name


def test_tier_values_round_trip(server: StateServerMetrics) -> None:
    got = _samples(server)
    sid = "ss-0"
    # Every tier series exists before any I/O, at zero.
    assert got[_key("cargohold_tier_prefetch_total", server=sid, result="miss")] == 0
    assert got[_key("cargohold_tier_io_seconds_total", server=sid, op="write")] == 0
    assert got[_key("cargohold_tier_plan_partitions", server=sid, tier="nvme")] == 0

    server.record_tier_io("read", 4096, 0.5)
    server.record_tier_io("read", 4096, 0.25)
    server.record_tier_io("write", 100, 1.0)
    server.set_tier_queue_depth(3)
    server.record_prefetch(True)
    server.record_prefetch(True)
    server.record_prefetch(False)
    server.add_tier_io_wait(0.125)
    server.set_tier_plan({"ram": 2, "nvme": 9}, 1.5)
    got = _samples(server)
    assert got[_key("cargohold_tier_read_bytes_total", server=sid)] == 8192
    assert got[_key("cargohold_tier_write_bytes_total", server=sid)] == 100
    assert got[_key("cargohold_tier_io_seconds_total", server=sid, op="read")] == 0.75
    assert got[_key("cargohold_tier_io_seconds_total", server=sid, op="write")] == 1.0
    assert got[_key("cargohold_tier_queue_depth", server=sid)] == 3
    assert got[_key("cargohold_tier_prefetch_total", server=sid, result="hit")] == 2
    assert got[_key("cargohold_tier_prefetch_total", server=sid, result="miss")] == 1
    assert got[_key("cargohold_tier_io_wait_seconds_total", server=sid)] == 0.125
    assert got[_key("cargohold_tier_plan_partitions", server=sid, tier="ram")] == 2
    assert got[_key("cargohold_tier_plan_partitions", server=sid, tier="nvme")] == 9
    assert got[_key("cargohold_tier_predicted_io_seconds", server=sid)] == 1.5
    with pytest.raises(ConfigError, match="'seek'"):
        server.record_tier_io("seek", 1, 1.0)


def test_worker_values_round_trip(worker: WorkerMetrics) -> None:
    worker.observe_step(1.5, loss=2.75)
    worker.observe_step(0.5, loss=2.25)
    worker.add_phase("compute", 0.75)
    worker.add_phase("compute", 0.5)
    worker.add_phase("update", 0.25)
    worker.set_resident_bytes("weights", 4000)
    worker.set_resident_bytes("exchange", 125)
    worker.transport.sent["PushGradient"].inc(800)
    worker.transport.received["FetchWeights"].inc(900)
    worker.record_weight_io("read", 4096)
    worker.record_weight_io("read", 8192)
    worker.record_weight_io("write", 4096)
    worker.add_weight_wait(0.5)

    got = _samples(worker)
    rank = "3"
    assert got[_key("cargohold_worker_step_seconds_count", rank=rank)] == 2
    assert got[_key("cargohold_worker_step_seconds_sum", rank=rank)] == pytest.approx(2.0)
    assert got[_key("cargohold_worker_steps_total", rank=rank)] == 2
    assert got[_key("cargohold_worker_loss", rank=rank)] == 2.25
    assert got[_key("cargohold_worker_phase_seconds_total", rank=rank, phase="compute")] == 1.25
    assert got[_key("cargohold_worker_phase_seconds_total", rank=rank, phase="update")] == 0.25
    assert got[_key("cargohold_worker_resident_bytes", rank=rank, kind="weights")] == 4000
    assert got[_key("cargohold_worker_resident_bytes", rank=rank, kind="exchange")] == 125
    assert got[_key("cargohold_transport_sent_bytes_total", rank=rank, rpc="PushGradient")] == 800
    assert got[_key("cargohold_transport_received_bytes_total", rank=rank, rpc="FetchWeights")] == 900
    assert got[_key("cargohold_worker_weight_file_bytes_total", rank=rank, op="read")] == 12288
    assert got[_key("cargohold_worker_weight_file_bytes_total", rank=rank, op="write")] == 4096
    assert got[_key("cargohold_worker_weight_wait_seconds_total", rank=rank)] == 0.5

    for (name, labels), _ in got.items():
        if name.startswith("cargohold_"):
            assert ("rank", rank) in labels, name
            assert "server" not in dict(labels), name


def test_two_endpoints_in_one_process_do_not_share_values() -> None:
    a, b = StateServerMetrics("a"), StateServerMetrics("b")
    a.start()
    try:
        b.start()
        try:
            a.transport.received["PushGradient"].inc(10)
            b.transport.received["PushGradient"].inc(20)
            b.update_seconds.observe(0.01)
            b.updates_applied.inc()
            got_a, got_b = _samples(a), _samples(b)
        finally:
            b.stop()
    finally:
        a.stop()

    assert a is not b and a.registry is not b.registry
    name = "cargohold_transport_received_bytes_total"
    assert got_a[_key(name, server="a", rpc="PushGradient")] == 10
    assert got_b[_key(name, server="b", rpc="PushGradient")] == 20
    assert not any(dict(labels).get("server") == "b" for _, labels in got_a)
    assert not any(dict(labels).get("server") == "a" for _, labels in got_b)
    assert got_a[_key("cargohold_optimizer_steps_total", server="a")] == 0
    assert got_b[_key("cargohold_optimizer_steps_total", server="b")] == 1


@pytest.mark.parametrize(
    ("call", "bad", "allowed"),
    [
        (lambda: StateServerMetrics("s").set_resident_bytes("disk", 1), "disk", "nvme"),
        (lambda: WorkerMetrics(0).add_phase("backward", 1.0), "backward", "compute"),
        (lambda: WorkerMetrics(0).set_resident_bytes("activations", 1), "activations", "exchange"),
    ],
)
def test_unknown_label_values_are_rejected(call: Callable[[], None], bad: str, allowed: str) -> None:
    with pytest.raises(ConfigError) as caught:
        call()
    assert isinstance(caught.value, ValueError)
    assert repr(bad) in str(caught.value)
    assert allowed in str(caught.value)


def test_rejected_label_value_exports_nothing(server: StateServerMetrics) -> None:
    with pytest.raises(ConfigError):
        server.set_resident_bytes("RAM", 1)
    assert not any(dict(labels).get("tier") == "RAM" for _, labels in _samples(server))


def test_stop_frees_the_port_and_is_idempotent() -> None:
    first = StateServerMetrics("s")
    first.stop()  # never started: nothing to do
    first.start()
    port = int(first.address.rsplit(":", 1)[1])
    gc.collect()  # what earlier tests left for the collector is not this server's
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        first.stop()
        gc.collect()
    # Closed on purpose, not left for the garbage collector (which warns when it does it).
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]
    first.stop()

    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=_HTTP_TIMEOUT_S).close()

    second = WorkerMetrics(0)
    second.start(port=port)
    try:
        assert second.address == f"127.0.0.1:{port}"
        assert "cargohold_worker_steps_total" in _fetch(second)
    finally:
        second.stop()


def test_stop_ends_a_connection_in_the_middle_of_its_request() -> None:
    """A peer that sent half a request does not hold stop() for its timeout (60 s here):
    the connections being served are ended when the endpoint stops."""
    metrics = StateServerMetrics("s")
    metrics.start(timeout_s=60.0)
    host, port = metrics.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=_HTTP_TIMEOUT_S) as peer:
        peer.sendall(b"GET /met")
        deadline = time.monotonic() + 10
        while not metrics._server._served and time.monotonic() < deadline:  # type: ignore[union-attr]
            time.sleep(0.01)  # until a thread serves it
        stopping = threading.Thread(target=metrics.stop)
        stopping.start()
        stopping.join(timeout=30)
        assert not stopping.is_alive(), "stop() waited for the half-sent request's timeout"


def test_idle_connections_are_closed_and_hold_no_more_threads_than_the_pool() -> None:
    """Before: a thread per connection (prometheus_client's server), each held for as long
    as its peer kept the connection open and sent nothing."""
    threads, idle_count = 2, 8
    before = threading.active_count()
    metrics = WorkerMetrics(0)
    metrics.start(threads=threads, timeout_s=1.0)
    host, port = metrics.address.rsplit(":", 1)
    idle = []
    try:
        for _ in range(idle_count):
            idle.append(socket.create_connection((host, int(port)), timeout=_IDLE_BOUND_S))
        # Answered once the idle connections ahead of it have timed out, a pool at a time.
        assert "cargohold_worker_steps_total" in _fetch(metrics, timeout_s=_IDLE_BOUND_S)
        assert threading.active_count() - before <= threads + 1  # and the accept loop
        for connection in idle:  # each closed by the server: end of stream, not our timeout
            assert connection.recv(1) == b""
    finally:
        for connection in idle:
            connection.close()
        metrics.stop()


@contextmanager
def _trickling(endpoint: MetricsEndpoint, count: int, every_s: float) -> Iterator[list[socket.socket]]:
    """``count`` connections that send a request a byte every ``every_s`` (never whole)
    while the block runs."""
    host, port = endpoint.address.rsplit(":", 1)
    stop = threading.Event()
    slow = [socket.create_connection((host, int(port)), timeout=_IDLE_BOUND_S) for _ in range(count)]

    def trickle(connection: socket.socket) -> None:
        request = b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + b"X" * 10_000
        for byte in request:
            if stop.wait(every_s):
                return
            try:
                connection.sendall(bytes([byte]))
            except OSError:  # the server closed it
                return

    senders = [threading.Thread(target=trickle, args=(c,), daemon=True) for c in slow]
    for sender in senders:
        sender.start()
    try:
        yield slow
    finally:
        stop.set()
        for sender in senders:
            sender.join(_IDLE_BOUND_S)
        for connection in slow:
            connection.close()


def test_a_scrape_is_served_while_slow_clients_trickle_on_every_thread() -> None:
    """Before: four connections trickling a byte every few seconds held the four threads
    (each read within the 10 s timeout) and no scrape was served while they kept on."""
    metrics = WorkerMetrics(0)
    metrics.start()  # the defaults: HTTP_THREADS threads, HTTP_TIMEOUT_S
    try:
        with _trickling(metrics, HTTP_THREADS, every_s=1.0):
            time.sleep(0.2)  # each has its thread
            started = time.monotonic()
            families = {f.name for f in text_string_to_metric_families(_fetch(metrics, timeout_s=4.0))}
            assert "cargohold_worker_steps" in families
            assert time.monotonic() - started < 4.0
    finally:
        metrics.stop()


def test_a_request_trickled_past_the_timeout_is_closed_however_often_bytes_come() -> None:
    """Before: every byte reset the per-read timeout; now the connection has ``timeout_s``
    in all."""
    timeout_s = 1.0
    metrics = WorkerMetrics(0)
    metrics.start(timeout_s=timeout_s)
    try:
        started = time.monotonic()
        with _trickling(metrics, 1, every_s=0.1) as (slow,):
            assert slow.recv(1) == b""  # closed by the server, within _IDLE_BOUND_S
            seconds = time.monotonic() - started
        assert timeout_s <= seconds < timeout_s + 2.0  # the accept loop looks every 0.5 s
    finally:
        metrics.stop()


def test_address_and_double_start_are_guarded(server: StateServerMetrics) -> None:
    with pytest.raises(Exception, match="already serving"):
        server.start()
    with pytest.raises(Exception, match="not serving"):
        _ = WorkerMetrics(1).address


def test_metric_names_lists_exactly_what_is_exported(server: StateServerMetrics, worker: WorkerMetrics) -> None:
    server.transport.received["PushGradient"].inc(1)
    server.transport.sent["FetchWeights"].inc(1)
    server.update_seconds.observe(0.001)
    server.updates_applied.inc()
    server.duplicate_pushes.inc()
    server.set_resident_bytes("ram", 1)
    server.record_error("PushGradient", "INTERNAL")
    worker.observe_step(0.1, loss=1.0)
    worker.add_phase("reduce", 0.1)
    worker.set_resident_bytes("exchange", 1)
    worker.transport.sent["PushGradient"].inc(1)
    worker.transport.received["FetchWeights"].inc(1)

    launcher = LauncherMetrics()
    launcher.start(host="127.0.0.1", port=0)
    try:
        launcher.observe_checkpoint(0.01, 0.5, 1024, 4096)
        launcher.record_failure()
        launcher.observe_recovery(3.0, 2)
        launcher_names = _exported_names(launcher)
    finally:
        launcher.stop()

    assert len(set(METRIC_NAMES)) == len(METRIC_NAMES)
    assert _exported_names(server) | _exported_names(worker) | launcher_names == set(METRIC_NAMES)
    shared = {"cargohold_transport_sent_bytes_total", "cargohold_transport_received_bytes_total"}
    assert _exported_names(server) & _exported_names(worker) == shared
