"""Requests the server must refuse, each with its status code, changing nothing."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import google_crc32c
import grpc
import pytest
import torch
from transport_server import (
    G1,
    G2,
    GLOBAL_NORM,
    LR,
    NUMEL,
    RUN,
    W0,
    Code,
    Served,
    assert_bitwise_equal,
    assert_unchanged,
    chunks,
    fetch_raw,
    local_state,
    make_spec,
    observe,
    push_header,
    push_raw,
    register_messages,
    register_raw,
    status,
)

from cargohold.services.core.optim import AdamWHyperParams
from cargohold.services.core.segment_spec import SegmentSpec
from cargohold.services.transport.codec import (
    spec_to_proto,
)
from cargohold.v1 import state_server_pb2 as pb

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


# ---------------------------------------------------------------- rejected requests


def _flip_crc(messages: list[pb.PushGradientRequest], index: int) -> list[pb.PushGradientRequest]:
    messages[index].chunk.crc32c ^= 1
    return messages


def _swap(messages: list, i: int, j: int) -> list:
    messages[i], messages[j] = messages[j], messages[i]
    return messages


def _spec_with(field: str, value) -> pb.ShardSpec:
    message = spec_to_proto(make_spec(segment_id=5))
    target, _, name = field.rpartition(".")
    setattr(message if not target else getattr(message, target), name, value)
    return message


def _bad_register_crc(s: Served) -> None:
    messages = register_messages(spec_to_proto(make_spec(segment_id=5)))
    messages[3].initial_weights.crc32c ^= 0x80000000
    register_raw(s, messages)


def _spec_of_run(run_id: str) -> SegmentSpec:
    return dataclasses.replace(make_spec(), run_id=run_id)


# (case, call, status, words the message must contain). Every call runs against a server
# whose segment 0 is at update 1; afterwards nothing a worker can observe may differ.
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
        "push for an unknown segment",
        lambda s: s.client.push(RUN, 9, 1, G1, global_norm=GLOBAL_NORM, lr=LR),
        Code.NOT_FOUND,
        "no segment 9 is registered for run 'run-transport'",
    ),
    (
        "push for another run",
        lambda s: s.client.push("other-run", 0, 1, G1, global_norm=GLOBAL_NORM, lr=LR),
        Code.PERMISSION_DENIED,
        "serves run 'run-transport', not 'other-run'",
    ),
    (
        "registering a segment of another run",
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
        "describe a segment of another run",
        lambda s: s.client.describe("other-run", 0),
        Code.PERMISSION_DENIED,
        "not 'other-run'",
    ),
    ("stats of another run", lambda s: s.client.stats(run_id="other-run"), Code.PERMISSION_DENIED, "not 'other-run'"),
    (
        "push that skips a step",
        lambda s: s.client.push(RUN, 0, 3, G1, global_norm=GLOBAL_NORM, lr=LR),
        Code.FAILED_PRECONDITION,
        "is at update 1; it accepts a gradient for update 2, got update 3",
    ),
    (
        "push for an old step",
        lambda s: s.client.push(RUN, 0, 0, G1, global_norm=GLOBAL_NORM, lr=LR),
        Code.FAILED_PRECONDITION,
        "accepts a gradient for update 2, got update 0",
    ),
    (
        "push with a NaN learning rate",
        lambda s: push_raw(s, [push_header(lr=math.nan), *chunks(G1)]),
        Code.INVALID_ARGUMENT,
        "lr must be finite",
    ),
    (
        "push with a negative global norm",
        lambda s: push_raw(s, [push_header(global_grad_norm=-1.0), *chunks(G1)]),
        Code.INVALID_ARGUMENT,
        "global gradient norm must be finite",
    ),
    (
        "re-register with a different spec",
        lambda s: s.client.register(make_spec(hyper=AdamWHyperParams(weight_decay=0.0)), W0),
        Code.ALREADY_EXISTS,
        "already registered with a different specification",
    ),
    (
        "re-register with other fragments",
        lambda s: s.client.register(make_spec(fragments=((0, 64),)), W0),
        Code.ALREADY_EXISTS,
        "different specification",
    ),
    (
        "corrupted gradient chunk checksum",
        lambda s: push_raw(s, _flip_crc([push_header(), *chunks(G1)], 4)),
        Code.DATA_LOSS,
        "CRC-32C mismatch in chunk at byte 12288",
    ),
    ("corrupted initial-weights checksum", _bad_register_crc, Code.DATA_LOSS, "CRC-32C mismatch in chunk at byte 8192"),
    (
        "truncated gradient stream",
        lambda s: push_raw(s, [push_header(), *chunks(G1)][:-1]),
        Code.INVALID_ARGUMENT,
        "stream ended after 36864 of 40960 bytes",
    ),
    (
        "header only, no gradient",
        lambda s: push_raw(s, [push_header()]),
        Code.INVALID_ARGUMENT,
        "stream ended after 0 of 40960 bytes",
    ),
    (
        "more bytes than declared",
        lambda s: push_raw(
            s,
            [
                push_header(),
                *chunks(G1),
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
        lambda s: push_raw(s, _swap([push_header(), *chunks(G1)], 2, 3)),
        Code.INVALID_ARGUMENT,
        "chunk at byte 8192 arrived, expected byte 4096",
    ),
    (
        "a chunk repeated",
        lambda s: push_raw(s, (lambda m: m[:3] + m[2:])([push_header(), *chunks(G1)])),
        Code.INVALID_ARGUMENT,
        "chunk at byte 4096 arrived, expected byte 8192",
    ),
    (
        "push stream that starts with a chunk",
        lambda s: push_raw(s, [*chunks(G1)]),
        Code.INVALID_ARGUMENT,
        "the first message must carry the header",
    ),
    ("empty push stream", lambda s: push_raw(s, []), Code.INVALID_ARGUMENT, "the first message must carry the header"),
    (
        "a second header inside the stream",
        lambda s: push_raw(s, [push_header(), push_header(), *chunks(G1)]),
        Code.INVALID_ARGUMENT,
        "only chunk messages may follow the first",
    ),
    (
        "register stream that starts with weights",
        lambda s: register_raw(s, register_messages(spec_to_proto(make_spec(segment_id=5)))[1:]),
        Code.INVALID_ARGUMENT,
        "the first message must carry the spec",
    ),
    (
        "register with an unsupported grad dtype",
        lambda s: register_raw(s, register_messages(_spec_with("grad_dtype", 7))),
        Code.INVALID_ARGUMENT,
        "unsupported dtype enum value 7",
    ),
    (
        "register with eps 0",
        lambda s: register_raw(s, register_messages(_spec_with("hyper.eps", 0.0))),
        Code.INVALID_ARGUMENT,
        "optim.eps must be > 0",
    ),
    (
        "register with a fragment past the segment",
        lambda s: register_raw(s, register_messages(_spec_with("numel", 100))),
        Code.INVALID_ARGUMENT,
        "leaves the segment of 100 elements",
    ),
    (
        "register declaring an absurd size",
        lambda s: register_raw(s, register_messages(_spec_with("numel", 2**64 - 1))[:1]),
        Code.INVALID_ARGUMENT,
        "cannot hold 18446744073709551615 x float32",
    ),
    (
        "push with an unsupported dtype enum value",
        lambda s: push_raw(s, [push_header(dtype=7), *chunks(G1)]),
        Code.INVALID_ARGUMENT,
        "unsupported dtype enum value 7",
    ),
    (
        "push with an unspecified dtype",
        lambda s: push_raw(s, [push_header(dtype=pb.DTYPE_UNSPECIFIED), *chunks(G1)]),
        Code.INVALID_ARGUMENT,
        "unsupported dtype enum value 0",
    ),
    (
        "fetch of a step not yet applied",
        lambda s: s.client.fetch(RUN, 0, 2, "float32", NUMEL),
        Code.FAILED_PRECONDITION,
        "holds the weights of update 1, not of update 2",
    ),
    (
        "fetch of an unknown segment",
        lambda s: s.client.fetch(RUN, 9, 1, "float32", NUMEL),
        Code.NOT_FOUND,
        "no segment 9",
    ),
    (
        "fetch in an unsupported dtype enum value",
        lambda s: fetch_raw(s, 1, dtype=7),
        Code.INVALID_ARGUMENT,
        "unsupported dtype enum value 7",
    ),
    (
        "fetch with chunks over the limit",
        lambda s: fetch_raw(s, 1, chunk_bytes=2**32 - 1),
        Code.INVALID_ARGUMENT,
        "chunk_bytes must be between",
    ),
    ("describe of an unknown segment", lambda s: s.client.describe(RUN, 9), Code.NOT_FOUND, "no segment 9"),
]


@pytest.mark.parametrize(("call", "code", "words"), [c[1:] for c in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS])
def test_a_bad_request_is_refused_with_its_status_and_changes_nothing(
    stepped: Served, call: Callable[[Served], object], code: grpc.StatusCode, words: str
) -> None:
    before = observe(stepped)
    got, details = status(lambda: call(stepped))
    assert (got, words in details) == (code, True), f"{got.name}: {details!r}"
    assert_unchanged(stepped, before)
    assert_bitwise_equal(before.weights, local_state(make_spec(), [G1]).snapshot()["master"])
    # the server keeps serving: the next step still applies
    assert stepped.client.push(RUN, 0, 2, G2, global_norm=GLOBAL_NORM, lr=LR).applied
