"""Peers of a state server's bulk socket for the tests: the real client's steps one at a
time (a ticket from OpenBulk, the connection and its hello, part of a body), hand-made
frames the client would never send, and processes to kill mid-transfer.

Run as a script it is one of those processes (see :func:`spawn`):

    python tests/bulk_peers.py serve NUMEL          a state server (bulk socket on) with a
                                                    registered segment; prints its address
    python tests/bulk_peers.py half-push ADDRESS    starts a push, sends half its body,
                                                    prints "half", then waits to be killed
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from transport_server import (
    CHUNK_BYTES,
    DEADLINE_S,
    G1,
    GLOBAL_NORM,
    LR,
    NUMEL,
    RUN,
    W0,
    make_spec,
    randn,
)

from cargohold.services.core.checksum import crc32c
from cargohold.services.transport import bulk_client
from cargohold.services.transport.bulk import (
    Direction,
    configure,
    pack_hello,
    read_status,
    send_buffers,
    transfer_mac,
)
from cargohold.services.transport.codec import raw_bytes
from cargohold.services.transport.grpc_client import StateServerClient
from cargohold.services.transport.status import status_from_number
from cargohold.v1 import state_server_pb2 as pb


def push_request(step: int, *, numel: int = NUMEL, chunk_bytes: int = CHUNK_BYTES, **fields) -> pb.OpenBulkRequest:
    values = dict(
        key=pb.ShardKey(run_id=RUN, shard_id=0),
        step=step,
        dtype=pb.DTYPE_FLOAT32,
        numel=numel,
        global_grad_norm=GLOBAL_NORM,
        lr=LR,
    )
    header = pb.PushHeader(**{**values, **fields})
    return pb.OpenBulkRequest(push=header, chunk_bytes=chunk_bytes)


def fetch_request(step: int, dtype: int = pb.DTYPE_FLOAT32, *, chunk_bytes: int = CHUNK_BYTES) -> pb.OpenBulkRequest:
    fetch = pb.FetchWeightsRequest(key=pb.ShardKey(run_id=RUN, shard_id=0), step=step, dtype=dtype)
    return pb.OpenBulkRequest(fetch=fetch, chunk_bytes=chunk_bytes)


def grant_for(client: StateServerClient, request: pb.OpenBulkRequest) -> pb.OpenBulkResponse:
    """A ticket, as the client asks for one."""
    return client._call("OpenBulk", client._stub.OpenBulk, request)


def host_of(address: str) -> str:
    return address.rpartition(":")[0]


@contextmanager
def dialled(address: str, grant: pb.OpenBulkResponse):
    """A plain connection to the bulk socket of the server at ``address``."""
    sock = socket.create_connection((host_of(address), grant.port), timeout=DEADLINE_S)
    configure(sock, DEADLINE_S)
    with sock:
        yield sock


def hello(grant: pb.OpenBulkResponse, direction: Direction, step: int, *, token: str | None = None) -> bytes:
    """The hello the real client sends for ``grant``."""
    mac = transfer_mac(token, grant.ticket, direction, RUN, 0, step, grant.nbytes)
    return pack_hello(grant.ticket, mac)


def status_of(sock: socket.socket) -> tuple[object, str]:
    """(gRPC status code, details) of the next status frame."""
    code, details = read_status(sock)
    return status_from_number(code), details.decode()


def body(tensor: torch.Tensor, chunk_bytes: int = CHUNK_BYTES, *, flip_at: int | None = None) -> bytes:
    """A tensor's body as the sender frames it, checksums taken before ``flip_at`` (a byte
    offset) is flipped."""
    data = bytearray(raw_bytes(tensor.clone()))
    crcs = [crc32c(memoryview(data)[start : start + chunk_bytes]) for start in range(0, len(data), chunk_bytes)]
    if flip_at is not None:
        data[flip_at] ^= 0x01
    return bytes(data) + b"".join(struct.pack("<I", crc) for crc in crcs)


def closed_by_peer(sock: socket.socket) -> bool:
    """True once the peer has closed its side (reading gives nothing)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


# --- processes to kill mid-transfer -------------------------------------------------


def spawn(*args: str) -> tuple[subprocess.Popen, str]:
    """Start ``python tests/bulk_peers.py ARGS``; (the process, the first line it prints)."""
    here = Path(__file__).resolve()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(here.parent), os.environ.get("PYTHONPATH")]))}
    process = subprocess.Popen([sys.executable, str(here), *args], stdout=subprocess.PIPE, text=True, env=env)
    assert process.stdout is not None
    line = process.stdout.readline().strip()
    assert line, f"{args[0]} printed nothing (exit status {process.poll()})"
    return process, line


def _serve(numel: int) -> None:
    from cargohold.services.metrics.server import StateServerMetrics
    from cargohold.services.segments.segment_registry import SegmentRegistry
    from cargohold.services.server.grpc_server import GrpcStateServer

    server = GrpcStateServer(SegmentRegistry(), StateServerMetrics("peer"), run_id=RUN, host="127.0.0.1", bulk=True)
    server.start()
    with StateServerClient(server.address, timeout_s=DEADLINE_S) as client:
        client.register(make_spec(numel=numel, fragments=((0, numel),)), W0 if numel == NUMEL else randn(0, numel))
    print(server.address, flush=True)
    time.sleep(3600)


def _half_push(address: str) -> None:
    with StateServerClient(address, chunk_bytes=CHUNK_BYTES, timeout_s=DEADLINE_S, bulk=True) as client:
        grant = grant_for(client, push_request(1))
        with bulk_client.open_transfer(
            host_of(address),
            grant,
            direction=Direction.PUSH,
            key=pb.ShardKey(run_id=RUN, shard_id=0),
            update=1,
            token=None,
            tls=None,
            timeout_s=DEADLINE_S,
        ) as sock:
            send_buffers(sock, [raw_bytes(G1)[: grant.nbytes // 2]])
            print("half", flush=True)
            time.sleep(3600)


if __name__ == "__main__":
    command, argument = sys.argv[1:3]
    if command == "serve":
        _serve(int(argument))
    elif command == "half-push":
        _half_push(argument)
    else:
        raise SystemExit(f"unknown command {command!r}")
