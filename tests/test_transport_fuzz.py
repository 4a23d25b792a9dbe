"""Fuzzed requests (hypothesis) never break the server or change its state."""

from __future__ import annotations

import random
from collections.abc import Callable

import google_crc32c
import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transport_server import (
    DEADLINE_S,
    G1,
    G2,
    GLOBAL_NORM,
    LR,
    NUMEL,
    RUN,
    W0,
    Code,
    assert_bitwise_equal,
    assert_unchanged,
    key,
    local_state,
    make_spec,
    observe,
    push_raw,
    register_raw,
    serving,
)

from cargohold.services.core.wire import MAX_CHUNK_BYTES, MIN_CHUNK_BYTES
from cargohold.services.transport.codec import SERVICE_NAME, spec_to_proto
from cargohold.v1 import state_server_pb2 as pb

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


# ---------------------------------------------------------------- decoder fuzz

_U64 = st.integers(0, 2**64 - 1)
_U32 = st.integers(0, 2**32 - 1)
_DOUBLES = st.floats(allow_nan=True, allow_infinity=True)
_DTYPE = st.one_of(st.sampled_from([0, 2, 3]), st.integers(-(2**31), 2**31 - 1))
_OTHER_KEY = (
    st.builds(pb.ShardKey, run_id=st.just(RUN), shard_id=st.integers(1, 2**32 - 1))  # unknown segment
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
# repeats (a push of step 1, the identical registration of segment 0), so no fuzzed
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
    header = pb.PushHeader(key=key(), step=1, dtype=pb.DTYPE_FLOAT32, numel=NUMEL, global_grad_norm=GLOBAL_NORM, lr=LR)
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
    if "step_2_truncated" in faults:  # fewer bytes than the segment's: can never complete
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
    spec = spec_to_proto(make_spec())
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
        key=key(),
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
        assert s.client.register(make_spec(), W0) == (0, True)
        assert s.client.push(RUN, 0, 1, G1, global_norm=GLOBAL_NORM, lr=LR).applied
        before = observe(s)
        raw_streams = {
            name: s.channel.stream_unary(path, request_serializer=bytes, response_deserializer=lambda b: b)
            for name, path in _RPC_PATHS.items()
        }
        outcomes: dict[str, int] = {}

        def send(kind: str, payload) -> None:
            try:
                if kind == "push":
                    reply = push_raw(s, payload)
                    assert (reply.applied, reply.step) == (False, 1)  # only a repeat gets here
                elif kind == "register":
                    reply = register_raw(s, payload)
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
            assert_unchanged(s, before)

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
        assert_bitwise_equal(
            s.client.fetch(RUN, 0, 2, "float32", NUMEL), local_state(make_spec(), [G1, G2]).snapshot()["master"]
        )
        # The fuzz got past the first checks: it reached the deeper answers too.
        for kind in ("push", "register", "fetch"):
            assert outcomes.get(f"{kind}:OK") and len([o for o in outcomes if o.startswith(kind)]) >= 3, outcomes
        codes = {o.partition(":")[2] for o in outcomes}
        assert {"INVALID_ARGUMENT", "DATA_LOSS"} <= codes and {"NOT_FOUND", "PERMISSION_DENIED"} & codes, outcomes
