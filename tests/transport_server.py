"""The state-server gRPC API under test: a real server on 127.0.0.1 in this process, the
real client, the generated stub for requests the client would never send, and what a
worker can see of a segment (to check that a refused call changed nothing)."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import grpc
import torch
from prometheus_client.parser import text_string_to_metric_families

from cargohold.services.core.optim import AdamWHyperParams
from cargohold.services.core.segment_spec import SegmentSpec
from cargohold.services.metrics.server import StateServerMetrics
from cargohold.services.segments.segment_registry import SegmentRegistry
from cargohold.services.segments.segment_state import SegmentState
from cargohold.services.server.grpc_server import GrpcStateServer
from cargohold.services.transport.codec import byte_chunks, fill_chunk
from cargohold.services.transport.grpc_client import RemoteError, StateServerClient
from cargohold.v1 import state_server_pb2 as pb
from cargohold.v1 import state_server_pb2_grpc as pb_grpc

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


def wait_until(condition: Callable[[], object], what: str, within_s: float = DEADLINE_S) -> float:
    """Seconds until ``condition`` held; fails naming ``what`` after ``within_s``."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < within_s, f"not within {within_s:g} s: {what}"
        time.sleep(0.01)
    return time.monotonic() - started


def make_spec(
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


def randn(seed: int, numel: int = NUMEL, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)).to(dtype)


W0 = randn(0)
G1 = randn(1)
G2 = randn(2)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bits, so that comparisons are bitwise (NaN == NaN, -0 != +0)."""
    return tensor.view({4: torch.int32, 2: torch.int16}[tensor.element_size()])


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    differ = (bits(actual) != bits(expected)).nonzero()
    assert differ.numel() == 0, f"{differ.numel()} elements differ, first at {differ[:5].flatten().tolist()}"


def local_state(spec: SegmentSpec, pushes: list[torch.Tensor]) -> SegmentState:
    """The same updates applied in process, without any transport."""
    state = SegmentState(spec, (W0 if spec.numel == NUMEL else randn(0, spec.numel)).clone())
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


@dataclass(frozen=True)
class Observed:
    weights: torch.Tensor
    step: int
    updates_applied: int
    segment_updates: dict[int, int]


def observe(s: Served, segment_id: int = 0) -> Observed:
    _, step = s.client.describe(RUN, segment_id)
    stats = s.client.stats()
    weights = s.client.fetch(RUN, segment_id, step, "float32", NUMEL)
    return Observed(weights, step, stats.updates_applied, stats.segment_updates)


def assert_unchanged(s: Served, before: Observed) -> None:
    after = observe(s)
    assert (after.step, after.updates_applied, after.segment_updates) == (
        before.step,
        before.updates_applied,
        before.segment_updates,
    )
    assert_bitwise_equal(after.weights, before.weights)


def tensor_chunks(tensor: torch.Tensor, chunk_bytes: int) -> Iterator[pb.TensorChunk]:
    """A tensor's bytes as TensorChunk messages with their CRC-32C, for raw requests."""
    for offset, data in byte_chunks(tensor, chunk_bytes):
        chunk = pb.TensorChunk()
        fill_chunk(chunk, offset, data)
        yield chunk


def key(segment_id: int = 0, run_id: str = RUN) -> pb.ShardKey:
    return pb.ShardKey(run_id=run_id, shard_id=segment_id)


def push_header(step: int = 2, **fields) -> pb.PushGradientRequest:
    values = dict(key=key(), step=step, dtype=pb.DTYPE_FLOAT32, numel=NUMEL, global_grad_norm=GLOBAL_NORM, lr=LR)
    values.update(fields)
    return pb.PushGradientRequest(header=pb.PushHeader(**values))


def chunks(tensor: torch.Tensor, chunk_bytes: int = CHUNK_BYTES) -> list[pb.PushGradientRequest]:
    return [pb.PushGradientRequest(chunk=c) for c in tensor_chunks(tensor, chunk_bytes)]


def push_raw(s: Served, messages: list[pb.PushGradientRequest]) -> pb.PushGradientResponse:
    return s.stub.PushGradient(iter(messages), timeout=DEADLINE_S)


def fetch_raw(
    s: Served, step: int, dtype: int = pb.DTYPE_FLOAT32, *, segment_id: int = 0, chunk_bytes: int = CHUNK_BYTES
) -> list[pb.WeightsChunk]:
    request = pb.FetchWeightsRequest(key=key(segment_id), step=step, dtype=dtype, chunk_bytes=chunk_bytes)
    return list(s.stub.FetchWeights(request, timeout=DEADLINE_S))


def status(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    """The status a call failed with, from the client (RemoteError) or the raw stub."""
    try:
        call()
    except RemoteError as error:
        assert error.details in str(error) and error.code.name in str(error)
        return error.code, error.details
    except grpc.RpcError as error:
        return error.code(), error.details() or ""
    raise AssertionError("the call succeeded; it should have failed")


def register_raw(s: Served, messages: list[pb.RegisterShardRequest]) -> pb.RegisterShardResponse:
    return s.stub.RegisterShard(iter(messages), timeout=DEADLINE_S)


def register_messages(spec: pb.ShardSpec, weights: torch.Tensor = W0) -> list[pb.RegisterShardRequest]:
    return [
        pb.RegisterShardRequest(spec=spec),
        *(pb.RegisterShardRequest(initial_weights=c) for c in tensor_chunks(weights, CHUNK_BYTES)),
    ]


def scrape(address: str) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=DEADLINE_S) as reply:
        assert reply.status == 200
        text = reply.read().decode("utf-8")
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def total(samples: dict, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, have), v in samples.items() if n == name and want <= have)
