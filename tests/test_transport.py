"""The state-server gRPC API end to end: a real server on 127.0.0.1 in this process, the
real client, and the generated stub for requests the client would never send.

Every call carries a deadline. "State unchanged" is checked by what a worker can see:
the fetched weights (bitwise), the step from DescribeShard and the update counters.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
import random
import socket
import threading
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import google_crc32c
import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from cargohold.services.errors import CargoholdError, TransportError
from cargohold.services.metrics import StateServerMetrics
from cargohold.services.optim import AdamWHyperParams
from cargohold.services.segment_state import SegmentRegistry, SegmentSpec, SegmentState
from cargohold.services.transport.codec import (
    MAX_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    SERVICE_NAME,
    byte_chunks,
    fill_chunk,
    spec_to_proto,
)
from cargohold.services.transport.grpc_client import RemoteError, StateServerClient
from cargohold.services.transport.grpc_server import GrpcStateServer
from cargohold.v1 import state_server_pb2 as pb
from cargohold.v1 import state_server_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

DEADLINE_S = 10.0
CHUNK_BYTES = 4096
RUN = "run-transport"
NUMEL = 10_240  # 40 KiB of fp32: ten chunks of CHUNK_BYTES
FRAGMENTS = ((0, 3000), (3008, 5000), (8064, 1900))  # the rest is padding
PADDING = torch.ones(NUMEL, dtype=torch.bool)
for _offset, _length in FRAGMENTS:
    PADDING[_offset : _offset + _length] = False
HYPER = AdamWHyperParams(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, max_grad_norm=1.0)
LR = 1e-3
GLOBAL_NORM = 3.5  # > max_grad_norm: clipping is on, so the norm must arrive intact
Code = grpc.StatusCode


def _spec(
    segment_id: int = 0,
    *,
    numel: int = NUMEL,
    fragments=FRAGMENTS,
    grad_dtype: str = "float32",
    hyper: AdamWHyperParams = HYPER,
) -> SegmentSpec:
    return SegmentSpec(
        run_id=RUN,
        segment_id=segment_id,
        start=segment_id * NUMEL,
        numel=numel,
        fragments=fragments,
        grad_dtype=grad_dtype,
        hyper=hyper,
    )


def _randn(seed: int, numel: int = NUMEL, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)).to(dtype)


W0 = _randn(0)
G1 = _randn(1)
G2 = _randn(2)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bits, so that comparisons are bitwise (NaN == NaN, -0 != +0)."""
    return tensor.view({4: torch.int32, 2: torch.int16}[tensor.element_size()])


def _assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    differ = (_bits(actual) != _bits(expected)).nonzero()
    assert differ.numel() == 0, f"{differ.numel()} elements differ, first at {differ[:5].flatten().tolist()}"


def _local(spec: SegmentSpec, pushes: list[torch.Tensor]) -> SegmentState:
    """The same updates applied in process, without any transport."""
    state = SegmentState(spec, (W0 if spec.numel == NUMEL else _randn(0, spec.numel)).clone())
    for step, gradient in enumerate(pushes, start=1):
        assert state.apply_gradient(step, gradient, global_norm=GLOBAL_NORM, lr=LR).applied
    return state


@dataclass
class Served:
    server: GrpcStateServer
    metrics: StateServerMetrics
    client: StateServerClient
    channel: grpc.Channel
    """A channel of the test's own for the raw stub and the health stub."""
    stub: pb_grpc.StateServerStub


@contextmanager
def serving(**server_options) -> Iterator[Served]:
    """A started server (``server_options`` to GrpcStateServer) with its metrics endpoint
    and a ready client; all stopped after."""
    with ExitStack() as stack:
        metrics = StateServerMetrics("t")
        metrics.start(host="127.0.0.1", port=0)
        stack.callback(metrics.stop)
        server = GrpcStateServer(SegmentRegistry(), metrics, run_id=RUN, host="127.0.0.1", **server_options)
        server.start()
        stack.callback(server.stop, 0.5)
        client = stack.enter_context(StateServerClient(server.address, chunk_bytes=CHUNK_BYTES, timeout_s=DEADLINE_S))
        channel = stack.enter_context(grpc.insecure_channel(server.address))
        client.wait_ready(timeout_s=DEADLINE_S)
        yield Served(server, metrics, client, channel, pb_grpc.StateServerStub(channel))


@pytest.fixture
def served() -> Iterator[Served]:
    with serving() as s:
        yield s


@pytest.fixture
def stepped(served: Served) -> Served:
    """Shard 0 registered and at step 1."""
    assert served.client.register(_spec(), W0) == (0, True)
    assert served.client.push(RUN, 0, 1, G1, global_norm=GLOBAL_NORM, lr=LR).applied
    return served


@dataclass(frozen=True)
class Observed:
    weights: torch.Tensor
    step: int
    updates_applied: int
    shards: dict[int, int]


def _observe(s: Served, segment_id: int = 0) -> Observed:
    _, step = s.client.describe(RUN, segment_id)
    stats = s.client.stats()
    weights = s.client.fetch(RUN, segment_id, step, "float32", NUMEL)
    return Observed(weights, step, stats.updates_applied, stats.shard_steps)


def _assert_unchanged(s: Served, before: Observed) -> None:
    after = _observe(s)
    assert (after.step, after.updates_applied, after.shards) == (before.step, before.updates_applied, before.shards)
    _assert_bitwise_equal(after.weights, before.weights)


def tensor_chunks(tensor: torch.Tensor, chunk_bytes: int) -> Iterator[pb.TensorChunk]:
    """A tensor's bytes as TensorChunk messages with their CRC-32C, for raw requests."""
    for offset, data in byte_chunks(tensor, chunk_bytes):
        chunk = pb.TensorChunk()
        fill_chunk(chunk, offset, data)
        yield chunk


def _key(segment_id: int = 0, run_id: str = RUN) -> pb.ShardKey:
    return pb.ShardKey(run_id=run_id, shard_id=segment_id)


def _header(step: int = 2, **fields) -> pb.PushGradientRequest:
    values = dict(key=_key(), step=step, dtype=pb.DTYPE_FLOAT32, numel=NUMEL, global_grad_norm=GLOBAL_NORM, lr=LR)
    values.update(fields)
    return pb.PushGradientRequest(header=pb.PushHeader(**values))


def _chunks(tensor: torch.Tensor, chunk_bytes: int = CHUNK_BYTES) -> list[pb.PushGradientRequest]:
    return [pb.PushGradientRequest(chunk=c) for c in tensor_chunks(tensor, chunk_bytes)]


def _push_raw(s: Served, messages: list[pb.PushGradientRequest]) -> pb.PushGradientResponse:
    return s.stub.PushGradient(iter(messages), timeout=DEADLINE_S)


def _fetch_raw(
    s: Served, step: int, dtype: int = pb.DTYPE_FLOAT32, *, segment_id: int = 0, chunk_bytes: int = CHUNK_BYTES
) -> list[pb.WeightsChunk]:
    request = pb.FetchWeightsRequest(key=_key(segment_id), step=step, dtype=dtype, chunk_bytes=chunk_bytes)
    return list(s.stub.FetchWeights(request, timeout=DEADLINE_S))


def _status(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    """The status a call failed with, from the client (RemoteError) or the raw stub."""
    try:
        call()
    except RemoteError as error:
        assert error.details in str(error) and error.code.name in str(error)
        return error.code, error.details
    except grpc.RpcError as error:
        return error.code(), error.details() or ""
    raise AssertionError("the call succeeded; it should have failed")


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
    spec32, spec16 = _spec(0), _spec(1, grad_dtype="bfloat16")
    g16 = G1.to(torch.bfloat16)
    assert client.register(spec32, W0) == (0, True)
    assert client.register(spec16, W0) == (0, True)
    assert client.register(spec32, W0) == (0, False)  # identical: acknowledged, nothing changes
    assert client.describe(RUN, 0) == (spec32, 0)
    assert client.describe(RUN, 1) == (spec16, 0)
    _assert_bitwise_equal(client.fetch(RUN, 0, 0, "float32", NUMEL), W0)

    out32 = client.push(RUN, 0, 1, G1, global_norm=GLOBAL_NORM, lr=LR)
    out16 = client.push(RUN, 1, 1, g16, global_norm=GLOBAL_NORM, lr=LR)
    assert (out32.applied, out32.updates, out16.applied, out16.updates) == (True, 1, True, 1)
    assert out32.seconds > 0.0
    assert client.describe(RUN, 0)[1] == client.describe(RUN, 1)[1] == 1

    for spec, gradient in ((spec32, G1), (spec16, g16)):
        local = _local(spec, [gradient])
        fetched = client.fetch(RUN, spec.segment_id, 1, "float32", NUMEL)
        _assert_bitwise_equal(fetched, local.snapshot()["master"])
        _assert_bitwise_equal(client.fetch(RUN, spec.segment_id, 1, "bfloat16", NUMEL), local.weights(1, "bfloat16"))
        _assert_bitwise_equal(fetched[PADDING], W0[PADDING])  # padding is never updated
        assert not torch.equal(fetched[~PADDING], W0[~PADDING])
    # Registering again with the same spec is no reset, whatever weights come along.
    assert client.register(spec32, G2) == (1, False)
    _assert_bitwise_equal(client.fetch(RUN, 0, 1, "float32", NUMEL), _local(spec32, [G1]).snapshot()["master"])
    # A second step, so the moments that stayed on the server matter too.
    assert client.push(RUN, 0, 2, G2, global_norm=GLOBAL_NORM, lr=LR).applied
    _assert_bitwise_equal(client.fetch(RUN, 0, 2, "float32", NUMEL), _local(spec32, [G1, G2]).snapshot()["master"])


def test_weights_come_back_in_several_ordered_checksummed_chunks(stepped: Served) -> None:
    expected = _local(_spec(), [G1])
    for dtype, name, size in ((pb.DTYPE_FLOAT32, "float32", 4), (pb.DTYPE_BFLOAT16, "bfloat16", 2)):
        messages = _fetch_raw(stepped, 1, dtype)
        assert len(messages) == math.ceil(NUMEL * size / CHUNK_BYTES) > 1
        offset = 0
        for m in messages:
            assert (m.step, m.dtype, m.numel) == (1, dtype, NUMEL)
            assert m.chunk.byte_offset == offset and 0 < len(m.chunk.data) <= CHUNK_BYTES
            assert m.chunk.crc32c == google_crc32c.value(m.chunk.data)
            offset += len(m.chunk.data)
        raw = b"".join(m.chunk.data for m in messages)
        _assert_bitwise_equal(
            torch.frombuffer(bytearray(raw), dtype=expected.weights(1, name).dtype), expected.weights(1, name)
        )
    # chunk_bytes 0 lets the server choose: one chunk for a shard this small.
    assert len(_fetch_raw(stepped, 1, chunk_bytes=0)) == 1


def test_a_failure_after_the_first_weights_chunk_ends_the_call_with_a_status(
    stepped: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks are built as they are sent; one that cannot be built still aborts the call."""
    from cargohold.services.transport import grpc_server

    real, built = grpc_server.fill_chunk, []

    def fill_then_fail(chunk: pb.TensorChunk, offset: int, data: bytes) -> None:
        if built:
            raise RuntimeError("simulated failure while building a chunk")
        built.append(offset)
        real(chunk, offset, data)

    before = _observe(stepped)
    monkeypatch.setattr(grpc_server, "fill_chunk", fill_then_fail)
    code, details = _status(lambda: stepped.client.fetch(RUN, 0, 1, "float32", NUMEL))
    assert code == Code.INTERNAL and "simulated failure" in details and built == [0]
    monkeypatch.setattr(grpc_server, "fill_chunk", real)
    _assert_unchanged(stepped, before)  # and the server goes on serving


def test_fetch_into_a_given_tensor_and_repeated_fetches_agree(stepped: Served) -> None:
    """``out`` receives the weights in place; the server's recycled buffers change no bits."""
    expected = _local(_spec(), [G1])
    shard = torch.full((NUMEL + 8,), -1.0, dtype=torch.bfloat16)
    target = shard[4 : 4 + NUMEL]
    assert stepped.client.fetch(RUN, 0, 1, "bfloat16", NUMEL, out=target) is target
    _assert_bitwise_equal(target, expected.weights(1, "bfloat16"))
    assert torch.all(shard[:4] == -1.0) and torch.all(shard[-4:] == -1.0)
    for step, gradient in ((2, G2), (3, G1)):  # each push prepares into the buffer the last fetch freed
        stepped.client.push(RUN, 0, step, gradient, global_norm=GLOBAL_NORM, lr=LR, prepare="bfloat16")
        expected.apply_gradient(step, gradient, global_norm=GLOBAL_NORM, lr=LR)
        for _ in range(2):
            _assert_bitwise_equal(
                stepped.client.fetch(RUN, 0, step, "bfloat16", NUMEL), expected.weights(step, "bfloat16")
            )
    with pytest.raises(CargoholdError, match="contiguous CPU tensor of 10240 x bfloat16"):
        stepped.client.fetch(RUN, 0, 3, "bfloat16", NUMEL, out=torch.empty(NUMEL))


def test_gradient_chunks_may_split_elements_anywhere(served: Served) -> None:
    """The server reassembles bytes, not elements: odd chunk sizes give the same update
    (each at least MIN_CHUNK_BYTES but the last, here 1 byte)."""
    served.client.register(_spec(), W0)
    raw = G1.view(torch.uint8).numpy().tobytes()
    cuts = [0, 4097, 8199, 12_302, 20_001, 40_959, len(raw)]
    chunks = [
        pb.PushGradientRequest(chunk=pb.TensorChunk(byte_offset=a, data=raw[a:b], crc32c=google_crc32c.value(raw[a:b])))
        for a, b in zip(cuts, cuts[1:])
    ]
    reply = _push_raw(served, [_header(step=1), *chunks])
    assert (reply.applied, reply.step) == (True, 1)
    _assert_bitwise_equal(served.client.fetch(RUN, 0, 1, "float32", NUMEL), _local(_spec(), [G1]).snapshot()["master"])


def test_a_repeated_push_is_acknowledged_and_ignored(stepped: Served) -> None:
    client = stepped.client
    before = _observe(stepped)
    # A retry after a lost reply; even a different gradient must not be applied again.
    again = client.push(RUN, 0, 1, G2, global_norm=GLOBAL_NORM, lr=LR)
    assert (again.applied, again.updates, again.seconds) == (False, 1, 0.0)
    _assert_unchanged(stepped, before)
    _assert_bitwise_equal(before.weights, _local(_spec(), [G1]).snapshot()["master"])
    stats = client.stats()
    assert (stats.updates_applied, stats.duplicate_pushes) == (1, 1)


# ---------------------------------------------------------------- rejected requests


def _flip_crc(messages: list[pb.PushGradientRequest], index: int) -> list[pb.PushGradientRequest]:
    messages[index].chunk.crc32c ^= 1
    return messages


def _swap(messages: list, i: int, j: int) -> list:
    messages[i], messages[j] = messages[j], messages[i]
    return messages


def _register_raw(s: Served, messages: list[pb.RegisterShardRequest]) -> pb.RegisterShardResponse:
    return s.stub.RegisterShard(iter(messages), timeout=DEADLINE_S)


def _register_messages(spec: pb.ShardSpec, weights: torch.Tensor = W0) -> list[pb.RegisterShardRequest]:
    return [
        pb.RegisterShardRequest(spec=spec),
        *(pb.RegisterShardRequest(initial_weights=c) for c in tensor_chunks(weights, CHUNK_BYTES)),
    ]


def _spec_with(field: str, value) -> pb.ShardSpec:
    message = spec_to_proto(_spec(segment_id=5))
    target, _, name = field.rpartition(".")
    setattr(message if not target else getattr(message, target), name, value)
    return message


def _bad_register_crc(s: Served) -> None:
    messages = _register_messages(spec_to_proto(_spec(segment_id=5)))
    messages[3].initial_weights.crc32c ^= 0x80000000
    _register_raw(s, messages)


def _spec_of_run(run_id: str) -> SegmentSpec:
    return dataclasses.replace(_spec(), run_id=run_id)


# (case, call, status, words the message must contain). Every call runs against a server
# whose shard 0 is at step 1; afterwards nothing a worker can observe may differ.
BAD_REQUESTS: list[tuple[str, Callable[[Served], object], grpc.StatusCode, str]] = [
    (
        "gradient of the wrong size",
        lambda s: s.client.push(RUN, 0, 2, G1[:-1], global_norm=GLOBAL_NORM, lr=LR),
        Code.INVALID_ARGUMENT,
        "gradient must be 10240 x float32, got 10239 x float32",
    ),
    (
        "gradient in bf16 for a float32 spec",
        lambda s: s.client.push(RUN, 0, 2, G1.to(torch.bfloat16), global_norm=GLOBAL_NORM, lr=LR),
        Code.INVALID_ARGUMENT,
        "got 10240 x bfloat16",
    ),
    (
        "push for an unknown shard",
        lambda s: s.client.push(RUN, 9, 1, G1, global_norm=GLOBAL_NORM, lr=LR),
        Code.NOT_FOUND,
        "no shard 9 is registered for run 'run-transport'",
    ),
    (
        "push for another run",
        lambda s: s.client.push("other-run", 0, 1, G1, global_norm=GLOBAL_NORM, lr=LR),
        Code.PERMISSION_DENIED,
        "serves run 'run-transport', not 'other-run'",
    ),
    (
        "registering a shard of another run",
        lambda s: s.client.register(_spec_of_run("other-run"), W0),
        Code.PERMISSION_DENIED,
        "serves run 'run-transport', not 'other-run'",
    ),
    (
        "fetch from another run",
        lambda s: s.client.fetch("other-run", 0, 1, "float32", NUMEL),
        Code.PERMISSION_DENIED,
        "not 'other-run'",
    ),
    (
        "commit for another run",
        lambda s: s.client.commit("other-run", 0, 1, global_norm=GLOBAL_NORM, lr=LR),
        Code.PERMISSION_DENIED,
        "not 'other-run'",
    ),
    (
        "describe a shard of another run",
        lambda s: s.client.describe("other-run", 0),
        Code.PERMISSION_DENIED,
        "not 'other-run'",
    ),
    ("stats of another run", lambda s: s.client.stats(run_id="other-run"), Code.PERMISSION_DENIED, "not 'other-run'"),
    (
        "push that skips a step",
        lambda s: s.client.push(RUN, 0, 3, G1, global_norm=GLOBAL_NORM, lr=LR),
        Code.FAILED_PRECONDITION,
        "is at step 1; it accepts a gradient for step 2, got step 3",
    ),
    (
        "push for an old step",
        lambda s: s.client.push(RUN, 0, 0, G1, global_norm=GLOBAL_NORM, lr=LR),
        Code.FAILED_PRECONDITION,
        "accepts a gradient for step 2, got step 0",
    ),
    (
        "push with a NaN learning rate",
        lambda s: s.client.push(RUN, 0, 2, G1, global_norm=GLOBAL_NORM, lr=math.nan),
        Code.INVALID_ARGUMENT,
        "lr must be finite",
    ),
    (
        "push with a negative global norm",
        lambda s: s.client.push(RUN, 0, 2, G1, global_norm=-1.0, lr=LR),
        Code.INVALID_ARGUMENT,
        "global gradient norm must be finite",
    ),
    (
        "re-register with a different spec",
        lambda s: s.client.register(_spec(hyper=AdamWHyperParams(weight_decay=0.0)), W0),
        Code.ALREADY_EXISTS,
        "already registered with a different specification",
    ),
    (
        "re-register with other fragments",
        lambda s: s.client.register(_spec(fragments=((0, 64),)), W0),
        Code.ALREADY_EXISTS,
        "different specification",
    ),
    (
        "corrupted gradient chunk checksum",
        lambda s: _push_raw(s, _flip_crc([_header(), *_chunks(G1)], 4)),
        Code.DATA_LOSS,
        "CRC-32C mismatch in chunk at byte 12288",
    ),
    ("corrupted initial-weights checksum", _bad_register_crc, Code.DATA_LOSS, "CRC-32C mismatch in chunk at byte 8192"),
    (
        "truncated gradient stream",
        lambda s: _push_raw(s, [_header(), *_chunks(G1)][:-1]),
        Code.INVALID_ARGUMENT,
        "stream ended after 36864 of 40960 bytes",
    ),
    (
        "header only, no gradient",
        lambda s: _push_raw(s, [_header()]),
        Code.INVALID_ARGUMENT,
        "stream ended after 0 of 40960 bytes",
    ),
    (
        "more bytes than declared",
        lambda s: _push_raw(
            s,
            [
                _header(),
                *_chunks(G1),
                pb.PushGradientRequest(
                    chunk=pb.TensorChunk(byte_offset=40960, data=b"\0" * 4, crc32c=google_crc32c.value(b"\0" * 4))
                ),
            ],
        ),
        Code.INVALID_ARGUMENT,
        "40964 bytes received, more than the 40960 bytes declared",
    ),
    (
        "chunks out of order",
        lambda s: _push_raw(s, _swap([_header(), *_chunks(G1)], 2, 3)),
        Code.INVALID_ARGUMENT,
        "chunk at byte 8192 arrived, expected byte 4096",
    ),
    (
        "a chunk repeated",
        lambda s: _push_raw(s, (lambda m: m[:3] + m[2:])([_header(), *_chunks(G1)])),
        Code.INVALID_ARGUMENT,
        "chunk at byte 4096 arrived, expected byte 8192",
    ),
    (
        "push stream that starts with a chunk",
        lambda s: _push_raw(s, [*_chunks(G1)]),
        Code.INVALID_ARGUMENT,
        "the first message must carry the header",
    ),
    ("empty push stream", lambda s: _push_raw(s, []), Code.INVALID_ARGUMENT, "the first message must carry the header"),
    (
        "a second header inside the stream",
        lambda s: _push_raw(s, [_header(), _header(), *_chunks(G1)]),
        Code.INVALID_ARGUMENT,
        "only chunk messages may follow the first",
    ),
    (
        "register stream that starts with weights",
        lambda s: _register_raw(s, _register_messages(spec_to_proto(_spec(segment_id=5)))[1:]),
        Code.INVALID_ARGUMENT,
        "the first message must carry the spec",
    ),
    (
        "register with an unsupported grad dtype",
        lambda s: _register_raw(s, _register_messages(_spec_with("grad_dtype", 7))),
        Code.INVALID_ARGUMENT,
        "unsupported dtype enum value 7",
    ),
    (
        "register with eps 0",
        lambda s: _register_raw(s, _register_messages(_spec_with("hyper.eps", 0.0))),
        Code.INVALID_ARGUMENT,
        "optim.eps must be > 0",
    ),
    (
        "register with a fragment past the segment",
        lambda s: _register_raw(s, _register_messages(_spec_with("numel", 100))),
        Code.INVALID_ARGUMENT,
        "leaves the segment of 100 elements",
    ),
    (
        "register declaring an absurd size",
        lambda s: _register_raw(s, _register_messages(_spec_with("numel", 2**64 - 1))[:1]),
        Code.INVALID_ARGUMENT,
        "cannot hold 18446744073709551615 x float32",
    ),
    (
        "push with an unsupported dtype enum value",
        lambda s: _push_raw(s, [_header(dtype=7), *_chunks(G1)]),
        Code.INVALID_ARGUMENT,
        "unsupported dtype enum value 7",
    ),
    (
        "push with an unspecified dtype",
        lambda s: _push_raw(s, [_header(dtype=pb.DTYPE_UNSPECIFIED), *_chunks(G1)]),
        Code.INVALID_ARGUMENT,
        "unsupported dtype enum value 0",
    ),
    (
        "fetch of a step not yet applied",
        lambda s: s.client.fetch(RUN, 0, 2, "float32", NUMEL),
        Code.FAILED_PRECONDITION,
        "holds the weights of step 1, not of step 2",
    ),
    ("fetch of an unknown shard", lambda s: s.client.fetch(RUN, 9, 1, "float32", NUMEL), Code.NOT_FOUND, "no shard 9"),
    (
        "fetch in an unsupported dtype enum value",
        lambda s: _fetch_raw(s, 1, dtype=7),
        Code.INVALID_ARGUMENT,
        "unsupported dtype enum value 7",
    ),
    (
        "fetch with chunks over the limit",
        lambda s: _fetch_raw(s, 1, chunk_bytes=2**32 - 1),
        Code.INVALID_ARGUMENT,
        "chunk_bytes must be between",
    ),
    ("describe of an unknown shard", lambda s: s.client.describe(RUN, 9), Code.NOT_FOUND, "no shard 9"),
]


@pytest.mark.parametrize(("call", "code", "words"), [c[1:] for c in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS])
def test_a_bad_request_is_refused_with_its_status_and_changes_nothing(
    stepped: Served, call: Callable[[Served], object], code: grpc.StatusCode, words: str
) -> None:
    before = _observe(stepped)
    got, details = _status(lambda: call(stepped))
    assert (got, words in details) == (code, True), f"{got.name}: {details!r}"
    _assert_unchanged(stepped, before)
    _assert_bitwise_equal(before.weights, _local(_spec(), [G1]).snapshot()["master"])
    # the server keeps serving: the next step still applies
    assert stepped.client.push(RUN, 0, 2, G2, global_norm=GLOBAL_NORM, lr=LR).applied


# ---------------------------------------------------------------- decoder fuzz

_U64 = st.integers(0, 2**64 - 1)
_U32 = st.integers(0, 2**32 - 1)
_DOUBLES = st.floats(allow_nan=True, allow_infinity=True)
_DTYPE = st.one_of(st.sampled_from([0, 2, 3]), st.integers(-(2**31), 2**31 - 1))
_OTHER_KEY = (
    st.builds(pb.ShardKey, run_id=st.just(RUN), shard_id=st.integers(1, 2**32 - 1))  # unknown shard
    | st.builds(pb.ShardKey, run_id=st.sampled_from(["", "x"]), shard_id=st.integers(0, 2**32 - 1))
)
_CHUNK_FAULTS = ("chunk_offset", "chunk_crc", "chunk_data", "drop_chunk", "truncate", "extra_chunk")


def _stream(draw, nbytes: int) -> list[pb.TensorChunk]:
    """A complete, valid stream of ``nbytes`` random bytes, cut at random places no
    closer than the smallest chunk allowed."""
    data = random.Random(draw(_U32)).randbytes(nbytes)
    cut = st.integers(MIN_CHUNK_BYTES, nbytes - MIN_CHUNK_BYTES)
    cuts = sorted(draw(st.lists(cut, max_size=6, unique_by=lambda c: c // MIN_CHUNK_BYTES)))
    cuts = [c for c, before in zip(cuts, [-MIN_CHUNK_BYTES, *cuts]) if c - before >= MIN_CHUNK_BYTES]
    bounds = [0, *cuts, nbytes]
    return [
        pb.TensorChunk(byte_offset=a, data=data[a:b], crc32c=google_crc32c.value(data[a:b]))
        for a, b in zip(bounds, bounds[1:])
    ]


def _spoil_chunks(draw, chunks: list[pb.TensorChunk], fault: str) -> list[pb.TensorChunk]:
    if not chunks:  # an earlier fault truncated the stream to nothing
        return chunks
    index = draw(st.integers(0, len(chunks) - 1))
    chunk = chunks[index]
    if fault == "chunk_offset":
        chunk.byte_offset = draw(_U64.filter(lambda v: v != chunk.byte_offset))
    elif fault == "chunk_crc":
        chunk.crc32c = draw(_U32.filter(lambda v: v != chunk.crc32c))
    elif fault == "chunk_data":
        chunk.data = draw(st.binary(max_size=600))
    elif fault == "drop_chunk":
        del chunks[index]
    elif fault == "truncate":
        del chunks[index:]
    elif fault == "extra_chunk":
        data = draw(st.binary(min_size=1, max_size=64))
        end = chunks[-1].byte_offset + len(chunks[-1].data) if chunks else 0
        chunks.append(pb.TensorChunk(byte_offset=end, data=data, crc32c=google_crc32c.value(data)))
    return chunks


def _faults(names: tuple[str, ...]) -> st.SearchStrategy[list[str]]:
    """One or two faults, now and then none."""
    return st.one_of(st.just([]), *(st.lists(st.sampled_from(names), min_size=1, max_size=2, unique=True),) * 6)


# Requests start valid and get up to two faults each; with none they are harmless
# repeats (a push of step 1, the identical registration of shard 0), so no fuzzed
# request may change what a worker observes. A push claims step 2 (the one that would
# apply) only together with a truncated stream.
_PUSH_FAULTS = (
    "key",
    "step",
    "dtype",
    "numel",
    "norm",
    "lr",
    "header_again",
    "no_header",
    "step_2_truncated",
    *_CHUNK_FAULTS,
)


@st.composite
def _push(draw) -> list[pb.PushGradientRequest]:
    header = pb.PushHeader(key=_key(), step=1, dtype=pb.DTYPE_FLOAT32, numel=NUMEL, global_grad_norm=GLOBAL_NORM, lr=LR)
    chunks = _stream(draw, 4 * NUMEL)
    faults = draw(_faults(_PUSH_FAULTS))
    for fault in faults:
        if fault == "key":
            header.key.CopyFrom(draw(_OTHER_KEY))
        elif fault == "step":
            header.step = draw(st.sampled_from([0, 3, 2**64 - 1]) | st.integers(3, 2**64 - 1))
        elif fault == "dtype":
            header.dtype = draw(_DTYPE)
        elif fault == "numel":
            header.numel = draw(_U64.filter(lambda v: v != NUMEL))
        elif fault == "norm":
            header.global_grad_norm = draw(_DOUBLES)
        elif fault == "lr":
            header.lr = draw(_DOUBLES)
        elif fault in _CHUNK_FAULTS:
            chunks = _spoil_chunks(draw, chunks, fault)
    if "step_2_truncated" in faults:  # fewer bytes than the shard's: can never complete
        header.step = 2
        chunks = chunks[: draw(st.integers(0, max(len(chunks) - 1, 0)))]
        while sum(len(c.data) for c in chunks) >= 4 * NUMEL:
            chunks.pop()
    messages = [pb.PushGradientRequest(header=header), *(pb.PushGradientRequest(chunk=c) for c in chunks)]
    if "header_again" in faults:
        messages.insert(draw(st.integers(1, len(messages))), pb.PushGradientRequest(header=header))
    if "no_header" in faults:
        del messages[0]
    return messages


_REGISTER_FAULTS = ("start", "numel", "fragments", "grad_dtype", "hyper", "no_spec", *_CHUNK_FAULTS)
_HYPER_FIELDS = ("beta1", "beta2", "eps", "weight_decay", "max_grad_norm")


@st.composite
def _register(draw) -> list[pb.RegisterShardRequest]:
    spec = spec_to_proto(_spec())
    chunks = _stream(draw, 4 * NUMEL)
    faults = draw(_faults(_REGISTER_FAULTS))
    for fault in faults:
        if fault == "start":
            spec.start = draw(_U64)
        elif fault == "numel":  # sizes this host can hold, or cannot hold at all
            spec.numel = draw(st.integers(0, 2**20) | st.integers(2**62, 2**64 - 1))
        elif fault == "fragments":
            del spec.fragments[:]
            for _ in range(draw(st.integers(0, 3))):
                spec.fragments.add(offset=draw(st.integers(0, NUMEL) | _U64), length=draw(st.integers(0, NUMEL) | _U64))
        elif fault == "grad_dtype":
            spec.grad_dtype = draw(_DTYPE | st.just(pb.DTYPE_BFLOAT16))
        elif fault == "hyper":
            setattr(spec.hyper, draw(st.sampled_from(_HYPER_FIELDS)), draw(_DOUBLES))
        elif fault in _CHUNK_FAULTS:
            chunks = _spoil_chunks(draw, chunks, fault)
    messages = [pb.RegisterShardRequest(spec=spec), *(pb.RegisterShardRequest(initial_weights=c) for c in chunks)]
    return messages[1:] if "no_spec" in faults else messages


_FETCH_FAULTS = ("key", "step", "dtype", "chunk_bytes")


@st.composite
def _fetch(draw) -> pb.FetchWeightsRequest:
    request = pb.FetchWeightsRequest(
        key=_key(),
        step=1,
        dtype=draw(st.sampled_from([1, 2])),
        chunk_bytes=draw(st.sampled_from([0, MIN_CHUNK_BYTES]) | st.integers(MIN_CHUNK_BYTES, 1 << 20)),
    )
    for fault in draw(_faults(_FETCH_FAULTS)):
        if fault == "key":
            request.key.CopyFrom(draw(_OTHER_KEY))
        elif fault == "step":
            request.step = draw(st.sampled_from([0, 2]) | _U64)
        elif fault == "dtype":
            request.dtype = draw(_DTYPE)
        elif fault == "chunk_bytes":
            too_small, too_large = st.integers(1, MIN_CHUNK_BYTES - 1), st.integers(MAX_CHUNK_BYTES + 1, 2**32 - 1)
            request.chunk_bytes = draw(too_small | too_large)
    return request


_GARBAGE = st.lists(st.binary(max_size=200), min_size=1, max_size=3)
_RPC_PATHS = {name: f"/{SERVICE_NAME}/{name}" for name in ("RegisterShard", "PushGradient")}


def _bound(send: Callable[[str, object], None], kind: str) -> Callable[[object], None]:
    def send_one(payload) -> None:
        send(kind, payload)

    return send_one


def test_fuzzed_requests_never_break_the_server_or_change_its_state() -> None:
    with serving() as s:
        assert s.client.register(_spec(), W0) == (0, True)
        assert s.client.push(RUN, 0, 1, G1, global_norm=GLOBAL_NORM, lr=LR).applied
        before = _observe(s)
        raw_streams = {
            name: s.channel.stream_unary(path, request_serializer=bytes, response_deserializer=lambda b: b)
            for name, path in _RPC_PATHS.items()
        }
        outcomes: dict[str, int] = {}

        def send(kind: str, payload) -> None:
            try:
                if kind == "push":
                    reply = _push_raw(s, payload)
                    assert (reply.applied, reply.step) == (False, 1)  # only a repeat gets here
                elif kind == "register":
                    reply = _register_raw(s, payload)
                    assert (reply.created, reply.step) == (False, 1)
                elif kind == "fetch":
                    messages = list(s.stub.FetchWeights(payload, timeout=DEADLINE_S))
                    assert (payload.key.run_id, payload.key.shard_id, payload.step) == (RUN, 0, 1)
                    assert messages and all(m.step == 1 and m.numel == NUMEL for m in messages)
                else:  # bytes that may not even parse as the request message
                    raw_streams[kind](iter(payload), timeout=DEADLINE_S)
                outcomes[f"{kind}:OK"] = outcomes.get(f"{kind}:OK", 0) + 1
            except grpc.RpcError as error:
                outcome = f"{kind}:{error.code().name}"
                outcomes[outcome] = outcomes.get(outcome, 0) + 1
                # INTERNAL from our servicer means an unhandled exception: a server bug.
                # (grpc itself answers INTERNAL for bytes that do not parse.)
                if kind in ("push", "register", "fetch"):
                    assert error.code() not in (Code.INTERNAL, Code.UNKNOWN), error.details()
                assert error.code() != Code.DEADLINE_EXCEEDED
            _assert_unchanged(s, before)

        # Each RPC gets its own budget, so that none crowds out the others.
        for kind, strategy, examples in (
            ("push", _push(), 40),
            ("register", _register(), 30),
            ("fetch", _fetch(), 25),
            ("PushGradient", _GARBAGE, 8),
            ("RegisterShard", _GARBAGE, 8),
        ):
            settings(
                max_examples=examples,
                deadline=None,
                derandomize=True,
                database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
            )(given(strategy)(_bound(send, kind)))()
        # The server still works after all that: the next step applies normally.
        assert s.client.push(RUN, 0, 2, G2, global_norm=GLOBAL_NORM, lr=LR).applied
        _assert_bitwise_equal(
            s.client.fetch(RUN, 0, 2, "float32", NUMEL), _local(_spec(), [G1, G2]).snapshot()["master"]
        )
        # The fuzz got past the first checks: it reached the deeper answers too.
        for kind in ("push", "register", "fetch"):
            assert outcomes.get(f"{kind}:OK") and len([o for o in outcomes if o.startswith(kind)]) >= 3, outcomes
        codes = {o.partition(":")[2] for o in outcomes}
        assert {"INVALID_ARGUMENT", "DATA_LOSS"} <= codes and {"NOT_FOUND", "PERMISSION_DENIED"} & codes, outcomes


# ---------------------------------------------------------------- stats and metrics


def _scrape(address: str) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=DEADLINE_S) as reply:
        assert reply.status == 200
        text = reply.read().decode("utf-8")
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _total(samples: dict, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, have), v in samples.items() if n == name and want <= have)


def test_stats_and_scraped_metrics_agree_with_the_traffic(served: Served) -> None:
    client = served.client
    small = 4096 + 64
    spec0, spec1 = _spec(0), _spec(1, numel=small, fragments=((0, 4096),), grad_dtype="bfloat16")
    w1, g1 = _randn(0, small), _randn(3, small, torch.bfloat16)
    client.register(spec0, W0)
    client.register(spec1, w1)
    client.push(RUN, 0, 1, G1, global_norm=GLOBAL_NORM, lr=LR)
    client.push(RUN, 1, 1, g1, global_norm=GLOBAL_NORM, lr=LR)
    assert not client.push(RUN, 0, 1, G1, global_norm=GLOBAL_NORM, lr=LR).applied
    client.fetch(RUN, 0, 1, "bfloat16", NUMEL)
    client.fetch(RUN, 1, 1, "float32", small)
    _status(lambda: client.push(RUN, 9, 1, G1, global_norm=GLOBAL_NORM, lr=LR))

    stats = client.stats()
    registered = 4 * (NUMEL + small)
    pushed = 4 * NUMEL * 2 + 2 * small  # the duplicate's bytes arrive too
    assert stats.received_bytes >= pushed
    assert stats.received_bytes == registered + pushed
    assert stats.sent_bytes == 2 * NUMEL + 4 * small
    assert (stats.updates_applied, stats.duplicate_pushes) == (2, 1)
    assert stats.shard_steps == {0: 1, 1: 1}
    assert stats.resident_bytes_by_tier == {"ram": 3 * 4 * (NUMEL + small)}
    assert stats.metrics_address == served.metrics.address

    samples = _scrape(stats.metrics_address)
    received = "cargohold_transport_received_bytes_total"
    assert _total(samples, received, server="t") == stats.received_bytes
    assert _total(samples, received, rpc="PushGradient") == pushed
    assert _total(samples, received, rpc="RegisterShard") == registered
    assert _total(samples, "cargohold_transport_sent_bytes_total", rpc="FetchWeights") == stats.sent_bytes
    assert _total(samples, "cargohold_optimizer_steps_total", server="t") == 2
    assert _total(samples, "cargohold_optimizer_duplicate_pushes_total", server="t") == 1
    assert _total(samples, "cargohold_optimizer_step_seconds_count", server="t") == 2
    assert 0 < _total(samples, "cargohold_optimizer_step_seconds_sum", server="t") < 10
    assert _total(samples, "cargohold_optimizer_step_seconds_bucket", le="+Inf") == 2
    assert _total(samples, "cargohold_state_resident_bytes", server="t", tier="ram") == 12 * (NUMEL + small)
    assert _total(samples, "cargohold_rpc_errors_total", rpc="PushGradient", code="NOT_FOUND") == 1


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
    assert str(copy) == str(error) and "no shard 9" in str(copy) and "NOT_FOUND" in str(copy)


def test_concurrent_pushes_of_one_step_apply_exactly_once(served: Served) -> None:
    served.client.register(_spec(), W0)
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
    _assert_bitwise_equal(served.client.fetch(RUN, 0, 1, "float32", NUMEL), _local(_spec(), [G1]).snapshot()["master"])


# --- staged pushes (defer_update) and CommitStep ---------------------------------------
def test_staged_push_applies_only_on_commit_and_equals_a_direct_push(stepped: Served) -> None:
    before = _observe(stepped)
    staged = stepped.client.push(RUN, 0, 2, G2, defer_update=True)
    assert (staged.applied, staged.updates) == (False, 2)
    _assert_unchanged(stepped, before)  # staging changes nothing visible

    committed = stepped.client.commit(RUN, 0, 2, global_norm=GLOBAL_NORM, lr=LR)
    assert committed.applied and committed.updates == 2
    _assert_bitwise_equal(
        stepped.client.fetch(RUN, 0, 2, "float32", NUMEL), _local(_spec(), [G1, G2]).weights(2, "float32")
    )

    # A repeated commit (a retry) is acknowledged and ignored; so is a late staged push.
    again = stepped.client.commit(RUN, 0, 2, global_norm=GLOBAL_NORM, lr=LR)
    assert (again.applied, again.updates) == (False, 2)
    assert not stepped.client.push(RUN, 0, 2, G2, defer_update=True).applied
    assert stepped.client.stats().updates_applied == 2


def test_commit_without_a_staged_gradient_is_refused_and_changes_nothing(stepped: Served) -> None:
    before = _observe(stepped)
    with pytest.raises(RemoteError) as error:
        stepped.client.commit(RUN, 0, 2, global_norm=GLOBAL_NORM, lr=LR)
    assert error.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "no gradient staged for step 2" in error.value.details
    with pytest.raises(RemoteError) as error:
        stepped.client.push(RUN, 0, 3, G2, defer_update=True)  # skips step 2
    assert error.value.code == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(RemoteError) as error:
        stepped.client.commit(RUN, 7, 2, global_norm=GLOBAL_NORM, lr=LR)
    assert error.value.code == grpc.StatusCode.NOT_FOUND
    _assert_unchanged(stepped, before)


def test_concurrent_commits_apply_once(stepped: Served) -> None:
    stepped.client.push(RUN, 0, 2, G2, defer_update=True)
    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(lambda _: stepped.client.commit(RUN, 0, 2, global_norm=GLOBAL_NORM, lr=LR), range(8)))
    assert sum(o.applied for o in outcomes) == 1
