"""A stranger cannot stall the bulk socket (issue 27, row C): connections that never send
a hello, or trickle it, hold no slot a worker needs, and a transfer the socket refuses
streams over gRPC instead of failing the step. Everything on 127.0.0.1, with the caps
scaled down through ``max_calls`` (``tuning.state_server.max_concurrent_calls``) except in the
one test at the default cap."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import pytest
import torch
from bulk_peers import grant_for, host_of, push_request
from transport_server import (
    CHUNK_BYTES,
    DEADLINE_S,
    G1,
    G2,
    GLOBAL_NORM,
    LR,
    RUN,
    W0,
    Served,
    assert_bitwise_equal,
    local_state,
    make_spec,
    scrape,
    serving,
    total,
    wait_until,
)

from cargohold.services.transport import bulk_client
from cargohold.services.transport.bulk import Direction, send_buffers
from cargohold.services.transport.codec import raw_bytes
from cargohold.services.transport.grpc_client import StateServerClient
from cargohold.services.transport.limits import CallLimits
from cargohold.v1 import state_server_pb2 as pb

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

TOKEN = "the-run-token"
FLOOD_EXTRA = 6
"""Connections beyond the cap, as in the attack (1,030 against 1,024)."""


def _client(s: Served) -> StateServerClient:
    """A worker's client: the run's token, the bulk socket."""
    return StateServerClient(
        s.server.address, chunk_bytes=CHUNK_BYTES, timeout_s=DEADLINE_S, auth_token=TOKEN, bulk=True
    )


def _received(s: Served, rpc: str) -> float:
    return total(scrape(s.metrics.address), "cargohold_transport_received_bytes_total", rpc=rpc)


@contextmanager
def _flood(s: Served, count: int, cap: int) -> Iterator[None]:
    """``count`` connections to the bulk socket that send nothing (no token, no hello),
    open while the block runs; ``cap`` of them at least accepted before it starts."""
    port = s.server.servicer.bulk.port
    with ExitStack() as stack:
        for _ in range(count):
            stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S))
        wait_until(lambda: s.server.servicer.bulk.connections >= cap, "the flood accepted")
        yield


def _push_under_flood(max_calls: int | None) -> None:
    limits = CallLimits() if max_calls is None else CallLimits(max_calls=max_calls)
    cap = limits.max_calls
    with serving(bulk=True, max_workers=2, auth_token=TOKEN, limits=limits) as s, _client(s) as client:
        client.register(make_spec(), W0)
        with _flood(s, cap + FLOOD_EXTRA, cap):
            outcome = client.push(RUN, 0, 1, G1, global_norm=GLOBAL_NORM, lr=LR)
            assert outcome.applied
            assert s.server.servicer.bulk.connections <= cap
            assert_bitwise_equal(
                client.fetch(RUN, 0, 1, "float32", G1.numel()), local_state(make_spec(), [G1]).weights(1, "float32")
            )
        assert _received(s, "PushGradient.bulk") == G1.numel() * 4  # over the bulk socket, not around it
        errors = total(scrape(s.metrics.address), "cargohold_rpc_errors_total", rpc="bulk", code="RESOURCE_EXHAUSTED")
        assert errors >= FLOOD_EXTRA  # the oldest strangers were dropped, and counted


def test_a_flood_of_idle_connections_beyond_the_cap_does_not_fail_a_push() -> None:
    """Before: the first ``max_calls`` strangers held every slot and the push failed with
    RESOURCE_EXHAUSTED; now each new connection drops the oldest not yet authenticated."""
    _push_under_flood(8)


def test_a_flood_of_1030_idle_connections_does_not_fail_a_push_at_the_default_cap() -> None:
    """The attack as it was made: 1,030 idle connections against the default 1,024."""
    _push_under_flood(None)


def test_a_hello_trickled_a_byte_at_a_time_is_closed_at_its_deadline() -> None:
    """Before: a byte every few seconds reset the per-read timeout (``message_timeout_s``)
    and the connection stayed as long as the stranger liked."""
    hello_timeout_s = 1.0
    with serving(bulk=True, auth_token=TOKEN, limits=CallLimits(hello_timeout_s=hello_timeout_s)) as s:
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", s.server.servicer.bulk.port), timeout=DEADLINE_S) as sock:
            sock.settimeout(0.2)
            closed = False
            while not closed and time.monotonic() - started < 4 * hello_timeout_s:
                try:
                    sock.sendall(b"C")
                    closed = sock.recv(1) == b""
                except TimeoutError:
                    continue
                except (BrokenPipeError, ConnectionResetError):
                    closed = True
            seconds = time.monotonic() - started
        assert closed, "the server kept a trickling connection past its hello deadline"
        assert hello_timeout_s <= seconds < hello_timeout_s + 2.0  # not the 60 s message timeout
        wait_until(lambda: s.server.servicer.bulk.connections == 0, "the connection is gone")
        errors = total(scrape(s.metrics.address), "cargohold_rpc_errors_total", rpc="bulk", code="DEADLINE_EXCEEDED")
        assert errors == 1


def test_a_push_the_bulk_socket_refuses_streams_over_grpc() -> None:
    """With every authenticated connection taken (two transfers stalled mid-body), the
    third is refused after its hello: the client streams that push over gRPC. Before: the
    push failed with RESOURCE_EXHAUSTED, and with it the step."""
    specs = [make_spec(segment_id=i) for i in range(3)]
    with serving(bulk=True, max_workers=2, auth_token=TOKEN, limits=CallLimits(max_calls=2)) as s, _client(s) as client:
        for spec in specs:
            client.register(spec, W0)
        with ExitStack() as held:
            for segment_id in (0, 1):
                request = push_request(1)
                request.push.key.shard_id = segment_id
                grant = grant_for(client, request)
                sock = held.enter_context(
                    bulk_client.open_transfer(
                        host_of(client.address),
                        grant,
                        direction=Direction.PUSH,
                        key=pb.ShardKey(run_id=RUN, shard_id=segment_id),
                        update=1,
                        token=TOKEN,
                        tls=None,
                        timeout_s=DEADLINE_S,
                    )
                )
                send_buffers(sock, [raw_bytes(G1)[: grant.nbytes // 2]])
            outcome = client.push(RUN, 2, 1, G2, global_norm=GLOBAL_NORM, lr=LR)
            assert outcome.applied
            assert _received(s, "PushGradient") == G2.numel() * 4
            assert client.bulk  # later calls try the bulk socket again
        expected = local_state(specs[2], [G2]).weights(1, "float32")
        assert_bitwise_equal(client.fetch(RUN, 2, 1, "float32", G2.numel()), expected)


def test_a_transfer_whose_bulk_connection_is_refused_streams_over_grpc() -> None:
    """A bulk socket that refuses the connection itself (nothing listens any more)."""
    with serving(bulk=True, auth_token=TOKEN) as s, _client(s) as client:
        client.register(make_spec(), W0)
        s.server.servicer.bulk.stop()
        assert client.push(RUN, 0, 1, G1, global_norm=GLOBAL_NORM, lr=LR).applied
        fetched = client.fetch(RUN, 0, 1, "float32", G1.numel())
        assert_bitwise_equal(fetched, local_state(make_spec(), [G1]).weights(1, "float32"))
        assert isinstance(fetched, torch.Tensor)
