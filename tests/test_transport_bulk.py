"""The bulk socket (issue 11 item 2) keeps what the gRPC path guarantees: the same bits,
the same idempotence by (run, segment, update), its transfers refused before any body is
read without a valid ticket and token MAC, a flipped byte detected with nothing applied,
receive buffers of the validated size only. A real server on 127.0.0.1, the real client,
hand-made hellos and bodies for what the client would never send."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from bulk_peers import (
    body,
    closed_by_peer,
    dialled,
    fetch_request,
    grant_for,
    hello,
    push_request,
    status_of,
)
from transport_server import (
    CHUNK_BYTES,
    DEADLINE_S,
    G1,
    G2,
    GLOBAL_NORM,
    LR,
    NUMEL,
    RUN,
    W0,
    Served,
    assert_bitwise_equal,
    assert_unchanged,
    local_state,
    make_spec,
    observe,
    randn,
    scrape,
    serving,
    status,
    total,
    wait_until,
)

from cargohold.services.core.errors import TransportError
from cargohold.services.metrics.names import TRANSPORT_RECEIVED_BYTES, TRANSPORT_SENT_BYTES
from cargohold.services.segments.segment_state import SegmentState
from cargohold.services.server.bulk_server import BufferPool
from cargohold.services.transport.bulk import OUTCOME, Direction, receive_tensor, send_tensor
from cargohold.services.transport.codec import ChecksumError, raw_bytes
from cargohold.services.transport.grpc_client import StateServerClient
from cargohold.services.transport.limits import CallLimits
from cargohold.v1 import state_server_pb2 as pb

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
Code = grpc.StatusCode
NBYTES = NUMEL * 4


def bulk(s: Served, **options) -> StateServerClient:
    return StateServerClient(s.server.address, chunk_bytes=CHUNK_BYTES, timeout_s=DEADLINE_S, bulk=True, **options)


@pytest.fixture
def bulk_served():
    """A server with its bulk socket, segment 0 registered and at step 1 (pushed over it)."""
    with serving(bulk=True) as s, bulk(s) as client:
        assert client.register(make_spec(), W0) == (0, True)
        assert client.push(RUN, 0, 1, G1, global_norm=GLOBAL_NORM, lr=LR).applied
        yield s


def test_push_and_fetch_over_the_bulk_socket_equal_the_local_update_bitwise() -> None:
    with serving(bulk=True) as s, bulk(s) as client:
        client.register(make_spec(), W0)
        assert client.push(RUN, 0, 1, G1, global_norm=GLOBAL_NORM, lr=LR).applied
        staged = client.push(RUN, 0, 2, G2, defer_update=True)
        assert not staged.applied and staged.updates == 2
        assert client.commit(RUN, 0, 2, global_norm=GLOBAL_NORM, lr=LR, prepare="bfloat16").applied
        expected = local_state(make_spec(), [G1, G2])
        out = torch.full((NUMEL,), float("nan"), dtype=torch.bfloat16)
        assert client.fetch(RUN, 0, 2, "bfloat16", NUMEL, out=out) is out
        assert_bitwise_equal(out, expected.weights(2, "bfloat16"))
        assert_bitwise_equal(client.fetch(RUN, 0, 2, "float32", NUMEL), expected.weights(2, "float32"))
        assert_bitwise_equal(s.client.fetch(RUN, 0, 2, "float32", NUMEL), expected.weights(2, "float32"))


def test_a_staged_push_gives_its_receive_buffer_back_for_the_next_push() -> None:
    """Staging keeps a copy of its own (tiers/gradients.py), so a staged push's receive
    buffer serves the next push, as an applied one's does: a fresh buffer each step
    costs its page faults, about as much as moving its bytes over loopback."""
    taken: list[int] = []
    take = BufferPool.take

    def recording(pool: BufferPool, numel: int, dtype: str, *, what: str) -> torch.Tensor:
        buffer = take(pool, numel, dtype, what=what)
        taken.append(buffer.data_ptr())
        return buffer

    with serving(bulk=True) as s, bulk(s) as client:
        client.register(make_spec(), W0)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(BufferPool, "take", recording)
            for update, gradient in ((1, G1), (2, G2)):
                assert client.push(RUN, 0, update, gradient, defer_update=True).updates == update
                assert client.commit(RUN, 0, update, global_norm=GLOBAL_NORM, lr=LR).applied
        assert_bitwise_equal(
            client.fetch(RUN, 0, 2, "float32", NUMEL), local_state(make_spec(), [G1, G2]).weights(2, "float32")
        )
    assert len(taken) == 2 and taken[0] == taken[1], taken


@pytest.mark.parametrize("chunk_bytes", [4096, 12 << 10, 32 << 20])
def test_any_chunk_size_and_a_bf16_gradient_arrive_intact(chunk_bytes: int) -> None:
    """Chunks that do not divide the tensor, and one larger than it."""
    spec = make_spec(grad_dtype="bfloat16")
    gradient = randn(1, dtype=torch.bfloat16)
    with serving(bulk=True) as s, bulk(s) as client:
        client.chunk_bytes = chunk_bytes
        client.register(spec, W0)
        assert client.push(RUN, 0, 1, gradient, global_norm=GLOBAL_NORM, lr=LR).applied
        expected = local_state(spec, [gradient]).weights(1, "float32")
        assert_bitwise_equal(client.fetch(RUN, 0, 1, "float32", NUMEL), expected)


def test_concurrent_pushes_of_segments_of_several_sizes_apply_once_each() -> None:
    """Eight pushes at once over the bulk socket: two of each of four segments of other
    sizes (the receive buffers are pooled across them), one applied per segment."""
    sizes = {segment: NUMEL // (segment + 1) for segment in range(4)}
    specs = {segment: make_spec(segment, numel=n, fragments=((0, n),)) for segment, n in sizes.items()}
    gradients = {segment: randn(10 + segment, n) for segment, n in sizes.items()}
    with serving(bulk=True) as s, bulk(s) as client:
        for spec in specs.values():
            client.register(spec, randn(0, spec.numel))
        for step in (1, 2):
            jobs = [segment for segment in specs for _ in range(2)]
            with ThreadPoolExecutor(len(jobs)) as pool:
                outcomes = list(
                    pool.map(
                        lambda segment, step=step: client.push(
                            RUN, segment, step, gradients[segment], global_norm=GLOBAL_NORM, lr=LR
                        ),
                        jobs,
                    )
                )
            assert sorted(o.applied for o in outcomes) == [False] * 4 + [True] * 4
        for segment, spec in specs.items():
            expected = SegmentState(spec, randn(0, spec.numel))
            for step in (1, 2):
                expected.apply_gradient(step, gradients[segment], global_norm=GLOBAL_NORM, lr=LR)
            got = client.fetch(RUN, segment, 2, "float32", spec.numel)
            assert_bitwise_equal(got, expected.weights(2, "float32"))
        deadline = time.monotonic() + DEADLINE_S
        while s.server.servicer.bulk.connections and time.monotonic() < deadline:
            time.sleep(0.01)  # a connection's thread ends just after its last status
        assert s.server.servicer.bulk.connections == 0


def test_a_repeated_push_is_acknowledged_and_ignored_as_over_grpc(bulk_served: Served) -> None:
    s = bulk_served
    before = observe(s)
    with bulk(s) as client:
        again = client.push(RUN, 0, 1, G2, global_norm=GLOBAL_NORM, lr=LR)
        staged_again = client.push(RUN, 0, 1, G2, defer_update=True)
    over_grpc = s.client.push(RUN, 0, 1, G2, global_norm=GLOBAL_NORM, lr=LR)
    assert (again.applied, again.updates, again.seconds) == (False, 1, 0.0)
    assert (staged_again.applied, staged_again.updates) == (False, 1)
    assert (over_grpc.applied, over_grpc.updates) == (False, 1)
    assert s.client.stats().duplicate_pushes == 2  # a staged repeat is not counted, as over gRPC
    assert_unchanged(s, before)
    assert_bitwise_equal(before.weights, local_state(make_spec(), [G1]).weights(1, "float32"))


def test_stats_and_metrics_count_the_bulk_bytes(bulk_served: Served) -> None:
    s = bulk_served
    with bulk(s) as client:
        client.fetch(RUN, 0, 1, "float32", NUMEL)
    deadline = time.monotonic() + DEADLINE_S
    while (stats := s.client.stats()).sent_bytes == 0 and time.monotonic() < deadline:
        time.sleep(0.01)  # the server counts a fetch once its last byte is sent, as the client reads it
    registered_over_grpc = NBYTES
    assert stats.received_bytes == registered_over_grpc + NBYTES
    assert stats.sent_bytes == NBYTES
    samples = scrape(s.metrics.address)
    assert total(samples, TRANSPORT_RECEIVED_BYTES, rpc="PushGradient.bulk") == NBYTES
    assert total(samples, TRANSPORT_SENT_BYTES, rpc="FetchWeights.bulk") == NBYTES


@pytest.mark.parametrize(
    ("request_", "code", "words"),
    [
        (push_request(2, numel=NUMEL + 1), Code.INVALID_ARGUMENT, "gradient must be"),
        (push_request(2, dtype=pb.DTYPE_BFLOAT16), Code.INVALID_ARGUMENT, "gradient must be"),
        (push_request(2, chunk_bytes=100), Code.INVALID_ARGUMENT, "chunk_bytes"),
        (push_request(2, shm=pb.SharedMemoryRef(path="/x")), Code.INVALID_ARGUMENT, "without shared memory"),
        (pb.OpenBulkRequest(), Code.INVALID_ARGUMENT, "name a push or a fetch"),
        (fetch_request(1, dtype=7), Code.INVALID_ARGUMENT, "dtype"),
        (
            pb.OpenBulkRequest(fetch=pb.FetchWeightsRequest(key=pb.ShardKey(run_id=RUN, shard_id=9), step=1)),
            Code.NOT_FOUND,
            "no segment 9",
        ),
        (
            pb.OpenBulkRequest(fetch=pb.FetchWeightsRequest(key=pb.ShardKey(run_id="other", shard_id=0), step=1)),
            Code.PERMISSION_DENIED,
            "serves run",
        ),
    ],
)
def test_open_bulk_refuses_what_push_or_fetch_would_and_grants_nothing(
    bulk_served: Served, request_: pb.OpenBulkRequest, code: grpc.StatusCode, words: str
) -> None:
    s = bulk_served
    got, details = status(lambda: s.stub.OpenBulk(request_, timeout=DEADLINE_S))
    assert got == code and words in details, details


def test_a_server_without_the_bulk_socket_says_so_and_its_clients_stream_over_grpc(stepped: Served) -> None:
    s = stepped
    header = pb.PushHeader(key=pb.ShardKey(run_id=RUN, shard_id=0), step=2)
    code, details = status(lambda: s.stub.OpenBulk(pb.OpenBulkRequest(push=header), timeout=DEADLINE_S))
    assert code == Code.UNIMPLEMENTED and "tuning.state_server.data_plane" in details
    with bulk(s) as client:
        outcome = client.push(RUN, 0, 2, G2, global_norm=GLOBAL_NORM, lr=LR)
        assert not client.bulk  # asked once; gRPC streams from then on
        weights = client.fetch(RUN, 0, 2, "float32", NUMEL)
    assert outcome.applied and outcome.updates == 2
    assert torch.equal(weights, s.client.fetch(RUN, 0, 2, "float32", NUMEL))


def test_an_update_the_segment_is_not_at_is_refused_as_over_grpc(bulk_served: Served) -> None:
    s = bulk_served
    with bulk(s) as client:
        over_bulk = status(lambda: client.fetch(RUN, 0, 3, "float32", NUMEL))
        over_push = status(lambda: client.push(RUN, 0, 3, G2, global_norm=GLOBAL_NORM, lr=LR))
    assert over_bulk == status(lambda: s.client.fetch(RUN, 0, 3, "float32", NUMEL))
    assert over_push == status(lambda: s.client.push(RUN, 0, 3, G2, global_norm=GLOBAL_NORM, lr=LR))
    assert over_bulk[0] == over_push[0] == Code.FAILED_PRECONDITION


# --- who may connect ---------------------------------------------------------------------


@pytest.mark.parametrize("case", ["not a hello", "unknown ticket", "wrong token", "used ticket"])
def test_a_hello_without_a_valid_ticket_and_mac_is_refused_before_any_body(bulk_served: Served, case: str) -> None:
    """The refusal comes in answer to the hello alone: the peer has sent no body byte."""
    s = bulk_served
    before = observe(s)
    grant = grant_for(s.client, push_request(2))
    offered = {
        "not a hello": b"GET / HTTP/1.1\r\n" + bytes(40),
        "unknown ticket": hello(pb.OpenBulkResponse(ticket=bytes(16), nbytes=NBYTES), Direction.PUSH, 2),
        "wrong token": hello(grant, Direction.PUSH, 2, token="guess"),
        "used ticket": hello(grant, Direction.PUSH, 2),
    }[case]
    if case == "used ticket":
        with dialled(s.server.address, grant) as first:
            first.sendall(offered)
            assert status_of(first)[0] == Code.OK
    with dialled(s.server.address, grant) as sock:
        sock.sendall(offered)
        code, details = status_of(sock)
        assert code == Code.UNAUTHENTICATED
        assert (
            details
            == {
                "not a hello": "not a bulk hello of this version",
                "unknown ticket": "unknown or used ticket",
                "wrong token": "wrong ticket MAC (missing or wrong auth token)",
                "used ticket": "unknown or used ticket",
            }[case]
        )
        assert closed_by_peer(sock)
    assert_unchanged(s, before)
    with dialled(s.server.address, grant) as retry:  # a ticket presented and refused is used up
        retry.sendall(hello(grant, Direction.PUSH, 2))
        used = case in ("wrong token", "used ticket")
        assert status_of(retry)[0] == (Code.UNAUTHENTICATED if used else Code.OK)


def test_a_ticket_admits_only_its_own_transfer(bulk_served: Served) -> None:
    """The MAC binds the direction, the step and the size: a push ticket cannot fetch."""
    s = bulk_served
    grant = grant_for(s.client, push_request(2))
    with dialled(s.server.address, grant) as sock:
        sock.sendall(hello(grant, Direction.FETCH, 2))
        assert status_of(sock)[0] == Code.UNAUTHENTICATED


def test_a_token_protects_the_bulk_socket_as_it_does_grpc() -> None:
    token = "s3cret"
    with serving(bulk=True, auth_token=token) as s:
        with bulk(s) as anonymous:
            assert status(lambda: anonymous.fetch(RUN, 0, 0, "float32", NUMEL))[0] == Code.UNAUTHENTICATED
        with bulk(s, auth_token=token) as client:
            client.register(make_spec(), W0)
            assert client.push(RUN, 0, 1, G1, global_norm=GLOBAL_NORM, lr=LR).applied
            grant = grant_for(client, push_request(2))
        with dialled(s.server.address, grant) as sock:
            sock.sendall(hello(grant, Direction.PUSH, 2))  # the ticket, without the token's MAC
            assert status_of(sock) == (Code.UNAUTHENTICATED, "wrong ticket MAC (missing or wrong auth token)")


def test_an_expired_ticket_is_refused() -> None:
    with serving(bulk=True, limits=CallLimits(message_timeout_s=0.5)) as s, bulk(s) as client:
        client.register(make_spec(), W0)
        grant = grant_for(client, push_request(1))
        time.sleep(1.0)
        with dialled(s.server.address, grant) as sock:
            sock.sendall(hello(grant, Direction.PUSH, 1))
            assert status_of(sock) == (Code.UNAUTHENTICATED, "expired ticket")


def test_a_transfer_under_way_counts_as_a_call_in_flight_until_its_peer_is_gone(bulk_served: Served) -> None:
    """A live recovery waits for the lost worker's calls to end before it reads where the
    segments stand (``StateServer.quiet``); a push over the bulk socket runs outside any
    gRPC call once its ticket is granted, so it is counted too."""
    s = bulk_served
    before = observe(s)
    grant = grant_for(s.client, push_request(2))
    wait_until(lambda: s.server.calls_in_flight == 0, "OpenBulk ended: a granted ticket alone moves nothing")
    with dialled(s.server.address, grant) as sock:
        sock.sendall(hello(grant, Direction.PUSH, 2))
        assert status_of(sock)[0] == Code.OK
        sock.sendall(body(G2)[: NBYTES // 2])  # the sender dies half-way
        wait_until(lambda: s.server.calls_in_flight == 1, "the half-sent push counted")
    wait_until(lambda: s.server.calls_in_flight == 0, "the push ended with its peer")
    assert_unchanged(s, before)


# --- integrity ---------------------------------------------------------------------------


@pytest.mark.parametrize("flip_at", [0, NBYTES // 2, NBYTES - 1, NBYTES + 3])
def test_a_flipped_byte_in_a_push_is_data_loss_and_nothing_is_applied(bulk_served: Served, flip_at: int) -> None:
    """In the data or in a checksum."""
    s = bulk_served
    before = observe(s)
    grant = grant_for(s.client, push_request(2))
    with dialled(s.server.address, grant) as sock:
        sock.sendall(hello(grant, Direction.PUSH, 2))
        assert status_of(sock)[0] == Code.OK
        framed = bytearray(body(G2))
        framed[flip_at] ^= 0x10
        sock.sendall(framed)
        code, details = status_of(sock)
    assert code == Code.DATA_LOSS and "CRC-32C mismatch" in details
    assert_unchanged(s, before)
    samples = scrape(s.metrics.address)
    assert total(samples, "cargohold_rpc_errors_total", rpc="PushGradient.bulk", code="DATA_LOSS") == 1


def test_a_flipped_byte_in_a_fetched_body_is_detected() -> None:
    """The client's side, against a sender that flips a byte after checksumming."""
    import socket

    left, right = socket.socketpair()
    with left, right:
        right.sendall(body(W0, flip_at=12345))
        weights = torch.empty(NUMEL)
        with pytest.raises(ChecksumError, match="CRC-32C mismatch in the chunk at byte 12288"):
            receive_tensor(left, raw_bytes(weights), CHUNK_BYTES, what="weights")


def test_send_tensor_frames_what_body_describes() -> None:
    import socket

    left, right = socket.socketpair()
    with left, right:
        send_tensor(left, raw_bytes(W0), CHUNK_BYTES)
        expected = body(W0)
        got = bytearray()
        while len(got) < len(expected):
            got += right.recv(len(expected) - len(got))
    assert bytes(got) == expected


# --- bounded memory ----------------------------------------------------------------------


def test_a_fetch_offered_more_bytes_than_expected_is_refused_before_reading(bulk_served: Served) -> None:
    out = torch.full((NUMEL - 1,), 7.0)
    with bulk(bulk_served) as client:
        with pytest.raises(TransportError, match=f"offers {NBYTES} bytes, expected {NUMEL - 1} x float32"):
            client.fetch(RUN, 0, 1, "float32", NUMEL - 1, out=out)
    assert bool((out == 7.0).all())
    assert bulk_served.server.servicer.bulk.connections == 0


def test_grants_beyond_the_cap_are_refused_until_used() -> None:
    with serving(bulk=True, max_workers=2, limits=CallLimits(max_calls=2)) as s, bulk(s) as client:
        client.register(make_spec(), W0)
        first, _ = grant_for(client, push_request(1)), grant_for(client, push_request(1))
        code, details = status(lambda: grant_for(client, push_request(1)))
        assert code == Code.RESOURCE_EXHAUSTED and "2 bulk transfers granted" in details
        with dialled(s.server.address, first) as sock:
            sock.sendall(hello(first, Direction.PUSH, 1) + body(G1))
            assert status_of(sock)[0] == Code.OK
            code, outcome = read_outcome(sock)
        assert code == Code.OK and OUTCOME.unpack(outcome)[:2] == (1, True)
        grant_for(client, push_request(1))  # one slot is free again


def test_the_buffer_pool_keeps_at_most_its_limit_and_hands_out_the_smallest_that_fits() -> None:
    pool = BufferPool(2)
    buffers = [pool.take(n, "float32", what="t") for n in (30, 10, 20)]
    assert [b.numel() for b in buffers] == [120, 40, 80]
    for b in buffers:
        pool.give(b)
    assert pool.take(25, "float32", what="t") is buffers[0]  # 100 bytes: only the 120 fits
    assert pool.take(5, "bfloat16", what="t") is buffers[2]  # the 40 was let go: the limit is 2
    fresh = pool.take(5, "float32", what="t")
    assert all(fresh is not b for b in buffers)


def read_outcome(sock) -> tuple[grpc.StatusCode, bytes]:
    from cargohold.services.transport.bulk import read_status
    from cargohold.services.transport.status import status_from_number

    code, details = read_status(sock)
    return status_from_number(code), details
