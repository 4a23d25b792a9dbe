"""A peer of the bulk socket that dies or stalls mid-transfer (issue 11 item 2): the other
end gets a clear error within a bounded time, and no state changes. The dying peer is a
real process, SIGKILLed; every wait is bounded and generous."""

from __future__ import annotations

import signal
import time

import pytest
import torch
from bulk_peers import closed_by_peer, dialled, fetch_request, grant_for, hello, push_request, spawn, status_of
from transport_server import (
    CHUNK_BYTES,
    DEADLINE_S,
    G1,
    GLOBAL_NORM,
    LR,
    RUN,
    W0,
    Code,
    assert_unchanged,
    make_spec,
    observe,
    scrape,
    serving,
    total,
    wait_until,
)

from cargohold.services.core.errors import TransportError
from cargohold.services.transport import bulk_client
from cargohold.services.transport.bulk import Direction, PeerGoneError, receive_tensor
from cargohold.services.transport.codec import raw_bytes
from cargohold.services.transport.grpc_client import StateServerClient
from cargohold.services.transport.limits import CallLimits

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
BIG_NUMEL = 4 << 20
"""16 MiB of fp32: more than loopback's socket buffers hold, so a sender blocks mid-body."""


def test_a_client_killed_mid_push_changes_nothing_and_its_connection_goes() -> None:
    with serving(bulk=True) as s:
        s.client.register(make_spec(), W0)
        before = observe(s)
        process, line = spawn("half-push", s.server.address)
        try:
            assert line == "half"
            assert s.server.servicer.bulk.connections == 1
            process.send_signal(signal.SIGKILL)
            process.wait(DEADLINE_S)
            wait_until(lambda: s.server.servicer.bulk.connections == 0, "the server dropped the dead peer")
        finally:
            process.kill()
            process.wait(DEADLINE_S)
        assert_unchanged(s, before)
        errors = total(scrape(s.metrics.address), "cargohold_rpc_errors_total", rpc="PushGradient.bulk")
        assert errors == 1
        with StateServerClient(s.server.address, chunk_bytes=CHUNK_BYTES, timeout_s=DEADLINE_S, bulk=True) as client:
            assert client.push(RUN, 0, 1, G1, global_norm=GLOBAL_NORM, lr=LR).applied


def test_a_client_that_stalls_mid_push_is_dropped_after_the_message_timeout() -> None:
    with serving(bulk=True, limits=CallLimits(message_timeout_s=1.0)) as s:
        s.client.register(make_spec(), W0)
        before = observe(s)
        grant = grant_for(s.client, push_request(1))
        with dialled(s.server.address, grant) as sock:
            sock.sendall(hello(grant, Direction.PUSH, 1))
            assert status_of(sock)[0] == Code.OK
            sock.sendall(raw_bytes(G1)[: grant.nbytes // 2])
            seconds = wait_until(lambda: closed_by_peer(sock), "the server closed the stalled connection")
        assert seconds < 1.0 + DEADLINE_S / 2
        wait_until(lambda: s.server.servicer.bulk.connections == 0, "the connection is gone")
        assert_unchanged(s, before)


@pytest.fixture
def doomed_server():
    """A state server in a process of its own, with a 16 MiB segment at step 0, and a
    bulk client of it; the test kills the process."""
    process, address = spawn("serve", str(BIG_NUMEL))
    try:
        with StateServerClient(address, chunk_bytes=1 << 20, timeout_s=DEADLINE_S, bulk=True) as client:
            client.wait_ready(DEADLINE_S)
            yield process, client
    finally:
        process.kill()
        process.wait(DEADLINE_S)


def _opened(client: StateServerClient, request, direction: Direction, step: int):
    grant = grant_for(client, request)
    return grant, bulk_client.open_transfer(
        client.address.rpartition(":")[0],
        grant,
        direction=direction,
        key=getattr(request, request.WhichOneof("transfer")).key,
        update=step,
        token=None,
        tls=None,
        timeout_s=DEADLINE_S,
    )


def test_a_server_killed_mid_fetch_gives_the_client_a_clear_error(doomed_server) -> None:
    process, client = doomed_server
    grant, sock = _opened(client, fetch_request(0, chunk_bytes=1 << 20), Direction.FETCH, 0)
    with sock:
        time.sleep(0.2)  # the server is sending, blocked on the full socket buffers
        process.send_signal(signal.SIGKILL)
        process.wait(DEADLINE_S)
        weights = torch.empty(BIG_NUMEL)
        started = time.monotonic()
        with pytest.raises(PeerGoneError, match=r"after \d+ of 16777216 bytes"):
            receive_tensor(sock, raw_bytes(weights), grant.chunk_bytes, what="weights")
        assert time.monotonic() - started < DEADLINE_S
    with pytest.raises(TransportError):  # and the next call says the server is gone
        client.fetch(RUN, 0, 0, "float32", BIG_NUMEL)


def test_a_server_killed_mid_push_gives_the_client_a_clear_error(doomed_server) -> None:
    process, client = doomed_server
    gradient = torch.ones(BIG_NUMEL)
    grant, sock = _opened(client, push_request(1, numel=BIG_NUMEL, chunk_bytes=1 << 20), Direction.PUSH, 1)
    with sock:
        process.send_signal(signal.SIGKILL)
        process.wait(DEADLINE_S)
        started = time.monotonic()
        with pytest.raises(PeerGoneError):
            bulk_client.push(sock, raw_bytes(gradient), grant.chunk_bytes)
        assert time.monotonic() - started < DEADLINE_S
    with pytest.raises(TransportError, match="PushGradient|OpenBulk"):
        client.push(RUN, 0, 1, gradient, lr=LR)
