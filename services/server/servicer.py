"""The state server's RPC handlers: decode a request, call the segment registry, map
cargohold errors to gRPC status codes. No training logic lives here; the server that
serves them (auth, limits, health, the bulk socket) is services/server/grpc_server.py."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import grpc
import torch

from cargohold.services.core.errors import (
    CargoholdError,
    ForeignRunError,
    InvalidTensorError,
    TruncatedStreamError,
    UnknownSegmentError,
)
from cargohold.services.core.segment_spec import UpdateOutcome
from cargohold.services.core.update_call import SharedRef, UpdateCall
from cargohold.services.core.wire import DEFAULT_CHUNK_BYTES, WIRE_DTYPES
from cargohold.services.metrics.server import StateServerMetrics
from cargohold.services.segments.segment_registry import SegmentRegistry
from cargohold.services.segments.segment_state import SegmentState
from cargohold.services.server.bulk_server import RPC_OF, BulkServer, FetchJob, PushJob
from cargohold.services.transport.bulk import Direction
from cargohold.services.transport.codec import (
    TensorAssembler,
    byte_chunks,
    call_from_commit,
    call_from_push_header,
    check_chunk_bytes,
    dtype_from_proto,
    fill_chunk,
    partition_row_to_proto,
    spec_from_proto,
    spec_to_proto,
    tier_summary_to_proto,
)
from cargohold.services.transport.limits import (
    StalledCallError,
)
from cargohold.services.transport.shm import RegionCache
from cargohold.services.transport.status import status_of
from cargohold.v1 import state_server_pb2 as pb
from cargohold.v1 import state_server_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)


T = TypeVar("T")


class StateServerServicer(pb_grpc.StateServerServicer):
    def __init__(
        self, registry: SegmentRegistry, metrics: StateServerMetrics, run_id: str, *, regions: RegionCache
    ) -> None:
        self.run_id = run_id
        """The one run this server serves: calls naming another are refused."""
        self._registry = registry
        self._metrics = metrics
        self._regions = regions
        self.bulk: BulkServer | None = None
        """The bulk socket OpenBulk grants transfers on; None when not served."""
        # RPCs run on a thread pool and `+=` on an attribute is not atomic: guard the counters.
        self._counts = threading.Lock()
        self.duplicate_pushes = 0
        self.updates_applied = 0
        self.received_bytes = 0
        self.sent_bytes = 0

    def RegisterShard(
        self, request_iterator: Iterator[pb.RegisterShardRequest], context: grpc.ServicerContext
    ) -> pb.RegisterShardResponse:
        def handle() -> pb.RegisterShardResponse:
            first = next(request_iterator, None)
            if first is None or first.WhichOneof("part") != "spec":
                raise InvalidTensorError("RegisterShard: the first message must carry the spec")
            spec = spec_from_proto(first.spec)
            self._admit(spec.run_id)
            weights = self._receive(
                request_iterator,
                spec.numel,
                "float32",
                "initial_weights",
                f"segment {spec.segment_id} initial weights",
                "RegisterShard",
            )
            try:
                existing = self._registry.get(spec.run_id, spec.segment_id)
            except UnknownSegmentError:
                existing = None
            state = self._registry.register(spec, weights)
            self._report_resident_bytes()
            return pb.RegisterShardResponse(step=state.updates, created=existing is None)

        return self._guard("RegisterShard", context, handle)

    def DescribeShard(
        self, request: pb.DescribeShardRequest, context: grpc.ServicerContext
    ) -> pb.DescribeShardResponse:
        def handle() -> pb.DescribeShardResponse:
            self._admit(request.key.run_id)
            state = self._registry.get(request.key.run_id, request.key.shard_id)
            return pb.DescribeShardResponse(spec=spec_to_proto(state.spec), step=state.updates)

        return self._guard("DescribeShard", context, handle)

    def PushGradient(
        self, request_iterator: Iterator[pb.PushGradientRequest], context: grpc.ServicerContext
    ) -> pb.PushGradientResponse:
        def handle() -> pb.PushGradientResponse:
            first = next(request_iterator, None)
            if first is None or first.WhichOneof("part") != "header":
                raise InvalidTensorError("PushGradient: the first message must carry the header")
            header = first.header
            state, dtype = self._push_target(header)
            call = call_from_push_header(header)
            weights_out = self._weights_out(call, state)
            if isinstance(call.gradient, SharedRef):
                if next(request_iterator, None) is not None:
                    raise InvalidTensorError("PushGradient: no chunks may follow a shared-memory header")
                gradient = self._shared_tensor(call.gradient, call.run_id, dtype, call.numel)
                self._metrics.transport.received["PushGradient.shm"].inc(gradient.numel() * gradient.element_size())
                owned = False  # a view of the worker's buffer, which it reuses next step
            else:
                gradient = self._receive(
                    request_iterator,
                    call.numel,
                    dtype,
                    "chunk",
                    f"segment {state.spec.segment_id} gradient",
                    "PushGradient",
                )
                owned = True  # assembled for this call alone: clipping may scale it in place
            return self._carry_out(call, state, gradient, owned=owned, weights_out=weights_out)

        return self._guard("PushGradient", context, handle)

    def _weights_out(self, call: UpdateCall, state: SegmentState) -> torch.Tensor | None:
        """Where the call's caller wants the new weights (``weights_to``), as room for them
        in their dtype: checked before the update, so a bad reference changes nothing."""
        if call.weights_to is None:
            return None
        assert call.weights_dtype is not None  # the call's own rule
        return self._shared_tensor(call.weights_to, call.run_id, call.weights_dtype, state.spec.numel)

    def _shared_tensor(self, ref: SharedRef | pb.SharedMemoryRef, run_id: str, dtype: str, numel: int) -> torch.Tensor:
        """``numel`` elements of ``dtype`` in the worker's shared memory that ``ref`` names
        (its region checked against ``run_id`` before it is mapped)."""
        region = self._regions.open(ref.path, run_id)
        return region.tensor(WIRE_DTYPES[dtype], ref.byte_offset, numel)

    def _count_weights(self, target: torch.Tensor, rpc: str) -> None:
        """Account weights written into a worker's shared memory (``target``) under ``rpc``."""
        self._metrics.transport.sent[rpc].inc(target.numel() * target.element_size())

    def _push_target(self, header: pb.PushHeader) -> tuple[SegmentState, str]:
        """The segment a push header names and its gradient dtype, once the header fits it."""
        self._admit(header.key.run_id)
        state = self._registry.get(header.key.run_id, header.key.shard_id)
        dtype = dtype_from_proto(header.dtype)
        if header.numel != state.spec.numel or dtype != state.spec.grad_dtype:
            raise InvalidTensorError(
                f"segment {state.spec.segment_id}: gradient must be {state.spec.numel} x "
                f"{state.spec.grad_dtype}, got {header.numel} x {dtype}"
            )
        return state, dtype

    def _carry_out(
        self,
        call: UpdateCall,
        state: SegmentState,
        gradient: torch.Tensor | None,
        *,
        owned: bool = False,
        weights_out: torch.Tensor | None = None,
    ) -> pb.PushGradientResponse:
        """Carry out an update call, whichever way its gradient came, and count it."""
        outcome = state.update(call, gradient=gradient, owned=owned, weights_out=weights_out)
        if not call.stages:
            self._count(outcome)
        if weights_out is not None:
            self._count_weights(weights_out, "CommitStep.shm" if call.commits else "PushGradient.shm")
        return pb.PushGradientResponse(
            step=outcome.updates,
            applied=outcome.applied,
            update_seconds=outcome.seconds,
            weights_written=weights_out is not None,
        )

    def OpenBulk(self, request: pb.OpenBulkRequest, context: grpc.ServicerContext) -> pb.OpenBulkResponse:
        bulk = self.bulk
        if bulk is None:
            self._metrics.record_error("OpenBulk", grpc.StatusCode.UNIMPLEMENTED.name)
            context.abort(
                grpc.StatusCode.UNIMPLEMENTED,
                "this state server serves no bulk socket (tuning.state_server.data_plane: grpc); "
                "push and fetch over gRPC",
            )

        def handle() -> pb.OpenBulkResponse:
            assert bulk is not None
            chunk_bytes = request.chunk_bytes or DEFAULT_CHUNK_BYTES  # 0: the server's choice
            check_chunk_bytes(chunk_bytes)
            transfer = request.WhichOneof("transfer")
            named = getattr(request, transfer) if transfer in ("push", "fetch") else None
            if named is None or named.HasField("shm") or (transfer == "push" and named.HasField("weights_out")):
                raise InvalidTensorError("OpenBulk: name a push or a fetch, without shared memory")
            if transfer == "push":
                header = request.push
                state, dtype = self._push_target(header)
                call = call_from_push_header(header)
                direction, key, update = Direction.PUSH, header.key, header.step

                def apply(gradient: torch.Tensor) -> UpdateOutcome:
                    outcome = state.update(call, gradient=gradient, owned=True)
                    if not call.stages:
                        self._count(outcome)
                    return outcome

                job: PushJob | FetchJob = PushJob(call.numel, dtype, apply)
            else:
                fetch = request.fetch
                self._admit(fetch.key.run_id)
                state = self._registry.get(fetch.key.run_id, fetch.key.shard_id)
                dtype = dtype_from_proto(fetch.dtype)
                direction, key, update = Direction.FETCH, fetch.key, fetch.step
                job = FetchJob(lambda: state.weights(fetch.step, dtype), state.recycle)
            nbytes = state.spec.numel * WIRE_DTYPES[dtype].itemsize
            ticket = bulk.grant(direction, key.run_id, key.shard_id, update, nbytes, chunk_bytes, job)
            return pb.OpenBulkResponse(ticket=ticket, port=bulk.port, nbytes=nbytes, chunk_bytes=chunk_bytes)

        return self._guard("OpenBulk", context, handle)

    def count_bulk(self, direction: Direction, nbytes: int) -> None:
        """Account a transfer the bulk socket completed."""
        pushed = direction is Direction.PUSH
        with self._counts:
            self.received_bytes += nbytes if pushed else 0
            self.sent_bytes += 0 if pushed else nbytes
        (self._metrics.transport.received if pushed else self._metrics.transport.sent)[RPC_OF[direction]].inc(nbytes)

    def CommitStep(self, request: pb.CommitStepRequest, context: grpc.ServicerContext) -> pb.PushGradientResponse:
        def handle() -> pb.PushGradientResponse:
            self._admit(request.key.run_id)
            state = self._registry.get(request.key.run_id, request.key.shard_id)
            call = call_from_commit(request, state.spec.numel)
            return self._carry_out(call, state, None, weights_out=self._weights_out(call, state))

        return self._guard("CommitStep", context, handle)

    def _count(self, outcome: UpdateOutcome) -> None:
        """Account an update that was applied, or a repeat that was ignored."""
        with self._counts:
            if outcome.applied:
                self.updates_applied += 1
            else:
                self.duplicate_pushes += 1
        if outcome.applied:
            self._metrics.update_seconds.observe(outcome.seconds)
            self._metrics.updates_applied.inc()
            if self._registry.storage.enabled:  # partitions move between tiers as they update
                self._report_resident_bytes()
        else:
            self._metrics.duplicate_pushes.inc()

    def FetchWeights(self, request: pb.FetchWeightsRequest, context: grpc.ServicerContext) -> Iterator[pb.WeightsChunk]:
        def handle() -> Iterator[tuple[pb.WeightsChunk, int]]:
            # Everything that can refuse the call runs here, before the first message.
            self._admit(request.key.run_id)
            state = self._registry.get(request.key.run_id, request.key.shard_id)
            dtype = dtype_from_proto(request.dtype)
            chunk_bytes = request.chunk_bytes or DEFAULT_CHUNK_BYTES  # 0: the server's choice
            check_chunk_bytes(chunk_bytes)
            if request.HasField("shm"):  # written straight into the worker's exchange buffer
                target = self._shared_tensor(request.shm, request.key.run_id, dtype, state.spec.numel)
                state.weights(request.step, dtype, out=target)
                self._count_weights(target, "FetchWeights.shm")
                return iter(
                    [
                        (
                            pb.WeightsChunk(
                                step=request.step, dtype=request.dtype, numel=target.numel(), chunk=pb.TensorChunk()
                            ),
                            0,
                        )
                    ]
                )
            weights = state.weights(request.step, dtype)
            return self._weight_chunks(state, request, weights, chunk_bytes)

        # Chunks are built one at a time from the one copy of the weights, as gRPC asks for
        # them; a failure while building one still ends the call with its status.
        messages = self._guard("FetchWeights", context, handle)
        while (item := self._guard("FetchWeights", context, lambda: next(messages, None))) is not None:
            message, size = item
            with self._counts:
                self.sent_bytes += size
            self._metrics.transport.sent["FetchWeights"].inc(size)
            yield message

    @staticmethod
    def _weight_chunks(
        state: SegmentState, request: pb.FetchWeightsRequest, weights: torch.Tensor, chunk_bytes: int
    ) -> Iterator[tuple[pb.WeightsChunk, int]]:
        for offset, data in byte_chunks(weights, chunk_bytes):
            message = pb.WeightsChunk(step=request.step, dtype=request.dtype, numel=weights.numel())
            fill_chunk(message.chunk, offset, data)  # in place: no merge copy
            yield message, len(data)
        state.recycle(weights)  # every chunk holds its own bytes now

    def GetStats(self, request: pb.GetStatsRequest, context: grpc.ServicerContext) -> pb.GetStatsResponse:
        def handle() -> pb.GetStatsResponse:
            if request.run_id:
                self._admit(request.run_id)
            segments = self._registry.segments(self.run_id)
            return pb.GetStatsResponse(
                shards=[
                    pb.ShardStats(
                        key=pb.ShardKey(run_id=s.spec.run_id, shard_id=s.spec.segment_id),
                        step=s.updates,
                        numel=s.spec.numel,
                        resident_bytes=s.resident_bytes,
                    )
                    for s in segments
                ],
                received_bytes=self.received_bytes,
                sent_bytes=self.sent_bytes,
                updates_applied=self.updates_applied,
                duplicate_pushes=self.duplicate_pushes,
                resident_bytes_by_tier=self._registry.bytes_by_tier(),
                metrics_address=self._metrics.address if self._metrics.serving else "",
                partitions=[partition_row_to_proto(r) for r in self._registry.storage.rows(request.run_id or None)],
                tier=tier_summary_to_proto(self._registry.storage.summary()),
            )

        return self._guard("GetStats", context, handle)

    def close(self) -> None:
        """Unmap shared memory the workers offered."""
        self._regions.close()

    def _report_resident_bytes(self) -> None:
        for tier, nbytes in self._registry.bytes_by_tier().items():
            self._metrics.set_resident_bytes(tier, nbytes)

    def _receive(
        self, request_iterator: Iterator, numel: int, dtype: str, field: str, what: str, rpc: str
    ) -> torch.Tensor:
        assembler = TensorAssembler(numel, dtype, what=what)
        for message in request_iterator:
            if message.WhichOneof("part") != field:
                raise InvalidTensorError(f"{rpc}: only {field} messages may follow the first")
            size = assembler.add(getattr(message, field))
            with self._counts:
                self.received_bytes += size
            self._metrics.transport.received[rpc].inc(size)
        return assembler.finish()

    def _admit(self, run_id: str) -> None:
        if run_id != self.run_id:
            raise ForeignRunError(f"this state server serves run {self.run_id!r}, not {run_id!r}")

    def _guard(self, rpc: str, context: grpc.ServicerContext, handle: Callable[[], T]) -> T:
        try:
            return handle()
        except StalledCallError as error:  # the call limits cancelled the call, and counted it
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(error))
        except CargoholdError as error:
            if isinstance(error, TruncatedStreamError) and _cancelled_soon(context):
                self._abort_cancelled(rpc, context, error)
            code = status_of(error)
            self._metrics.record_error(rpc, code.name)
            context.abort(code, str(error))
        except Exception as error:
            if not context.is_active():  # the client cancelled, or its deadline passed: not our failure
                self._abort_cancelled(rpc, context, error)
            # a bug: report it, keep serving
            logger.exception("%s failed", rpc)
            self._metrics.record_error(rpc, grpc.StatusCode.INTERNAL.name)
            context.abort(grpc.StatusCode.INTERNAL, f"{rpc}: {type(error).__name__}: {error}")
        raise AssertionError("context.abort returned")  # pragma: no cover

    def _abort_cancelled(self, rpc: str, context: grpc.ServicerContext, error: Exception) -> None:
        logger.info("%s: the call ended on the client's side (%s)", rpc, type(error).__name__)
        self._metrics.record_error(rpc, grpc.StatusCode.CANCELLED.name)
        context.abort(grpc.StatusCode.CANCELLED, f"{rpc}: cancelled")


def _cancelled_soon(context: grpc.ServicerContext, wait_s: float = 0.5) -> bool:
    """Whether gRPC marks the call inactive within ``wait_s``: a stream cut short by the
    client's cancellation ends first and is marked cancelled a moment later."""
    deadline = time.monotonic() + wait_s
    while context.is_active():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True
