"""The state-server gRPC API end to end: health, round trips bitwise equal to the local
update, stats and scraped metrics, remote errors, concurrency and staged pushes.

Every call carries a deadline. "State unchanged" is checked by what a worker can see:
the fetched weights (bitwise), the step from DescribeShard and the update counters.
"""

from __future__ import annotations

import math
import pickle
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import google_crc32c
import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from transport_server import (
    CHUNK_BYTES,
    DEADLINE_S,
    G1,
    G2,
    GLOBAL_NORM,
    LR,
    NUMEL,
    PADDING,
    RUN,
    W0,
    Code,
    Served,
    assert_bitwise_equal,
    assert_unchanged,
    fetch_raw,
    key,
    local_state,
    make_spec,
    observe,
    push_header,
    push_raw,
    randn,
    scrape,
    status,
    total,
)

from cargohold.services.core.errors import CargoholdError, InvalidTensorError, TransportError
from cargohold.services.segments.segment_state import SegmentState
from cargohold.services.transport.codec import SERVICE_NAME
from cargohold.services.transport.grpc_client import RemoteError, StateServerClient
from cargohold.v1 import state_server_pb2 as pb

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


# ---------------------------------------------------------------- health and round trip


def test_wait_ready_uses_the_standard_health_service(served: Served) -> None:
    served.client.wait_ready(timeout_s=DEADLINE_S)
    health = health_pb2_grpc.HealthStub(served.channel)
    for service in (SERVICE_NAME, ""):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=DEADLINE_S)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
    assert SERVICE_NAME == pb.DESCRIPTOR.services_by_name["StateServer"].full_name
    with pytest.raises(grpc.RpcError) as caught:
        health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=DEADLINE_S)
    assert caught.value.code() == Code.NOT_FOUND


def test_wait_ready_fails_clearly_when_nothing_listens() -> None:
    with socket.socket() as sock:  # a port that was free a moment ago
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with StateServerClient(f"127.0.0.1:{port}", timeout_s=1.0) as client:
        with pytest.raises(TransportError, match=f"127.0.0.1:{port} not reachable"):
            client.wait_ready(timeout_s=0.5)


def test_register_push_fetch_equals_the_local_update_bitwise(served: Served) -> None:
    client = served.client
    spec32, spec16 = make_spec(0), make_spec(1, grad_dtype="bfloat16")
    g16 = G1.to(torch.bfloat16)
    assert client.register(spec32, W0) == (0, True)
    assert client.register(spec16, W0) == (0, True)
    assert client.register(spec32, W0) == (0, False)  # identical: acknowledged, nothing changes
    assert client.describe(RUN, 0) == (spec32, 0)
    assert client.describe(RUN, 1) == (spec16, 0)
    assert_bitwise_equal(client.fetch(RUN, 0, 0, "float32", NUMEL), W0)

    out32 = client.push(RUN, 0, 1, G1, global_norm=GLOBAL_NORM, lr=LR)
    out16 = client.push(RUN, 1, 1, g16, global_norm=GLOBAL_NORM, lr=LR)
    assert (out32.applied, out32.updates, out16.applied, out16.updates) == (True, 1, True, 1)
    assert out32.seconds > 0.0
    assert client.describe(RUN, 0)[1] == client.describe(RUN, 1)[1] == 1

    for spec, gradient in ((spec32, G1), (spec16, g16)):
        local = local_state(spec, [gradient])
        fetched = client.fetch(RUN, spec.segment_id, 1, "float32", NUMEL)
        assert_bitwise_equal(fetched, local.snapshot()["master"])
        assert_bitwise_equal(client.fetch(RUN, spec.segment_id, 1, "bfloat16", NUMEL), local.weights(1, "bfloat16"))
        assert_bitwise_equal(fetched[PADDING], W0[PADDING])  # padding is never updated
        assert not torch.equal(fetched[~PADDING], W0[~PADDING])
    # Registering again with the same spec is no reset, whatever weights come along.
    assert client.register(spec32, G2) == (1, False)
    assert_bitwise_equal(client.fetch(RUN, 0, 1, "float32", NUMEL), local_state(spec32, [G1]).snapshot()["master"])
    # A second step, so the moments that stayed on the server matter too.
    assert client.push(RUN, 0, 2, G2, global_norm=GLOBAL_NORM, lr=LR).applied
    assert_bitwise_equal(client.fetch(RUN, 0, 2, "float32", NUMEL), local_state(spec32, [G1, G2]).snapshot()["master"])


def test_an_fp16_gradient_is_committed_with_its_loss_scale_over_the_wire(served: Served) -> None:
    """fp16 gradients carrying a loss scale, staged and committed over gRPC: the server
    takes the scale out (the state equals the local one's, bitwise) and refuses a scale
    that is not a power of two, naming it, with nothing applied."""
    client, scale = served.client, 2.0**10
    spec = make_spec(2, grad_dtype="float16")
    assert client.register(spec, W0) == (0, True)
    gradient = (G1 * scale).to(torch.float16)
    client.push(RUN, 2, 1, gradient, defer_update=True)
    with pytest.raises(InvalidTensorError, match="loss scale must be a power of two"):  # refused before it leaves
        client.commit(RUN, 2, 1, global_norm=GLOBAL_NORM, lr=LR, loss_scale=1000.0)
    unscaled = pb.CommitStepRequest(key=key(2), step=1, global_grad_norm=GLOBAL_NORM, lr=LR, loss_scale=1000.0)
    code, details = status(lambda: served.stub.CommitStep(unscaled, timeout=DEADLINE_S))  # and by the server
    assert (code, "loss scale must be a power of two" in details) == (grpc.StatusCode.INVALID_ARGUMENT, True)
    assert client.describe(RUN, 2)[1] == 0
    assert client.commit(RUN, 2, 1, global_norm=GLOBAL_NORM, lr=LR, loss_scale=scale, prepare="float16").applied
    local = SegmentState(spec, W0)
    local.stage_gradient(1, gradient)
    local.commit(1, global_norm=GLOBAL_NORM, lr=LR, loss_scale=scale)
    assert_bitwise_equal(client.fetch(RUN, 2, 1, "float32", NUMEL), local.snapshot()["master"])
    assert_bitwise_equal(client.fetch(RUN, 2, 1, "float16", NUMEL), local.weights(1, "float16"))


def test_weights_come_back_in_several_ordered_checksummed_chunks(stepped: Served) -> None:
    expected = local_state(make_spec(), [G1])
    for dtype, name, size in (
        (pb.DTYPE_FLOAT32, "float32", 4),
        (pb.DTYPE_BFLOAT16, "bfloat16", 2),
        (pb.DTYPE_FLOAT16, "float16", 2),
    ):
        messages = fetch_raw(stepped, 1, dtype)
        assert len(messages) == math.ceil(NUMEL * size / CHUNK_BYTES) > 1
        offset = 0
        for m in messages:
            assert (m.step, m.dtype, m.numel) == (1, dtype, NUMEL)
            assert m.chunk.byte_offset == offset and 0 < len(m.chunk.data) <= CHUNK_BYTES
            assert m.chunk.crc32c == google_crc32c.value(m.chunk.data)
            offset += len(m.chunk.data)
        raw = b"".join(m.chunk.data for m in messages)
        assert_bitwise_equal(
            torch.frombuffer(bytearray(raw), dtype=expected.weights(1, name).dtype), expected.weights(1, name)
        )
    # chunk_bytes 0 lets the server choose: one chunk for a segment this small.
    assert len(fetch_raw(stepped, 1, chunk_bytes=0)) == 1


def test_a_failure_after_the_first_weights_chunk_ends_the_call_with_a_status(
    stepped: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks are built as they are sent; one that cannot be built still aborts the call."""
    from cargohold.services.server import servicer

    real, built = servicer.fill_chunk, []

    def fill_then_fail(chunk: pb.TensorChunk, offset: int, data: bytes) -> None:
        if built:
            raise RuntimeError("simulated failure while building a chunk")
        built.append(offset)
        real(chunk, offset, data)

    before = observe(stepped)
    monkeypatch.setattr(servicer, "fill_chunk", fill_then_fail)
    code, details = status(lambda: stepped.client.fetch(RUN, 0, 1, "float32", NUMEL))
    assert code == Code.INTERNAL and "simulated failure" in details and built == [0]
    monkeypatch.setattr(servicer, "fill_chunk", real)
    assert_unchanged(stepped, before)  # and the server goes on serving


def test_fetch_into_a_given_tensor_and_repeated_fetches_agree(stepped: Served) -> None:
    """``out`` receives the weights in place; the server's recycled buffers change no bits."""
    expected = local_state(make_spec(), [G1])
    segment = torch.full((NUMEL + 8,), -1.0, dtype=torch.bfloat16)
    target = segment[4 : 4 + NUMEL]
    assert stepped.client.fetch(RUN, 0, 1, "bfloat16", NUMEL, out=target) is target
    assert_bitwise_equal(target, expected.weights(1, "bfloat16"))
    assert torch.all(segment[:4] == -1.0) and torch.all(segment[-4:] == -1.0)
    for step, gradient in ((2, G2), (3, G1)):  # each push prepares into the buffer the last fetch freed
        stepped.client.push(RUN, 0, step, gradient, global_norm=GLOBAL_NORM, lr=LR, prepare="bfloat16")
        expected.apply_gradient(step, gradient, global_norm=GLOBAL_NORM, lr=LR)
        for _ in range(2):
            assert_bitwise_equal(
                stepped.client.fetch(RUN, 0, step, "bfloat16", NUMEL), expected.weights(step, "bfloat16")
            )
    with pytest.raises(CargoholdError, match="contiguous CPU tensor of 10240 x bfloat16"):
        stepped.client.fetch(RUN, 0, 3, "bfloat16", NUMEL, out=torch.empty(NUMEL))


def test_gradient_chunks_may_split_elements_anywhere(served: Served) -> None:
    """The server reassembles bytes, not elements: odd chunk sizes give the same update
    (each at least MIN_CHUNK_BYTES but the last, here 1 byte)."""
    served.client.register(make_spec(), W0)
    raw = G1.view(torch.uint8).numpy().tobytes()
    cuts = [0, 4097, 8199, 12_302, 20_001, 40_959, len(raw)]
    chunks = [
        pb.PushGradientRequest(chunk=pb.TensorChunk(byte_offset=a, data=raw[a:b], crc32c=google_crc32c.value(raw[a:b])))
        for a, b in zip(cuts, cuts[1:])
    ]
    reply = push_raw(served, [push_header(step=1), *chunks])
    assert (reply.applied, reply.step) == (True, 1)
    assert_bitwise_equal(
        served.client.fetch(RUN, 0, 1, "float32", NUMEL), local_state(make_spec(), [G1]).snapshot()["master"]
    )


def test_a_repeated_push_is_acknowledged_and_ignored(stepped: Served) -> None:
    client = stepped.client
    before = observe(stepped)
    # A retry after a lost reply; even a different gradient must not be applied again.
    again = client.push(RUN, 0, 1, G2, global_norm=GLOBAL_NORM, lr=LR)
    assert (again.applied, again.updates, again.seconds) == (False, 1, 0.0)
    assert_unchanged(stepped, before)
    assert_bitwise_equal(before.weights, local_state(make_spec(), [G1]).snapshot()["master"])
    stats = client.stats()
    assert (stats.updates_applied, stats.duplicate_pushes) == (1, 1)


# ---------------------------------------------------------------- stats and metrics


def test_stats_and_scraped_metrics_agree_with_the_traffic(served: Served) -> None:
    client = served.client
    small = 4096 + 64
    spec0, spec1 = make_spec(0), make_spec(1, numel=small, fragments=((0, 4096),), grad_dtype="bfloat16")
    w1, g1 = randn(0, small), randn(3, small, torch.bfloat16)
    client.register(spec0, W0)
    client.register(spec1, w1)
    client.push(RUN, 0, 1, G1, global_norm=GLOBAL_NORM, lr=LR)
    client.push(RUN, 1, 1, g1, global_norm=GLOBAL_NORM, lr=LR)
    assert not client.push(RUN, 0, 1, G1, global_norm=GLOBAL_NORM, lr=LR).applied
    client.fetch(RUN, 0, 1, "bfloat16", NUMEL)
    client.fetch(RUN, 1, 1, "float32", small)
    status(lambda: client.push(RUN, 9, 1, G1, global_norm=GLOBAL_NORM, lr=LR))

    stats = client.stats()
    registered = 4 * (NUMEL + small)
    pushed = 4 * NUMEL * 2 + 2 * small  # the duplicate's bytes arrive too
    assert stats.received_bytes >= pushed
    assert stats.received_bytes == registered + pushed
    assert stats.sent_bytes == 2 * NUMEL + 4 * small
    assert (stats.updates_applied, stats.duplicate_pushes) == (2, 1)
    assert stats.segment_updates == {0: 1, 1: 1}
    assert stats.resident_bytes_by_tier == {"ram": 3 * 4 * (NUMEL + small)}
    assert stats.metrics_address == served.metrics.address

    samples = scrape(stats.metrics_address)
    received = "cargohold_transport_received_bytes_total"
    assert total(samples, received, server="t") == stats.received_bytes
    assert total(samples, received, rpc="PushGradient") == pushed
    assert total(samples, received, rpc="RegisterShard") == registered
    assert total(samples, "cargohold_transport_sent_bytes_total", rpc="FetchWeights") == stats.sent_bytes
    assert total(samples, "cargohold_optimizer_steps_total", server="t") == 2
    assert total(samples, "cargohold_optimizer_duplicate_pushes_total", server="t") == 1
    assert total(samples, "cargohold_optimizer_step_seconds_count", server="t") == 2
    assert 0 < total(samples, "cargohold_optimizer_step_seconds_sum", server="t") < 10
    assert total(samples, "cargohold_optimizer_step_seconds_bucket", le="+Inf") == 2
    assert total(samples, "cargohold_state_resident_bytes", server="t", tier="ram") == 12 * (NUMEL + small)
    assert total(samples, "cargohold_rpc_errors_total", rpc="PushGradient", code="NOT_FOUND") == 1


# ---------------------------------------------------------------- errors and concurrency


def test_remote_error_survives_pickling(served: Served) -> None:
    with pytest.raises(RemoteError) as caught:
        served.client.describe(RUN, 9)
    error = caught.value
    assert isinstance(error, TransportError) and isinstance(error, CargoholdError)
    assert error.code == Code.NOT_FOUND and error.rpc == "DescribeShard"
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is RemoteError
    assert (copy.code, copy.rpc, copy.address, copy.details) == (
        Code.NOT_FOUND,
        "DescribeShard",
        served.server.address,
        error.details,
    )
    assert str(copy) == str(error) and "no segment 9" in str(copy) and "NOT_FOUND" in str(copy)


def test_concurrent_pushes_of_one_step_apply_exactly_once(served: Served) -> None:
    served.client.register(make_spec(), W0)
    threads = 8
    barrier = threading.Barrier(threads)
    outcomes, failures = [], []

    def push() -> None:
        try:
            barrier.wait(timeout=DEADLINE_S)
            outcomes.append(served.client.push(RUN, 0, 1, G1, global_norm=GLOBAL_NORM, lr=LR))
        except BaseException as error:  # reported below, on the test's thread
            failures.append(error)

    workers = [threading.Thread(target=push) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=2 * DEADLINE_S)
    assert not failures and len(outcomes) == threads
    assert sorted(o.applied for o in outcomes) == [False] * (threads - 1) + [True]
    assert {o.updates for o in outcomes} == {1}
    stats = served.client.stats()
    assert (stats.updates_applied, stats.duplicate_pushes) == (1, threads - 1)
    assert_bitwise_equal(
        served.client.fetch(RUN, 0, 1, "float32", NUMEL), local_state(make_spec(), [G1]).snapshot()["master"]
    )


# --- staged pushes (defer_update) and CommitStep ---------------------------------------
def test_staged_push_applies_only_on_commit_and_equals_a_direct_push(stepped: Served) -> None:
    before = observe(stepped)
    staged = stepped.client.push(RUN, 0, 2, G2, defer_update=True)
    assert (staged.applied, staged.updates) == (False, 2)
    assert_unchanged(stepped, before)  # staging changes nothing visible

    committed = stepped.client.commit(RUN, 0, 2, global_norm=GLOBAL_NORM, lr=LR)
    assert committed.applied and committed.updates == 2
    assert_bitwise_equal(
        stepped.client.fetch(RUN, 0, 2, "float32", NUMEL), local_state(make_spec(), [G1, G2]).weights(2, "float32")
    )

    # A repeated commit (a retry) is acknowledged and ignored; so is a late staged push.
    again = stepped.client.commit(RUN, 0, 2, global_norm=GLOBAL_NORM, lr=LR)
    assert (again.applied, again.updates) == (False, 2)
    assert not stepped.client.push(RUN, 0, 2, G2, defer_update=True).applied
    assert stepped.client.stats().updates_applied == 2


def test_commit_without_a_staged_gradient_is_refused_and_changes_nothing(stepped: Served) -> None:
    before = observe(stepped)
    with pytest.raises(RemoteError) as error:
        stepped.client.commit(RUN, 0, 2, global_norm=GLOBAL_NORM, lr=LR)
    assert error.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "no gradient staged for update 2" in error.value.details
    with pytest.raises(RemoteError) as error:
        stepped.client.push(RUN, 0, 3, G2, defer_update=True)  # skips step 2
    assert error.value.code == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(RemoteError) as error:
        stepped.client.commit(RUN, 7, 2, global_norm=GLOBAL_NORM, lr=LR)
    assert error.value.code == grpc.StatusCode.NOT_FOUND
    assert_unchanged(stepped, before)


def test_concurrent_commits_apply_once(stepped: Served) -> None:
    stepped.client.push(RUN, 0, 2, G2, defer_update=True)
    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(lambda _: stepped.client.commit(RUN, 0, 2, global_norm=GLOBAL_NORM, lr=LR), range(8)))
    assert sum(o.applied for o in outcomes) == 1
