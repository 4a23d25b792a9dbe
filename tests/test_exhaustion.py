"""A state server stays up under calls that try to wear it out (issue 13 item 7): tiny
chunks, stalled streams, floods of calls and connections. Real gRPC and HTTP servers on
127.0.0.1, real threads; every wait is bounded and every bound is generous (seconds where
the healthy answer takes milliseconds), so a loaded machine slows the tests, never flips
them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_transport import (
    G1,
    G2,
    GLOBAL_NORM,
    LR,
    NUMEL,
    RUN,
    W0,
    Served,
    _assert_unchanged,
    _chunks,
    _fetch_raw,
    _header,
    _key,
    _observe,
    _push_raw,
    _spec,
    _status,
    serving,
)

from cargohold.services.errors import InvalidTensorError
from cargohold.services.transport.codec import MIN_CHUNK_BYTES, SERVICE_NAME, fill_chunk
from cargohold.services.transport.grpc_client import StateServerClient
from cargohold.v1 import state_server_pb2 as pb

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
Code = grpc.StatusCode
RPC_THREADS = 8
"""GrpcStateServer's default handler threads."""
STALL_S = 30.0
"""How long a stalled caller of these tests would wait at most."""
PROBE_S = 5.0
"""A probe's deadline: it is answered in milliseconds when it is answered at all."""
QUEUED_S = 2.0
"""How long a call that should wait for a thread is given to show it does."""


@pytest.fixture
def stepped() -> Iterator[Served]:
    """A server whose segment 0 is registered and at step 1."""
    with serving() as s:
        s.client.register(_spec(), W0)
        assert s.client.push(RUN, 0, 1, G1, global_norm=GLOBAL_NORM, lr=LR).applied
        yield s


# ---------------------------------------------------------------- the smallest chunk


def test_a_fetch_in_chunks_below_the_minimum_is_refused(stepped: Served) -> None:
    # Before the minimum, chunk_bytes=1 was served: 40 KiB as 40,960 messages, about
    # four minutes of server time per MiB.
    for chunk_bytes in (1, MIN_CHUNK_BYTES - 1):
        code, details = _status(lambda n=chunk_bytes: _fetch_raw(stepped, 1, chunk_bytes=n))
        assert (code, f"chunk_bytes must be between {MIN_CHUNK_BYTES}" in details) == (Code.INVALID_ARGUMENT, True)
    assert len(_fetch_raw(stepped, 1, chunk_bytes=MIN_CHUNK_BYTES)) == 4 * NUMEL // MIN_CHUNK_BYTES


def test_pushed_chunks_below_the_minimum_are_refused_but_a_short_last_one_is_not(stepped: Served) -> None:
    before = _observe(stepped)
    raw = G2.view(torch.uint8).numpy()
    tiny = [pb.PushGradientRequest() for _ in range(0, raw.size, 1024)]  # as no cargohold client sends them
    for offset, request in zip(range(0, raw.size, 1024), tiny):
        fill_chunk(request.chunk, offset, raw[offset : offset + 1024].tobytes())
    code, details = _status(lambda: _push_raw(stepped, [_header(), *tiny]))
    assert (code, "chunks must be at least 4096 bytes" in details) == (Code.INVALID_ARGUMENT, True)
    _assert_unchanged(stepped, before)
    # 4 x 10,000 bytes and a last chunk of 960: the short one ends the tensor, so it is fine
    assert _push_raw(stepped, [_header(), *_chunks(G2, 10_000)]).applied


def test_the_client_refuses_a_chunk_size_below_the_minimum() -> None:
    with pytest.raises(InvalidTensorError, match=f"between {MIN_CHUNK_BYTES} and"):
        StateServerClient("127.0.0.1:1", chunk_bytes=MIN_CHUNK_BYTES - 1)


# ---------------------------------------------------------------- stalled calls


@contextmanager
def _stalled_pushes(s: Served, count: int) -> Iterator[list[grpc.Future]]:
    """``count`` pushes that send their header and then nothing, until the block ends."""
    release = threading.Event()

    def body() -> Iterator[pb.PushGradientRequest]:
        yield _header()
        release.wait(STALL_S)

    calls = [s.stub.PushGradient.future(body(), timeout=STALL_S) for _ in range(count)]
    try:
        yield calls
    finally:
        release.set()
        for call in calls:
            with suppress(grpc.RpcError):  # the stream ends short of its bytes: refused
                call.result(timeout=STALL_S)


def _wait_until_threads_held(s: Served) -> None:
    """Until a state-server call has to wait for a thread: every handler thread is taken
    (the stalled calls may reach the server after the first probe)."""
    give_up = time.monotonic() + STALL_S / 2
    while time.monotonic() < give_up:
        try:
            s.stub.DescribeShard(pb.DescribeShardRequest(key=_key()), timeout=QUEUED_S)
        except grpc.RpcError as error:
            assert error.code() == Code.DEADLINE_EXCEEDED
            return
        time.sleep(0.1)
    raise AssertionError("the stalled calls never held every handler thread")


def test_health_is_answered_while_every_handler_thread_is_held(stepped: Served) -> None:
    # Before: health checks queued behind the stalled calls on the same pool and timed
    # out, so a liveness probe would have killed a server that was merely busy.
    with _stalled_pushes(stepped, RPC_THREADS):
        _wait_until_threads_held(stepped)
        health = health_pb2_grpc.HealthStub(stepped.channel)
        for service in ("", SERVICE_NAME):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=PROBE_S)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=PROBE_S)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
