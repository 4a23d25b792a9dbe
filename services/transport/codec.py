"""Tensors to checksummed byte chunks and back, and proto <-> internal conversions (the
update call's among them: one encoding and one check for both ends).

The payload of a chunk is copied as little as protobuf (upb) allows. Sending: the tensor
slice into a ``bytes`` object (a bytes field accepts nothing else), that object into the
message (built in place: constructing a request from a finished chunk message would copy
it once more), and gRPC's serialisation. Receiving: gRPC's parse, one read of the field
(upb builds a new ``bytes`` object on *every* read, so it is read exactly once), and the
copy into its place in a preallocated tensor. CRC-32C runs over the ``bytes`` object in
place.
"""

from __future__ import annotations

from collections.abc import Iterator

import google_crc32c
import numpy as np
import torch

from cargohold.services.core.errors import InvalidTensorError, TruncatedStreamError
from cargohold.services.core.optim import AdamWHyperParams, UpdateGroup
from cargohold.services.core.segment_spec import SegmentSpec
from cargohold.services.core.state_precision import StateDtype
from cargohold.services.core.update_call import IN_CALL, STAGED, CommitTerms, SharedRef, UpdateCall
from cargohold.services.core.wire import DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES, MIN_CHUNK_BYTES, WIRE_DTYPES
from cargohold.services.tiers.planner import Bandwidth
from cargohold.services.tiers.report import PartitionRow, TierSummary
from cargohold.services.tiers.residency import PartitionKey, Residency
from cargohold.v1 import state_server_pb2 as pb

SERVICE_NAME = "cargohold.v1.StateServer"
"""The gRPC service, as health checks name it."""
MAX_MESSAGE_BYTES = MAX_CHUNK_BYTES + (1 << 16)
"""gRPC message limit on both ends: the largest chunk plus room for its envelope."""

_DTYPE_TO_PROTO: dict[str, pb.DType] = {
    "float32": pb.DTYPE_FLOAT32,
    "bfloat16": pb.DTYPE_BFLOAT16,
    "float16": pb.DTYPE_FLOAT16,
}
_PROTO_TO_DTYPE: dict[int, str] = {v: k for k, v in _DTYPE_TO_PROTO.items()}


class ChecksumError(InvalidTensorError):
    """A chunk's bytes do not match its CRC-32C."""


def dtype_to_proto(name: str) -> pb.DType:
    return _DTYPE_TO_PROTO[name]


def dtype_from_proto(value: int) -> str:
    name = _PROTO_TO_DTYPE.get(value)
    if name is None:
        raise InvalidTensorError(f"unsupported dtype enum value {value}; use FLOAT32 or BFLOAT16")
    return name


def prepare_dtype_from_proto(value: int) -> str | None:
    """The dtype a push asks the update to prepare the weights in; None when unset."""
    return None if value == pb.DTYPE_UNSPECIFIED else dtype_from_proto(value)


def check_chunk_bytes(chunk_bytes: int) -> None:
    """Refuse a chunk size outside MIN_CHUNK_BYTES..MAX_CHUNK_BYTES."""
    if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise InvalidTensorError(
            f"chunk_bytes must be between {MIN_CHUNK_BYTES} and {MAX_CHUNK_BYTES}, got {chunk_bytes}"
        )


def byte_chunks(tensor: torch.Tensor, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[tuple[int, bytes]]:
    """(byte offset, bytes) of each piece of a 1-D tensor's memory, made one at a time."""
    check_chunk_bytes(chunk_bytes)
    raw = tensor.detach().contiguous().view(torch.uint8).numpy()
    for offset in range(0, raw.size, chunk_bytes):
        yield offset, raw[offset : offset + chunk_bytes].tobytes()


def fill_chunk(chunk: pb.TensorChunk, byte_offset: int, data: bytes) -> None:
    """Set a TensorChunk in place (e.g. ``request.chunk``), with the CRC-32C of ``data``."""
    chunk.byte_offset = byte_offset
    chunk.data = data
    chunk.crc32c = google_crc32c.value(data)  # reads the bytes object in place, no copy


def new_buffer(numel: int, dtype: str, *, what: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """Where a tensor of ``numel`` x ``dtype`` is received: ``out`` when given (checked to
    be a contiguous CPU tensor of that size and dtype), else a new tensor."""
    if dtype not in WIRE_DTYPES:
        raise InvalidTensorError(f"{what}: dtype {dtype!r} is not one of {sorted(WIRE_DTYPES)}")
    if out is not None:
        if (
            out.dtype != WIRE_DTYPES[dtype]
            or out.shape != (numel,)
            or out.device.type != "cpu"
            or not out.is_contiguous()
        ):
            raise InvalidTensorError(
                f"{what}: the output tensor must be a contiguous CPU tensor of {numel} x {dtype}, "
                f"got {tuple(out.shape)} x {out.dtype} on {out.device}"
            )
        return out
    try:
        return torch.empty(numel, dtype=WIRE_DTYPES[dtype])
    except (RuntimeError, TypeError, OverflowError, MemoryError) as error:
        # The size comes from the sender (any uint64): one this host cannot hold is a
        # bad request (INVALID_ARGUMENT), not a server bug (INTERNAL).
        raise InvalidTensorError(
            f"{what}: cannot hold {numel} x {dtype} elements on this host "
            f"({type(error).__name__}: {str(error).splitlines()[0]})"
        ) from error


def raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The memory of a contiguous CPU tensor, as writable bytes (no copy)."""
    return tensor.detach().view(torch.uint8).numpy().data


class TensorAssembler:
    """Receives the chunks of one tensor in order into a preallocated buffer: a new one,
    or ``out`` (a 1-D contiguous CPU tensor of that dtype and size, e.g. the caller's own
    slice of a larger buffer; on a failure part of it may have been overwritten). Only the
    last chunk may be smaller than MIN_CHUNK_BYTES."""

    def __init__(self, numel: int, dtype: str, *, what: str, out: torch.Tensor | None = None) -> None:
        self.what = what
        self.tensor = new_buffer(numel, dtype, what=what, out=out)
        self._raw = self.tensor.detach().view(torch.uint8).numpy()
        self._received = 0

    @property
    def received_bytes(self) -> int:
        return self._received

    def add(self, chunk: pb.TensorChunk) -> int:
        """Check and place one chunk; returns its size in bytes."""
        data = chunk.data  # a new bytes object per read (upb): read it once
        byte_offset = chunk.byte_offset
        size = len(data)
        if byte_offset != self._received:
            raise InvalidTensorError(
                f"{self.what}: chunk at byte {byte_offset} arrived, expected byte {self._received}"
            )
        if self._received + size > self._raw.size:
            raise InvalidTensorError(
                f"{self.what}: {self._received + size} bytes received, more than the {self._raw.size} bytes declared"
            )
        if google_crc32c.value(data) != chunk.crc32c:
            raise ChecksumError(f"{self.what}: CRC-32C mismatch in chunk at byte {byte_offset}")
        if size < MIN_CHUNK_BYTES and self._received + size < self._raw.size:
            raise InvalidTensorError(
                f"{self.what}: a chunk of {size} bytes at byte {byte_offset}; chunks must be at least "
                f"{MIN_CHUNK_BYTES} bytes, all but the last"
            )
        self._raw[self._received : self._received + size] = np.frombuffer(data, dtype=np.uint8)
        self._received += size
        return size

    def finish(self) -> torch.Tensor:
        if self._received != self._raw.size:
            raise TruncatedStreamError(f"{self.what}: stream ended after {self._received} of {self._raw.size} bytes")
        return self.tensor


def spec_to_proto(spec: SegmentSpec) -> pb.ShardSpec:
    h = spec.hyper
    return pb.ShardSpec(
        key=pb.ShardKey(run_id=spec.run_id, shard_id=spec.segment_id),
        start=spec.start,
        numel=spec.numel,
        fragments=[
            pb.Fragment(offset=o, length=n, group=spec.fragment_group[i] if spec.groups else 0)
            for i, (o, n) in enumerate(spec.fragments)
        ],
        grad_dtype=dtype_to_proto(spec.grad_dtype),
        hyper=pb.AdamWHyperParams(
            beta1=h.beta1,
            beta2=h.beta2,
            eps=h.eps,
            weight_decay=h.weight_decay,
            max_grad_norm=h.max_grad_norm,
        ),
        groups=[pb.UpdateGroup(weight_decay=g.weight_decay, lr_scale=g.lr_scale) for g in spec.groups],
        state_dtype=_STATE_DTYPE_TO_PROTO[spec.state_dtype],
    )


def spec_from_proto(message: pb.ShardSpec) -> SegmentSpec:
    """Validate and convert; raises InvalidTensorError or ConfigError naming the field."""
    h = message.hyper
    return SegmentSpec(
        run_id=message.key.run_id,
        segment_id=message.key.shard_id,
        start=message.start,
        numel=message.numel,
        fragments=tuple((f.offset, f.length) for f in message.fragments),
        grad_dtype=dtype_from_proto(message.grad_dtype),
        hyper=AdamWHyperParams(
            beta1=h.beta1,
            beta2=h.beta2,
            eps=h.eps,
            weight_decay=h.weight_decay,
            max_grad_norm=h.max_grad_norm,
        ),
        groups=tuple(UpdateGroup(weight_decay=g.weight_decay, lr_scale=g.lr_scale) for g in message.groups),
        fragment_group=tuple(f.group for f in message.fragments) if message.groups else (),
        state_dtype=_state_dtype_from_proto(message.state_dtype),
    )


_STATE_DTYPE_TO_PROTO: dict[StateDtype, pb.StateDtype] = {
    "float32": pb.STATE_DTYPE_FLOAT32,
    "bfloat16": pb.STATE_DTYPE_BFLOAT16,
    "blockwise8": pb.STATE_DTYPE_BLOCKWISE8,
}
_PROTO_TO_STATE_DTYPE: dict[int, StateDtype] = {v: k for k, v in _STATE_DTYPE_TO_PROTO.items()}


def _state_dtype_from_proto(value: int) -> StateDtype:
    if value not in _PROTO_TO_STATE_DTYPE:
        raise InvalidTensorError(f"ShardSpec.state_dtype {value} is not one of {sorted(_PROTO_TO_STATE_DTYPE)}")
    return _PROTO_TO_STATE_DTYPE[value]


_RESIDENCY_TO_PROTO = {Residency.RAM: pb.RESIDENCY_RAM, Residency.NVME: pb.RESIDENCY_NVME}
_PROTO_TO_RESIDENCY = {v: k for k, v in _RESIDENCY_TO_PROTO.items()}


def partition_row_to_proto(row: PartitionRow) -> pb.PartitionPlan:
    return pb.PartitionPlan(
        key=pb.ShardKey(run_id=row.key.run_id, shard_id=row.key.segment_id),
        index=row.key.index,
        offset=row.offset,
        numel=row.numel,
        planned=_RESIDENCY_TO_PROTO[row.planned],
        actual=_RESIDENCY_TO_PROTO[row.actual],
        order=row.order,
        step=row.updates,
        path=row.path,
    )


def partition_row_from_proto(message: pb.PartitionPlan) -> PartitionRow:
    return PartitionRow(
        key=PartitionKey(message.key.run_id, message.key.shard_id, message.index),
        offset=message.offset,
        numel=message.numel,
        planned=_PROTO_TO_RESIDENCY[message.planned],
        actual=_PROTO_TO_RESIDENCY[message.actual],
        order=message.order,
        updates=message.step,
        path=message.path,
    )


def tier_summary_to_proto(summary: TierSummary) -> pb.TierPlanSummary:
    return pb.TierPlanSummary(
        enabled=summary.enabled,
        ram_budget_bytes=summary.ram_budget_bytes,
        staging_bytes=summary.staging_bytes,
        buffer_count=summary.buffer_count,
        ram_used_bytes=summary.ram_used_bytes,
        planned_ram_bytes=summary.planned_ram_bytes,
        planned_nvme_bytes=summary.planned_nvme_bytes,
        predicted_io_seconds=summary.predicted_io_seconds,
        paths=[
            pb.TierPath(
                path=path,
                direct_io=direct,
                read_bytes_per_s=bw.read_bytes_per_s,
                write_bytes_per_s=bw.write_bytes_per_s,
            )
            for path, direct, bw in zip(summary.paths, summary.direct_io, summary.bandwidth)
        ],
    )


def tier_summary_from_proto(message: pb.TierPlanSummary) -> TierSummary:
    return TierSummary(
        enabled=message.enabled,
        ram_budget_bytes=message.ram_budget_bytes,
        staging_bytes=message.staging_bytes,
        buffer_count=message.buffer_count,
        ram_used_bytes=message.ram_used_bytes,
        planned_ram_bytes=message.planned_ram_bytes,
        planned_nvme_bytes=message.planned_nvme_bytes,
        predicted_io_seconds=message.predicted_io_seconds,
        paths=tuple(p.path for p in message.paths),
        direct_io=tuple(p.direct_io for p in message.paths),
        bandwidth=tuple(Bandwidth(p.read_bytes_per_s, p.write_bytes_per_s) for p in message.paths),
    )


# --- the update call (services/core/update_call.py): one encoding for both ends ---------------


def _ref_to_proto(ref: SharedRef | None) -> pb.SharedMemoryRef | None:
    return None if ref is None else pb.SharedMemoryRef(path=ref.path, byte_offset=ref.byte_offset)


def _ref_from_proto(message: pb.SharedMemoryRef) -> SharedRef:
    return SharedRef(message.path, message.byte_offset)


def _weights_dtype_to_proto(dtype: str | None) -> pb.DType:
    return pb.DTYPE_UNSPECIFIED if dtype is None else dtype_to_proto(dtype)


def push_header(call: UpdateCall, grad_dtype: str) -> pb.PushHeader:
    """The PushGradient header of a call that brings its gradient (``grad_dtype``)."""
    assert not call.commits, "a commit is a CommitStep"
    terms = call.terms
    return pb.PushHeader(
        key=pb.ShardKey(run_id=call.run_id, shard_id=call.segment_id),
        step=call.update,
        dtype=dtype_to_proto(grad_dtype),
        numel=call.numel,
        global_grad_norm=terms.global_norm if terms is not None else 0.0,
        lr=terms.lr if terms is not None else 0.0,
        defer_update=call.stages,
        shm=_ref_to_proto(call.gradient if isinstance(call.gradient, SharedRef) else None),
        prepare_dtype=_weights_dtype_to_proto(call.weights_dtype),
        weights_out=_ref_to_proto(call.weights_to),
    )


def call_from_push_header(header: pb.PushHeader) -> UpdateCall:
    """The call a PushGradient header makes; a staging header's weight fields are ignored
    (the commit carries them). Raises InvalidTensorError when its fields do not go together."""
    stages = header.defer_update
    return UpdateCall(
        run_id=header.key.run_id,
        segment_id=header.key.shard_id,
        update=header.step,
        numel=header.numel,
        gradient=_ref_from_proto(header.shm) if header.HasField("shm") else IN_CALL,
        terms=None if stages else CommitTerms(lr=header.lr, global_norm=header.global_grad_norm),
        weights_dtype=None if stages else prepare_dtype_from_proto(header.prepare_dtype),
        weights_to=_ref_from_proto(header.weights_out) if header.HasField("weights_out") and not stages else None,
    )


def commit_request(call: UpdateCall) -> pb.CommitStepRequest:
    """The CommitStep request of a call that commits a staged gradient."""
    assert call.commits and call.terms is not None, "only a commit is a CommitStep"
    return pb.CommitStepRequest(
        key=pb.ShardKey(run_id=call.run_id, shard_id=call.segment_id),
        step=call.update,
        global_grad_norm=call.terms.global_norm,
        lr=call.terms.lr,
        prepare_dtype=_weights_dtype_to_proto(call.weights_dtype),
        loss_scale=0.0 if call.terms.loss_scale == 1.0 else call.terms.loss_scale,  # 0: unset, no scale
        weights_out=_ref_to_proto(call.weights_to),
    )


def call_from_commit(request: pb.CommitStepRequest, numel: int) -> UpdateCall:
    """The call a CommitStep request makes, for a segment of ``numel`` elements."""
    return UpdateCall(
        run_id=request.key.run_id,
        segment_id=request.key.shard_id,
        update=request.step,
        numel=numel,
        gradient=STAGED,
        terms=CommitTerms(lr=request.lr, global_norm=request.global_grad_norm, loss_scale=request.loss_scale or 1.0),
        weights_dtype=prepare_dtype_from_proto(request.prepare_dtype),
        weights_to=_ref_from_proto(request.weights_out) if request.HasField("weights_out") else None,
    )
