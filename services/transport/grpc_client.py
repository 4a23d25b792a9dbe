"""Client of one state server over gRPC, speaking tensors and internal dataclasses."""

from __future__ import annotations

import logging
import socket
import ssl
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cargohold.services.core.errors import TransportError
from cargohold.services.core.segment_spec import SegmentSpec, UpdateOutcome
from cargohold.services.core.update_call import IN_CALL, STAGED, CommitTerms, SharedRef, UpdateCall
from cargohold.services.core.wire import DEFAULT_CHUNK_BYTES, DTYPE_NAMES, WIRE_DTYPES
from cargohold.services.tiers.report import PartitionRow, TierSummary
from cargohold.services.transport import bulk_client
from cargohold.services.transport.auth import TlsFiles, bearer
from cargohold.services.transport.bulk import Direction, PeerGoneError, receive_tensor
from cargohold.services.transport.codec import (
    MAX_MESSAGE_BYTES,
    SERVICE_NAME,
    TensorAssembler,
    byte_chunks,
    check_chunk_bytes,
    commit_request,
    dtype_from_proto,
    dtype_to_proto,
    fill_chunk,
    new_buffer,
    partition_row_from_proto,
    push_header,
    raw_bytes,
    spec_from_proto,
    spec_to_proto,
    tier_summary_from_proto,
)
from cargohold.v1 import state_server_pb2 as pb
from cargohold.v1 import state_server_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)


class RemoteError(TransportError):
    """The server answered a call with a non-OK status."""

    def __init__(self, rpc: str, address: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{rpc} to {address} failed with {code.name}: {details}")
        self.rpc = rpc
        self.address = address
        self.code = code
        self.details = details

    def __reduce__(self):  # keep the fields when the error crosses a Ray actor boundary
        return (RemoteError, (self.rpc, self.address, self.code, self.details))


@dataclass(frozen=True, slots=True)
class ServerStats:
    segment_updates: dict[int, int]
    received_bytes: int
    sent_bytes: int
    updates_applied: int
    duplicate_pushes: int
    resident_bytes_by_tier: dict[str, int]
    metrics_address: str
    partitions: tuple[PartitionRow, ...] = ()
    """The tier planner's decision for every partition (one per segment without a budget)."""
    tier: TierSummary | None = None


class StateServerClient:
    """Blocking calls with a deadline each; thread-safe (one channel, many calls)."""

    def __init__(
        self,
        address: str,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        timeout_s: float = 120.0,
        auth_token: str | None = None,
        tls: TlsFiles | None = None,
        bulk: bool = False,
    ) -> None:
        """``bulk``: push and fetch over the server's bulk socket (a transfer negotiated
        with OpenBulk, its bytes on a socket of their own: services/transport/bulk.py)
        rather than in gRPC streams; shared memory, when a call names it, still wins. A
        server that serves no bulk socket answers the first OpenBulk with UNIMPLEMENTED, and
        the client streams over gRPC from then on. A transfer the bulk socket refuses
        before its hello checked out (RESOURCE_EXHAUSTED, or the connection refused or
        closed: strangers flooding the port can cause that) streams over gRPC instead,
        that call only. There ``timeout_s`` bounds each wait for the peer's progress, not
        the whole call."""
        check_chunk_bytes(chunk_bytes)  # now, not at the first push
        self.address = address
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s
        self.bulk = bulk
        self._token = auth_token
        self._bulk_tls = tls.client_context() if bulk and tls is not None else None
        self._metadata = bearer(auth_token) if auth_token is not None else ()
        options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ]
        self._channel = (
            grpc.secure_channel(address, tls.channel_credentials(), options=options)
            if tls is not None
            else grpc.insecure_channel(address, options=options)
        )
        self._stub = pb_grpc.StateServerStub(self._channel)
        # A push that names shared memory is its header alone. Sent as a unary call (the
        # same bytes on the wire: one message, then the end of the stream), it spares the
        # thread gRPC Python starts for every client stream to drain the request iterator.
        self._push_header = self._channel.unary_unary(
            f"/{pb.DESCRIPTOR.services_by_name['StateServer'].full_name}/PushGradient",
            request_serializer=pb.PushGradientRequest.SerializeToString,
            response_deserializer=pb.PushGradientResponse.FromString,
        )
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> StateServerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Block until the health service reports SERVING."""
        # wait_for_ready rather than channel_ready_future: a timed-out ready future stays
        # subscribed and its polling thread raises once the channel is closed.
        try:
            reply = self._health.Check(
                health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=timeout_s, wait_for_ready=True
            )
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise TransportError(f"state server {self.address} not reachable within {timeout_s}s") from error
            raise self._error("Health.Check", error) from error
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            raise TransportError(f"state server {self.address} is not serving: status {reply.status}")

    def register(self, spec: SegmentSpec, initial_weights: torch.Tensor) -> tuple[int, bool]:
        """Register a segment with its fp32 initial weights; returns (updates, created)."""

        def requests() -> Iterator[pb.RegisterShardRequest]:
            yield pb.RegisterShardRequest(spec=spec_to_proto(spec))
            for offset, data in byte_chunks(initial_weights, self.chunk_bytes):
                request = pb.RegisterShardRequest()
                fill_chunk(request.initial_weights, offset, data)
                yield request

        reply = self._call("RegisterShard", self._stub.RegisterShard, requests())
        return reply.step, reply.created

    def describe(self, run_id: str, segment_id: int) -> tuple[SegmentSpec, int]:
        reply = self._call(
            "DescribeShard",
            self._stub.DescribeShard,
            pb.DescribeShardRequest(key=pb.ShardKey(run_id=run_id, shard_id=segment_id)),
        )
        return spec_from_proto(reply.spec), reply.step

    def update(self, call: UpdateCall, gradient: torch.Tensor | None = None) -> UpdateOutcome:
        """Carry out ``call`` (services/core/update_call.py) on the server; harmless to repeat.
        A stage or apply call sends ``gradient`` (gRPC chunks or the bulk socket), or only
        says where it is in shared memory (``call.gradient``); a commit sends none. With
        ``call.weights_to`` the weights after the update are in that shared memory when
        this returns: written by the server in the same call, or fetched after it from a
        server that predates that."""
        if call.commits:
            reply = self._call("CommitStep", self._stub.CommitStep, commit_request(call))
            return self._updated(call, reply)
        assert gradient is not None, "a stage or apply call brings its gradient"
        wire_dtype = DTYPE_NAMES.get(gradient.dtype)
        if wire_dtype is None:
            raise TransportError(f"gradients travel as one of {sorted(WIRE_DTYPES)}, not {gradient.dtype}")
        header = push_header(call, wire_dtype)
        if isinstance(call.gradient, SharedRef):  # the header alone, as one message: no request-iterator thread
            reply = self._call("PushGradient", self._push_header, pb.PushGradientRequest(header=header))
            return self._updated(call, reply)
        if self.bulk:
            pushed = self._push_bulk(header, gradient)
            if pushed is not None:
                return pushed

        def requests() -> Iterator[pb.PushGradientRequest]:
            yield pb.PushGradientRequest(header=header)
            for offset, data in byte_chunks(gradient, self.chunk_bytes):
                request = pb.PushGradientRequest()  # filled in place: no merge copy of the chunk
                fill_chunk(request.chunk, offset, data)
                yield request

        return self._updated(call, self._call("PushGradient", self._stub.PushGradient, requests()))

    def _updated(self, call: UpdateCall, reply: pb.PushGradientResponse) -> UpdateOutcome:
        """The outcome of ``call``, its weights fetched into ``weights_to`` where the server did not write them."""
        if call.weights_to is not None and not reply.weights_written:
            to = (call.weights_to.path, call.weights_to.byte_offset)
            self.fetch(call.run_id, call.segment_id, call.update, str(call.weights_dtype), call.numel, shm=to)
        return UpdateOutcome(applied=reply.applied, updates=reply.step, seconds=reply.update_seconds)

    def push(
        self,
        run_id: str,
        segment_id: int,
        update: int,
        gradient: torch.Tensor,
        *,
        global_norm: float = 0.0,
        lr: float = 0.0,
        defer_update: bool = False,
        shm: tuple[str, int] | None = None,
        prepare: str | None = None,
        weights_to: tuple[str, int] | None = None,
    ) -> UpdateOutcome:
        """:meth:`update` with a gradient from the caller's memory (``shm``, ``weights_to``:
        the path and byte offset of its shared memory): staged with ``defer_update``, else
        applied (a shorthand for tests and benchmarks; the worker's port builds its calls)."""
        call = UpdateCall(
            run_id=run_id,
            segment_id=segment_id,
            update=update,
            numel=gradient.numel(),
            gradient=IN_CALL if shm is None else SharedRef(*shm),
            terms=None if defer_update else CommitTerms(lr=lr, global_norm=global_norm),
            weights_dtype=None if defer_update else prepare,
            weights_to=None if weights_to is None else SharedRef(*weights_to),
        )
        return self.update(call, gradient)

    def commit(
        self,
        run_id: str,
        segment_id: int,
        update: int,
        *,
        global_norm: float,
        lr: float,
        prepare: str | None = None,
        loss_scale: float = 1.0,
        weights_to: tuple[str, int] | None = None,
        numel: int = 0,
    ) -> UpdateOutcome:
        """:meth:`update` committing the gradient staged for ``update`` (a shorthand, as
        :meth:`push`; ``numel``: the segment's, needed with ``weights_to`` only)."""
        call = UpdateCall(
            run_id=run_id,
            segment_id=segment_id,
            update=update,
            numel=numel,
            gradient=STAGED,
            terms=CommitTerms(lr=lr, global_norm=global_norm, loss_scale=loss_scale),
            weights_dtype=prepare,
            weights_to=None if weights_to is None else SharedRef(*weights_to),
        )
        return self.update(call)

    def fetch(
        self,
        run_id: str,
        segment_id: int,
        update: int,
        dtype: str,
        numel: int,
        *,
        shm: tuple[str, int] | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """The weights after update ``update``; ``numel`` is what the caller expects to receive.

        With ``shm`` (path, byte offset) the server writes them into that shared memory
        and this returns None. With ``out`` (a contiguous CPU tensor of ``numel`` x
        ``dtype``, such as the segment's place in the caller's exchange buffer) the chunks are written
        straight into it and it is returned: no new tensor, no copy after; if the call
        fails, part of ``out`` may have been overwritten.
        """
        request = pb.FetchWeightsRequest(
            key=pb.ShardKey(run_id=run_id, shard_id=segment_id),
            step=update,
            dtype=dtype_to_proto(dtype),
            chunk_bytes=self.chunk_bytes,
            shm=_shm_ref(shm),
        )
        if shm is not None:
            try:
                reply = list(self._stub.FetchWeights(request, timeout=self.timeout_s, metadata=self._metadata))
            except grpc.RpcError as error:
                raise self._error("FetchWeights", error) from error
            if len(reply) != 1 or reply[0].numel != numel or reply[0].step != update:
                raise TransportError(f"FetchWeights to shared memory from {self.address}: unexpected reply")
            return None
        if self.bulk:
            fetched = self._fetch_bulk(request, numel, dtype, out)
            if fetched is not None:
                return fetched
        assembler = TensorAssembler(numel, dtype, what=f"segment {segment_id} weights from {self.address}", out=out)
        try:
            for message in self._stub.FetchWeights(request, timeout=self.timeout_s, metadata=self._metadata):
                if message.numel != numel or dtype_from_proto(message.dtype) != dtype or message.step != update:
                    raise TransportError(
                        f"FetchWeights from {self.address}: got {message.numel} x "
                        f"{dtype_from_proto(message.dtype)} of update {message.step}, expected "
                        f"{numel} x {dtype} of update {update}"
                    )
                assembler.add(message.chunk)  # reads the payload once
        except grpc.RpcError as error:
            raise self._error("FetchWeights", error) from error
        return assembler.finish()

    def _open_bulk(self, request: pb.OpenBulkRequest) -> pb.OpenBulkResponse | None:
        """The server's grant of a bulk transfer; None when the call streams over gRPC
        instead: from now on when the server serves no bulk socket
        (``tuning.state_server.data_plane: grpc``), this call only when it has granted all the
        transfers it may."""
        try:
            return self._call("OpenBulk", self._stub.OpenBulk, request)
        except RemoteError as error:
            if error.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                logger.info("%s: %s; this transfer streams over gRPC", self.address, error.details)
                return None
            if error.code != grpc.StatusCode.UNIMPLEMENTED:
                raise
            logger.info("%s serves no bulk socket: pushing and fetching over gRPC streams", self.address)
            self.bulk = False
            return None

    def _push_bulk(self, header: pb.PushHeader, gradient: torch.Tensor) -> UpdateOutcome | None:
        data = raw_bytes(gradient.contiguous())
        grant = self._open_bulk(pb.OpenBulkRequest(push=header, chunk_bytes=self.chunk_bytes))
        if grant is None:
            return None
        if grant.nbytes != len(data):
            raise TransportError(f"OpenBulk to {self.address} granted {grant.nbytes} bytes for a {len(data)}-byte push")
        connection = self._open_transfer("PushGradient", grant, Direction.PUSH, header.key, header.step)
        if connection is None:
            return None
        with self._bulk_call("PushGradient"), connection as sock:
            updates, applied, seconds = bulk_client.push(sock, data, grant.chunk_bytes)
        return UpdateOutcome(applied=applied, updates=updates, seconds=seconds)

    def _fetch_bulk(
        self, request: pb.FetchWeightsRequest, numel: int, dtype: str, out: torch.Tensor | None
    ) -> torch.Tensor | None:
        grant = self._open_bulk(pb.OpenBulkRequest(fetch=request, chunk_bytes=self.chunk_bytes))
        if grant is None:
            return None
        expected = numel * WIRE_DTYPES[dtype].itemsize
        if grant.nbytes != expected:  # refused before anything is allocated or read
            raise TransportError(
                f"FetchWeights from {self.address}: the server offers {grant.nbytes} bytes, "
                f"expected {numel} x {dtype} ({expected} bytes)"
            )
        connection = self._open_transfer("FetchWeights", grant, Direction.FETCH, request.key, request.step)
        if connection is None:
            return None
        what = f"segment {request.key.shard_id} weights from {self.address}"
        weights = new_buffer(numel, dtype, what=what, out=out)
        with self._bulk_call("FetchWeights"), connection as sock:
            receive_tensor(sock, raw_bytes(weights), grant.chunk_bytes, what=what)
        return weights

    def _open_transfer(
        self, rpc: str, grant: pb.OpenBulkResponse, direction: Direction, key: pb.ShardKey, update: int
    ) -> socket.socket | None:
        """The connection whose ticket the server accepted; None when the bulk socket
        refused it or closed it before the hello checked out (the call then streams over
        gRPC: a stranger must not fail it)."""
        host = self.address.rpartition(":")[0].strip("[]")
        with self._bulk_call(rpc):  # any other failure: as the gRPC call's
            try:
                return bulk_client.open_transfer(
                    host,
                    grant,
                    direction=direction,
                    key=key,
                    update=update,
                    token=self._token,
                    tls=self._bulk_tls,
                    timeout_s=self.timeout_s,
                )
            except bulk_client.StatusError as error:
                if error.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                reason = error.details
            except (PeerGoneError, ConnectionError, TimeoutError, ssl.SSLEOFError) as error:
                reason = str(error) or type(error).__name__  # refused, reset, closed, silent: not a bad certificate
        logger.info("%s: the bulk socket refused a transfer (%s); it streams over gRPC", self.address, reason)
        return None

    @contextmanager
    def _bulk_call(self, rpc: str) -> Iterator[None]:
        """The errors of a transfer on the bulk socket, as those of the gRPC call it replaces."""
        try:
            yield
        except bulk_client.StatusError as error:
            raise RemoteError(rpc, self.address, error.code, error.details) from None
        except (PeerGoneError, OSError) as error:  # OSError: a refused connection, a failed TLS handshake
            raise TransportError(f"{rpc} with {self.address} over the bulk socket failed: {error}") from error

    def stats(self, run_id: str = "") -> ServerStats:
        reply = self._call("GetStats", self._stub.GetStats, pb.GetStatsRequest(run_id=run_id))
        return ServerStats(
            segment_updates={s.key.shard_id: s.step for s in reply.shards},
            received_bytes=reply.received_bytes,
            sent_bytes=reply.sent_bytes,
            updates_applied=reply.updates_applied,
            duplicate_pushes=reply.duplicate_pushes,
            resident_bytes_by_tier=dict(reply.resident_bytes_by_tier),
            metrics_address=reply.metrics_address,
            partitions=tuple(partition_row_from_proto(p) for p in reply.partitions),
            tier=tier_summary_from_proto(reply.tier),
        )

    def _call(self, rpc: str, method, request):
        try:
            return method(request, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as error:
            raise self._error(rpc, error) from error

    def _error(self, rpc: str, error: grpc.RpcError) -> RemoteError:
        return RemoteError(rpc, self.address, error.code(), error.details() or "")


def _shm_ref(shm: tuple[str, int] | None) -> pb.SharedMemoryRef | None:
    return None if shm is None else pb.SharedMemoryRef(path=shm[0], byte_offset=shm[1])
