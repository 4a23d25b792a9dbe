"""The client's half of the bulk socket (wire format: services/transport/bulk.py): redeem
a ticket OpenBulk granted, then push or fetch one tensor's bytes."""

from __future__ import annotations

import socket
import ssl

import grpc

from cargohold.services.core.errors import TransportError
from cargohold.services.core.wire import MAX_CHUNK_BYTES, MIN_CHUNK_BYTES
from cargohold.services.transport.bulk import (
    OUTCOME,
    TICKET_BYTES,
    Direction,
    connect,
    pack_hello,
    read_status,
    send_buffers,
    send_tensor,
    transfer_mac,
)
from cargohold.services.transport.status import status_from_number
from cargohold.v1 import state_server_pb2 as pb


class StatusError(Exception):
    """The server ended the transfer with this status (the caller makes it a RemoteError)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


def open_transfer(
    host: str,
    grant: pb.OpenBulkResponse,
    *,
    direction: Direction,
    key: pb.ShardKey,
    update: int,
    token: str | None,
    tls: ssl.SSLContext | None,
    timeout_s: float,
) -> socket.socket:
    """A connection to the server's bulk socket whose ticket the server accepted; its
    sends and receives fail after ``timeout_s`` without progress."""
    if len(grant.ticket) != TICKET_BYTES or not MIN_CHUNK_BYTES <= grant.chunk_bytes <= MAX_CHUNK_BYTES:
        raise TransportError(f"OpenBulk answered with an unusable grant (chunk_bytes {grant.chunk_bytes})")
    sock = connect(host, grant.port, tls=tls, timeout_s=timeout_s)
    try:
        mac = transfer_mac(token, grant.ticket, direction, key.run_id, key.shard_id, update, grant.nbytes)
        send_buffers(sock, [pack_hello(grant.ticket, mac)])
        expect_ok(sock)
        return sock
    except BaseException:
        sock.close()
        raise


def push(sock: socket.socket, data: memoryview, chunk_bytes: int) -> tuple[int, bool, float]:
    """Send the gradient's body; (updates, applied, update seconds) as the server answers."""
    send_tensor(sock, data, chunk_bytes)
    details = expect_ok(sock)
    if len(details) != OUTCOME.size:
        raise TransportError(f"the push's outcome has {len(details)} bytes, not {OUTCOME.size}")
    updates, applied, seconds = OUTCOME.unpack(details)
    return updates, applied, seconds


def expect_ok(sock: socket.socket) -> bytes:
    """The details of the next status frame if it is OK; StatusError otherwise."""
    code, details = read_status(sock)
    if code != 0:
        raise StatusError(status_from_number(code), details.decode("utf-8", "replace"))
    return details
