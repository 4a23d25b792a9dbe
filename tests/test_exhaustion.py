"""A state server stays up under calls that try to wear it out (issue 13 item 7): tiny
chunks, stalled streams, floods of calls and connections. Real gRPC and HTTP servers on
127.0.0.1, real threads; every wait is bounded and every bound is generous (seconds where
the healthy answer takes milliseconds), so a loaded machine slows the tests, never flips
them.
"""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_auth import _held_back
from transport_server import (
    G1,
    G2,
    GLOBAL_NORM,
    LR,
    NUMEL,
    RUN,
    W0,
    Served,
    assert_unchanged,
    chunks,
    fetch_raw,
    key,
    make_spec,
    observe,
    push_header,
    push_raw,
    scrape,
    serving,
    status,
    total,
    wait_until,
)

from cargohold.services.core.errors import InvalidTensorError
from cargohold.services.core.wire import MIN_CHUNK_BYTES
from cargohold.services.transport.codec import SERVICE_NAME, fill_chunk
from cargohold.services.transport.grpc_client import StateServerClient
from cargohold.services.transport.limits import CallLimits
from cargohold.v1 import state_server_pb2 as pb
from cargohold.v1 import state_server_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
Code = grpc.StatusCode
RPC_THREADS = 8
"""GrpcStateServer's default handler threads."""
STALL_S = 30.0
WAIT_S = STALL_S / 2  # for the server to finish a call
"""How long a stalled caller of these tests would wait at most."""
PROBE_S = 5.0
"""A probe's deadline: it is answered in milliseconds when it is answered at all."""
QUEUED_S = 2.0
"""How long a call that should wait for a thread is given to show it does."""
SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture
def stepped() -> Iterator[Served]:
    """A server whose segment 0 is registered and at step 1."""
    with serving() as s:
        s.client.register(make_spec(), W0)
        assert s.client.push(RUN, 0, 1, G1, global_norm=GLOBAL_NORM, lr=LR).applied
        yield s


# ---------------------------------------------------------------- the smallest chunk


def test_a_fetch_in_chunks_below_the_minimum_is_refused(stepped: Served) -> None:
    # Before the minimum, chunk_bytes=1 was served: 40 KiB as 40,960 messages, about
    # four minutes of server time per MiB.
    for chunk_bytes in (1, MIN_CHUNK_BYTES - 1):
        code, details = status(lambda n=chunk_bytes: fetch_raw(stepped, 1, chunk_bytes=n))
        assert (code, f"chunk_bytes must be between {MIN_CHUNK_BYTES}" in details) == (Code.INVALID_ARGUMENT, True)
    assert len(fetch_raw(stepped, 1, chunk_bytes=MIN_CHUNK_BYTES)) == 4 * NUMEL // MIN_CHUNK_BYTES


def test_pushed_chunks_below_the_minimum_are_refused_but_a_short_last_one_is_not(stepped: Served) -> None:
    before = observe(stepped)
    raw = G2.view(torch.uint8).numpy()
    tiny = [pb.PushGradientRequest() for _ in range(0, raw.size, 1024)]  # as no cargohold client sends them
    for offset, request in zip(range(0, raw.size, 1024), tiny):
        fill_chunk(request.chunk, offset, raw[offset : offset + 1024].tobytes())
    code, details = status(lambda: push_raw(stepped, [push_header(), *tiny]))
    assert (code, "chunks must be at least 4096 bytes" in details) == (Code.INVALID_ARGUMENT, True)
    assert_unchanged(stepped, before)
    # 4 x 10,000 bytes and a last chunk of 960: the short one ends the tensor, so it is fine
    assert push_raw(stepped, [push_header(), *chunks(G2, 10_000)]).applied


def test_the_client_refuses_a_chunk_size_below_the_minimum() -> None:
    with pytest.raises(InvalidTensorError, match=f"between {MIN_CHUNK_BYTES} and"):
        StateServerClient("127.0.0.1:1", chunk_bytes=MIN_CHUNK_BYTES - 1)


# ---------------------------------------------------------------- stalled calls


@contextmanager
def _stalled_pushes(s: Served, count: int) -> Iterator[list[grpc.Future]]:
    """``count`` pushes that send their header and then nothing, until the block ends."""
    release = threading.Event()

    def body() -> Iterator[pb.PushGradientRequest]:
        yield push_header()
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
            s.stub.DescribeShard(pb.DescribeShardRequest(key=key()), timeout=QUEUED_S)
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
            assert reply.status == SERVING


def _errors(s: Served, rpc: str, code: str) -> float:
    return total(scrape(s.metrics.address), "cargohold_rpc_errors_total", rpc=rpc, code=code)


def test_calls_beyond_the_cap_are_refused_at_once_and_admitted_again_after() -> None:
    # Before: the third call waited in the pool's queue, without bound, for a thread.
    with serving(limits=CallLimits(max_calls=2)) as s:
        s.client.register(make_spec(), W0)
        with _stalled_pushes(s, 2):
            wait_until(lambda: s.server.calls_in_flight == 2, "both stalled pushes admitted", WAIT_S)
            code, details = status(lambda: s.client.describe(RUN, 0))
            assert (code, "already has 2 calls in flight" in details) == (Code.RESOURCE_EXHAUSTED, True)
            assert _errors(s, "DescribeShard", "RESOURCE_EXHAUSTED") == 1
            health = health_pb2_grpc.HealthStub(s.channel)  # not counted against the cap
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=PROBE_S).status == SERVING
        wait_until(lambda: s.server.calls_in_flight == 0, "the pushes finished", WAIT_S)
        assert s.client.describe(RUN, 0) == (make_spec(), 0)
        wait_until(
            lambda: s.server.calls_in_flight == 0, "the describe finished", within_s=STALL_S / 2
        )  # a moment after its reply


QUICK_TIMEOUT = CallLimits(message_timeout_s=1.0)
"""A message timeout short enough to wait out in a test."""


def test_a_push_whose_peer_stops_sending_is_cancelled() -> None:
    # Before: it held its thread until the caller's own deadline (here 30 s).
    with serving(limits=QUICK_TIMEOUT) as s:
        s.client.register(make_spec(), W0)
        with _stalled_pushes(s, 1) as (push,):
            code, _ = status(lambda: push.result(timeout=STALL_S / 2))
            assert code == Code.CANCELLED
        wait_until(lambda: s.server.calls_in_flight == 0, "the call finished", WAIT_S)
        wait_until(lambda: _errors(s, "PushGradient", "DEADLINE_EXCEEDED") == 1, "the stall counted once", WAIT_S)
        assert _errors(s, "PushGradient", "INVALID_ARGUMENT") == 0
        assert s.client.push(RUN, 0, 1, G1, global_norm=GLOBAL_NORM, lr=LR).applied  # it serves on


def test_a_unary_call_whose_message_never_comes_is_cancelled() -> None:
    with serving(limits=QUICK_TIMEOUT) as s:
        release, held_back = threading.Event(), []
        call = s.channel.stream_stream(f"/{SERVICE_NAME}/DescribeShard")(
            _held_back(release, held_back), timeout=STALL_S
        )
        try:
            code, _ = status(lambda: next(call))
            assert code == Code.CANCELLED
        finally:
            release.set()
        wait_until(lambda: s.server.calls_in_flight == 0, "the call finished", WAIT_S)


def test_a_fetch_whose_peer_stops_reading_is_cancelled() -> None:
    # 1 MiB in 4 KiB chunks to a reader that takes one: the server's sends stop once the
    # stream's flow-control window (64 KiB without BDP probing) is full.
    numel = 1 << 18
    spec = dataclasses.replace(make_spec(), numel=numel, fragments=((0, numel),))
    with (
        serving(limits=QUICK_TIMEOUT) as s,
        grpc.insecure_channel(s.server.address, options=[("grpc.http2.bdp_probe", 0)]) as channel,
    ):
        s.client.register(spec, torch.zeros(numel))
        request = pb.FetchWeightsRequest(key=key(), step=0, dtype=pb.DTYPE_FLOAT32, chunk_bytes=MIN_CHUNK_BYTES)
        chunks = pb_grpc.StateServerStub(channel).FetchWeights(request, timeout=STALL_S)
        next(chunks)
        wait_until(lambda: s.server.calls_in_flight == 0, "the fetch cancelled", WAIT_S)
        assert status(lambda: list(chunks))[0] == Code.CANCELLED
        assert s.server.servicer.sent_bytes < 4 * numel  # the reader did hold the sends up


_FROZEN_CLIENT = """
import sys, time, grpc
from cargohold.v1 import state_server_pb2 as pb, state_server_pb2_grpc as pb_grpc
def body():
    yield pb.PushGradientRequest.FromString(bytes.fromhex(sys.argv[2]))
    print("sent", flush=True)
    time.sleep(600)
pb_grpc.StateServerStub(grpc.insecure_channel(sys.argv[1])).PushGradient(body(), timeout=600)
"""


def test_keepalive_drops_the_calls_of_a_peer_that_stopped_answering() -> None:
    """A client process stopped (SIGSTOP) mid-call: its host still acknowledges TCP, but
    nothing answers the server's pings. Before: the call stayed in flight until the
    message timeout, if any; here that is a minute, and the pings end it in seconds."""
    limits = CallLimits(message_timeout_s=2 * STALL_S, keepalive_s=1.0, keepalive_timeout_s=1.0)
    with serving(limits=limits) as s:
        s.client.register(make_spec(), W0)
        header = push_header().SerializeToString().hex()
        client = subprocess.Popen(
            [sys.executable, "-c", _FROZEN_CLIENT, s.server.address, header], stdout=subprocess.PIPE, text=True
        )
        try:
            assert client.stdout is not None and client.stdout.readline() == "sent\n"
            wait_until(lambda: s.server.calls_in_flight == 1, "the client's push admitted", WAIT_S)
            client.send_signal(signal.SIGSTOP)
            wait_until(lambda: s.server.calls_in_flight == 0, "the frozen client's call dropped", WAIT_S)
        finally:
            client.kill()
            client.wait(timeout=STALL_S)
            if client.stdout is not None:
                client.stdout.close()


# ---------------------------------------------------------------- calls without the token

_TOKEN_SERVER = """
import sys
from cargohold.services.metrics.server import StateServerMetrics
from cargohold.services.segments.segment_registry import SegmentRegistry
from cargohold.services.server.grpc_server import GrpcStateServer
server = GrpcStateServer(SegmentRegistry(), StateServerMetrics("s"), run_id="r", host="127.0.0.1", auth_token="t")
server.start()
print(server.address, flush=True)
sys.stdin.read()
server.stop(0)
"""


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmRSS:"))


@pytest.mark.slow
def test_unauthenticated_32_mib_calls_leave_the_server_memory_alone() -> None:
    """The measurement behind the operations runbook's figure (about +21 MiB; +455 MiB
    when gRPC parsed each body before the token check): 64 unary calls of 32 MiB without
    the token, against a server in a process of its own."""
    server = subprocess.Popen(
        [sys.executable, "-c", _TOKEN_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        address = server.stdout.readline().strip()
        before = _rss_mib(server.pid)
        body = bytes(32 << 20)
        with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
            call = channel.unary_unary(f"/{SERVICE_NAME}/DescribeShard")

            def refused(_: int) -> grpc.StatusCode:
                return status(lambda: call(body, timeout=STALL_S))[0]

            with ThreadPoolExecutor(8) as pool:
                assert set(pool.map(refused, range(64))) == {Code.UNAUTHENTICATED}
        grown = _rss_mib(server.pid) - before
        print(f"server RSS grew by {grown:.0f} MiB")
        assert grown < 128
    finally:
        try:
            server.communicate(timeout=STALL_S)  # its stdin closes: it stops
        except subprocess.TimeoutExpired:
            server.kill()
            server.communicate()
