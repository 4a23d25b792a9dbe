"""The bulk data plane's wire format: one tensor per TCP (or TLS) connection, its bytes
moved straight between the tensor's memory and the socket (``sendmsg``, ``recv_into``).

Why a socket of its own: gRPC Python copies every chunk several times (protobuf, its
own buffers) and handles each message under the GIL; a bare gRPC stream of raw bytes
reached only about half of loopback TCP (docs/benchmarks.md, Transport). gRPC stays the
control plane: ``OpenBulk`` checks the token, validates the transfer exactly as a
PushGradient header or a FetchWeights request, and answers with a one-time ticket for it.

One connection carries one transfer; integers are little-endian:

    client -> server  hello    b"CGHB", version (u8), 3 zero bytes, the ticket (16 bytes),
                               HMAC-SHA256 of the transfer keyed by the token (32 bytes)
    server -> client  status   code (u8: gRPC's numbering, 0 = OK), length (u32), details
    body                       the tensor's bytes, then the CRC-32C (u32) of each of its
                               chunks of the granted size: client -> server for a push,
                               server -> client for a fetch
    server -> client  status   (push only) OK with the outcome, updates (u64), applied
                               (u8) and update seconds (f64); or an error and its details

The server reads nothing past the hello before the ticket and its MAC check out; the
receiver of a body writes it into a buffer of exactly the granted size, allocated before
the first byte, and uses none of it before every checksum matched. The bytes go in one
``sendall`` straight from the tensor and arrive by ``recv_into`` straight into it, as raw
TCP would move them. The sender's checksums run on a helper thread meanwhile (``crc32c``
releases the GIL); the receiver's on each piece as it lands, still in cache.
Measured in docs/benchmarks.md (Transport) against other framings.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import socket
import ssl
import struct
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from cargohold.services.core.checksum import crc32c
from cargohold.services.core.errors import TransportError
from cargohold.services.transport.codec import ChecksumError

MAGIC = b"CGHB"
VERSION = 1
TICKET_BYTES = 16
HELLO = struct.Struct("<4sB3x16s32s")
STATUS = struct.Struct("<BI")
OUTCOME = struct.Struct("<Q?d")
MAX_DETAILS_BYTES = 4096
"""Longest status details either end sends or accepts."""
_CRC = struct.Struct("<I")
_TRANSFER = struct.Struct("<BIQQ")
RECEIVE_BYTES = 256 << 10
"""Most bytes one ``recv_into`` asks for: what the checksum then reads stays in L2."""
_TIMEVAL = struct.Struct("@ll")
_CHECKSUMS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="bulk-crc")
"""Computes senders' checksums (one task per transfer)."""


class Direction(enum.IntEnum):
    PUSH = 1
    FETCH = 2


class PeerGoneError(TransportError):
    """The other end closed the connection, reset it, or sent nothing for too long."""


def transfer_mac(
    token: str | None, ticket: bytes, direction: Direction, run_id: str, segment_id: int, update: int, nbytes: int
) -> bytes:
    """What the hello proves: the sender holds the token, for this ticket and transfer.
    Without a token (auth off) the key is empty and the ticket alone admits."""
    message = _TRANSFER.pack(direction, segment_id, update, nbytes) + ticket + run_id.encode()
    return hmac.new((token or "").encode(), message, hashlib.sha256).digest()


def pack_hello(ticket: bytes, mac: bytes) -> bytes:
    return HELLO.pack(MAGIC, VERSION, ticket, mac)


def unpack_hello(hello: bytes) -> tuple[bytes, bytes] | None:
    """(ticket, MAC), or None for bytes that are not a hello of this version."""
    magic, version, ticket, mac = HELLO.unpack(hello)
    return (ticket, mac) if (magic, version) == (MAGIC, VERSION) else None


def send_status(sock: socket.socket, code: int, details: bytes = b"") -> None:
    details = details[:MAX_DETAILS_BYTES]
    send_buffers(sock, [STATUS.pack(code, len(details)), details])


def read_status(sock: socket.socket) -> tuple[int, bytes]:
    """(code, details) of the next status frame."""
    header = bytearray(STATUS.size)
    receive_exactly(sock, memoryview(header))
    code, length = STATUS.unpack(header)
    if length > MAX_DETAILS_BYTES:
        raise TransportError(f"a status frame announced {length} bytes of details; at most {MAX_DETAILS_BYTES}")
    details = bytearray(length)
    receive_exactly(sock, memoryview(details))
    return code, bytes(details)


def send_tensor(sock: socket.socket, data: memoryview, chunk_bytes: int) -> None:
    """The body: ``data`` in one ``sendall`` (the kernel loops, not Python), then the
    CRC-32C of each chunk, computed meanwhile on a helper thread."""
    checksums = _CHECKSUMS.submit(_chunk_checksums, data, chunk_bytes)
    try:
        _send(sock, data)
    finally:
        crcs = checksums.result()  # the helper reads ``data``: wait for it whatever happened
    _send(sock, b"".join(_CRC.pack(crc) for crc in crcs))


def _chunk_checksums(data: memoryview, chunk_bytes: int) -> list[int]:
    return [crc32c(data[start : start + chunk_bytes]) for start in range(0, len(data), chunk_bytes)]


def receive_tensor(sock: socket.socket, data: memoryview, chunk_bytes: int, *, what: str) -> None:
    """Fill ``data`` with a body :func:`send_tensor` sent; ChecksumError names the first
    chunk whose bytes do not match the sender's CRC-32C, PeerGoneError says how far it got
    when the connection ends or stalls first. Received a ``RECEIVE_BYTES`` piece at a
    time, each checksummed at once while it is still in cache (measured: 15-25% less CPU
    on this side than checksumming whole chunks afterwards on a helper thread)."""
    computed = []
    got = 0
    try:
        for start in range(0, len(data), chunk_bytes):
            end = min(start + chunk_bytes, len(data))
            crc = 0
            while got < end:
                piece = data[got : min(got + RECEIVE_BYTES, end)]
                received = _receive_some(sock, piece)
                crc = crc32c(piece[:received], crc)
                got += received
            computed.append(crc)
        trailer = bytearray(_CRC.size * len(computed))
        receive_exactly(sock, memoryview(trailer))
    except PeerGoneError as error:
        raise PeerGoneError(f"{error} after {got} of {len(data)} bytes") from error
    for index, ((sent,), crc) in enumerate(zip(_CRC.iter_unpack(trailer), computed)):
        if sent != crc:
            raise ChecksumError(f"{what}: CRC-32C mismatch in the chunk at byte {index * chunk_bytes}")


def receive_exactly(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from the socket; PeerGoneError if it closes or stalls first."""
    got = 0
    while got < len(view):
        got += _receive_some(sock, view[got:])


def _receive_some(sock: socket.socket, view: memoryview) -> int:
    try:
        n = sock.recv_into(view)
    except OSError as error:  # a reset, no data within the socket's timeout, a TLS failure
        raise PeerGoneError(_failure(sock, error, "sent")) from error
    if n == 0:
        raise PeerGoneError("the peer closed the connection")
    return n


def send_buffers(sock: socket.socket, buffers: Sequence[bytes | memoryview]) -> None:
    """Send ``buffers`` back to back (small ones: a hello, a status frame)."""
    _send(sock, b"".join(buffers))


def _send(sock: socket.socket, data: bytes | memoryview) -> None:
    try:
        sock.sendall(data)
    except OSError as error:
        raise PeerGoneError(_failure(sock, error, "took")) from error


def _failure(sock: socket.socket, error: OSError, verb: str) -> str:
    if isinstance(error, (BlockingIOError, TimeoutError, ssl.SSLWantReadError, ssl.SSLWantWriteError)):
        return f"the peer {verb} no data for {stall_timeout(sock):g} s"
    return f"the connection failed ({error.strerror or error})"


def set_stall_timeout(sock: socket.socket, seconds: float) -> None:
    """Fail a send or receive that makes no progress for ``seconds``. Set in the kernel
    (SO_RCVTIMEO, SO_SNDTIMEO) on a blocking socket: Python's own timeouts would poll
    before every call and cut each large send into the socket buffer's size."""
    sock.settimeout(None)
    whole = int(seconds)
    value = _TIMEVAL.pack(whole, max(int((seconds - whole) * 1e6), 0 if whole else 1000))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


def stall_timeout(sock: socket.socket) -> float:
    seconds, micros = _TIMEVAL.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _TIMEVAL.size))
    return seconds + micros / 1e6


def connect(host: str, port: int, *, tls: ssl.SSLContext | None, timeout_s: float) -> socket.socket:
    """A connection to a bulk socket whose sends and receives fail after ``timeout_s``
    without progress."""
    sock = socket.create_connection((host, port), timeout=timeout_s)
    try:
        configure(sock, timeout_s)
        return tls.wrap_socket(sock, server_hostname=host) if tls is not None else sock
    except BaseException:
        sock.close()
        raise


def configure(sock: socket.socket, timeout_s: float) -> None:
    """Either end's settings of a fresh connection."""
    set_stall_timeout(sock, timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a status frame must not wait for an ACK
