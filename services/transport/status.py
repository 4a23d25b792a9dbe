"""The gRPC status code of each cargohold error, shared by the gRPC face and the bulk
socket (which sends the same codes in its status frames, so a client sees the same
RemoteError whichever way the bytes went)."""

from __future__ import annotations

import grpc

from cargohold.services.core.errors import (
    CargoholdError,
    CorruptPartitionError,
    ForeignRunError,
    IncompleteUpdateError,
    InvalidTensorError,
    SegmentConflictError,
    ServerBusyError,
    TierError,
    TierSpaceError,
    UnknownSegmentError,
    UpdateMismatchError,
)
from cargohold.services.transport.codec import ChecksumError

_STATUS_OF_ERROR: tuple[tuple[type[CargoholdError], grpc.StatusCode], ...] = (
    (ChecksumError, grpc.StatusCode.DATA_LOSS),
    (CorruptPartitionError, grpc.StatusCode.DATA_LOSS),
    (TierSpaceError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ServerBusyError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (IncompleteUpdateError, grpc.StatusCode.FAILED_PRECONDITION),
    (TierError, grpc.StatusCode.UNAVAILABLE),
    (UnknownSegmentError, grpc.StatusCode.NOT_FOUND),
    (SegmentConflictError, grpc.StatusCode.ALREADY_EXISTS),
    (UpdateMismatchError, grpc.StatusCode.FAILED_PRECONDITION),
    (InvalidTensorError, grpc.StatusCode.INVALID_ARGUMENT),
    (ForeignRunError, grpc.StatusCode.PERMISSION_DENIED),
    (CargoholdError, grpc.StatusCode.INVALID_ARGUMENT),
)
_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def status_of(error: CargoholdError) -> grpc.StatusCode:
    """The status a call failing with ``error`` ends with."""
    return next(code for kind, code in _STATUS_OF_ERROR if isinstance(error, kind))


def status_number(code: grpc.StatusCode) -> int:
    """The code as it travels (gRPC's numbering: OK is 0)."""
    return code.value[0]


def status_from_number(number: int) -> grpc.StatusCode:
    """The code a number stands for; UNKNOWN for one gRPC does not define."""
    return _BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)
