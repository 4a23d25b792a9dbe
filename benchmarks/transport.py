"""Throughput of gradients and weights between a real state server and its client on
127.0.0.1, over gRPC streams and over the bulk socket, against raw TCP and memcpy of the
same bytes.

    python benchmarks/transport.py                    # 256 MB, chunks of 256 KiB, 1 MiB, 4 MiB
    python benchmarks/transport.py --megabytes 64 --chunks 1048576 --reps 2

The state server (``GrpcStateServer`` with its bulk socket, over a ``SegmentRegistry``, 1
torch thread as the config's default) runs in its own process, as it does under Ray; the
client (``StateServerClient``, ``bulk=False`` then ``bulk=True``) in this one. One fp32
segment of ``--megabytes`` is registered; for each path and chunk size the gradient is
pushed ``2 x --reps`` times, each push preparing the fp32 weights as a worker's and
OffloadedAdamW's pushes prepare their compute dtype, and each followed by a fetch of them
(into a new tensor, or into a preallocated one with ``fetch(out=...)``, as workers call
it). A push's wall time includes the server's Adam update, so the transfer time is the
wall time minus the ``update_seconds`` the server reports. Baselines in the same run: one
TCP connection on 127.0.0.1 (``sendall`` of the whole buffer, ``recv_into`` a
preallocated buffer in a thread; measured before, between and after the two paths, the
best of all, so that a moment of load on the shared box does not flatter the paths),
``torch`` ``copy_`` of the same bytes, and the floor of gRPC Python itself: a bare client
stream of the same bytes, pre-sliced, into a handler that only counts them (no protobuf,
checksums or tensors). Best of the repetitions throughout.

The stage table times, on one chunk in this process, each thing the gRPC push path does to
every chunk, and counts which of them copy the payload (the fetch path does the same
things in the other direction). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import threading
import time

import google_crc32c
import numpy as np
import torch
from timing import timed

from cargohold.services.core.optim import AdamWHyperParams
from cargohold.services.core.segment_spec import SegmentSpec
from cargohold.services.transport.codec import TensorAssembler, fill_chunk
from cargohold.services.transport.grpc_client import StateServerClient
from cargohold.v1 import state_server_pb2 as pb

RUN = "transport-bench"
MiB = 1 << 20


# --- the state server, in its own process -------------------------------------------
def serve(conn) -> None:
    """Child process: serve a registry on 127.0.0.1 until told to stop."""
    torch.set_num_threads(1)
    from cargohold.services.metrics.server import StateServerMetrics
    from cargohold.services.segments.segment_registry import SegmentRegistry
    from cargohold.services.server.grpc_server import GrpcStateServer

    server = GrpcStateServer(SegmentRegistry(), StateServerMetrics("bench"), run_id=RUN, host="127.0.0.1", bulk=True)
    server.start()
    bare = _bare_server()
    conn.send((server.address, f"127.0.0.1:{bare.port}"))
    conn.recv()  # any message: stop
    server.stop(grace=0)
    bare.stop(0).wait()


def _bare_server():
    """The floor of gRPC Python streaming: a client stream of raw bytes into a handler that
    only counts them (no protobuf, no checksum, no tensor)."""
    from concurrent import futures

    import grpc

    from cargohold.services.transport.codec import MAX_MESSAGE_BYTES

    def sink(requests, context) -> bytes:
        return str(sum(len(r) for r in requests)).encode()

    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=8),
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ],
    )
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("bench.Sink", {"Push": grpc.stream_unary_rpc_method_handler(sink)})]
    )
    server.port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server


def measure_bare_grpc(address: str, payload: torch.Tensor, chunk_sizes: list[int], reps: int) -> dict[int, float]:
    """Best seconds to stream the bytes, as pre-sliced bytes messages, to the bare sink."""
    import grpc

    from cargohold.services.transport.codec import MAX_MESSAGE_BYTES

    raw = payload.view(torch.uint8).numpy()
    results = {}
    for chunk in chunk_sizes:
        with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]) as channel:
            push = channel.stream_unary("/bench.Sink/Push")
            chunks = [raw[o : o + chunk].tobytes() for o in range(0, raw.size, chunk)]  # made before timing
            results[chunk] = min(
                timed(lambda push=push, chunks=chunks: push(iter(chunks), timeout=120)) for _ in range(reps)
            )
    return results


def measure_remote(
    address: str, gradient: torch.Tensor, chunk_sizes: list[int], reps: int, *, bulk: bool
) -> dict[int, dict[str, float]]:
    """Per chunk size: best push seconds (transfer only and with update) and fetch seconds,
    over gRPC streams or (``bulk``) the bulk socket. Every push prepares the fp32 weights
    (``prepare=``, as a worker and OffloadedAdamW ask for their compute dtype), so the
    fetch after it sends them without reading the state again."""
    numel = gradient.numel()
    segment_id = 0  # the same segment both ways: register() answers its current update
    spec = SegmentSpec(
        run_id=RUN,
        segment_id=segment_id,
        start=0,
        numel=numel,
        fragments=((0, numel),),
        grad_dtype="float32",
        hyper=AdamWHyperParams(),
    )
    with StateServerClient(address, chunk_bytes=4 * MiB) as client:
        client.wait_ready()
        step, _ = client.register(spec, gradient)
    results = {}
    for chunk in chunk_sizes:
        times: dict[str, list[float]] = {"push": [], "push+update": [], "fetch": [], "fetch into out": []}
        out = torch.ones(numel)  # a worker's exchange buffer, already touched
        with StateServerClient(address, chunk_bytes=chunk, bulk=bulk) as client:
            for _ in range(reps):
                for kind, into in (("fetch", None), ("fetch into out", out)):
                    step += 1
                    started = time.perf_counter()
                    outcome = client.push(RUN, segment_id, step, gradient, lr=1e-3, prepare="float32")
                    wall = time.perf_counter() - started
                    times["push+update"].append(wall)
                    times["push"].append(wall - outcome.seconds)
                    fetch = lambda s=step, o=into, c=client: c.fetch(RUN, segment_id, s, "float32", numel, out=o)  # noqa: E731
                    times[kind].append(timed(fetch))
        results[chunk] = {kind: min(seconds) for kind, seconds in times.items()}
    return results


def measure_shared_memory(address: str, gradient: torch.Tensor, reps: int) -> dict[str, float]:
    """The co-located path: the gradient already sits in the worker's shared memory (the
    reduce-scatter writes it there); push names it and the server updates straight from
    the mapping (push time = wall time minus the server's update seconds, as for gRPC; a
    staged push adds one copy into a buffer reused from step to step); fetch has the
    server write the weights into the worker's shared exchange buffer."""
    from cargohold.services.transport.shm import SharedRegion, region_name

    numel = gradient.numel()
    spec = SegmentSpec(
        run_id=RUN,
        segment_id=1,
        start=0,
        numel=numel,
        fragments=((0, numel),),
        grad_dtype="float32",
        hyper=AdamWHyperParams(),
    )
    region = SharedRegion.create(region_name(RUN, "bench"), 2 * numel * 4)
    try:
        region.tensor(torch.float32, 0, numel).copy_(gradient)
        path = region.path
        with StateServerClient(address) as client:
            client.wait_ready()
            step, _ = client.register(spec, gradient)
            pushes = []
            for _ in range(reps):
                step += 1
                started = time.perf_counter()
                outcome = client.push(RUN, 1, step, gradient, lr=1e-3, shm=(path, 0))
                pushes.append(time.perf_counter() - started - outcome.seconds)
            fetch = min(
                timed(lambda: client.fetch(RUN, 1, step, "float32", numel, shm=(path, numel * 4))) for _ in range(reps)
            )
        assert torch.isfinite(region.tensor(torch.float32, numel * 4, numel)).all()
    finally:
        region.close()
    return {"push": min(pushes), "fetch": fetch}


# --- baselines ----------------------------------------------------------------------
def measure_tcp(payload: torch.Tensor, reps: int) -> float:
    """Best seconds to move the bytes over one loopback TCP connection."""
    data = memoryview(payload.view(torch.uint8).numpy())
    sink = memoryview(np.ones(len(data), dtype=np.uint8))  # preallocated and touched
    done = threading.Semaphore(0)
    with socket.create_server(("127.0.0.1", 0)) as listener:

        def receive() -> None:
            conn, _ = listener.accept()
            with conn:
                for _ in range(reps):
                    got = 0
                    while got < len(sink):
                        got += conn.recv_into(sink[got:], min(len(sink) - got, 4 * MiB))
                    done.release()

        receiver = threading.Thread(target=receive, daemon=True)
        receiver.start()
        times = []
        with socket.create_connection(listener.getsockname()) as sender:
            for _ in range(reps):
                started = time.perf_counter()
                sender.sendall(data)
                done.acquire()
                times.append(time.perf_counter() - started)
        receiver.join()
    return min(times)


def measure_memcpy(payload: torch.Tensor, reps: int, threads: int) -> float:
    torch.set_num_threads(threads)
    target = torch.ones_like(payload)
    return min(timed(lambda: target.copy_(payload)) for _ in range(reps))


# --- where a push's CPU goes ----------------------------------------------------------
def stage_costs(gradient: torch.Tensor, chunk: int) -> list[tuple[str, str, float]]:
    """(stage, copies, seconds per chunk) of everything done to one chunk, as the code does it."""
    raw = gradient.view(torch.uint8).numpy()[:chunk]
    data = raw.tobytes()
    request = pb.PushGradientRequest()
    fill_chunk(request.chunk, 0, data)
    wire = request.SerializeToString()
    parsed = pb.PushGradientRequest.FromString(wire)
    target = TensorAssembler(chunk // 4, "float32", what="bench")

    def build() -> None:
        fill_chunk(pb.PushGradientRequest().chunk, 0, data)

    stages = [
        ("client: tensor slice .tobytes()", "1", lambda: raw.tobytes()),
        ("client: crc32c (over the bytes, in place)", "0 (read)", lambda: google_crc32c.value(data)),
        (
            "client: request.chunk filled in place",
            "1",
            lambda: pb.PushGradientRequest().chunk.__setattr__("data", data),
        ),
        ("client: fill_chunk (the two rows above)", "(counted)", build),
        ("client: grpc serializer SerializeToString", "1", lambda: request.SerializeToString()),
        ("kernel: loopback TCP send+recv", "2", None),
        ("server: grpc deserializer FromString", "1", lambda: pb.PushGradientRequest.FromString(wire)),
        ("server: TensorAssembler.add (1 read, crc, copy)", "2", lambda: _add(target, parsed.chunk)),
    ]
    return [(name, copies, min(timed(fn) for _ in range(20)) if fn else float("nan")) for name, copies, fn in stages]


def _add(assembler: TensorAssembler, chunk: pb.TensorChunk) -> None:
    assembler._received = 0  # replay the same chunk at offset 0
    assembler.add(chunk)


# --- output ---------------------------------------------------------------------------
def report(
    nbytes,
    remote: dict[str, dict[int, dict[str, float]]],
    bare,
    tcp,
    memcpy1,
    memcpy_all,
    threads,
    stages,
    stage_chunk,
    shared: dict[str, float],
) -> None:
    gbps = lambda seconds: nbytes / seconds / 1e9  # noqa: E731
    print(f"\n{nbytes / MiB:.0f} MiB of fp32 gradient, 127.0.0.1, best of the repetitions")
    print(f"{'path':34} {'seconds':>8} {'GB/s':>7} {'vs TCP':>7}")
    print(f"{'memcpy (torch copy_, 1 thread)':34} {memcpy1:8.3f} {gbps(memcpy1):7.2f} {tcp / memcpy1:7.2f}")
    label = f"memcpy (torch copy_, {threads} threads)"
    print(f"{label:34} {memcpy_all:8.3f} {gbps(memcpy_all):7.2f} {tcp / memcpy_all:7.2f}")
    print(f"{'raw TCP (sendall / recv_into)':34} {tcp:8.3f} {gbps(tcp):7.2f} {1.0:7.2f}")
    for chunk, seconds in bare.items():
        label = f"bare gRPC stream ({chunk // 1024} KiB msgs)"
        print(f"{label:34} {seconds:8.3f} {gbps(seconds):7.2f} {tcp / seconds:7.2f}")
    for path, results in remote.items():
        for chunk, r in results.items():
            for kind in ("push", "push+update", "fetch", "fetch into out"):
                label = f"{path} {kind} ({chunk // 1024} KiB)"
                print(f"{label:34} {r[kind]:8.3f} {gbps(r[kind]):7.2f} {tcp / r[kind]:7.2f}")
    for path, results in remote.items():
        best = min(results.items(), key=lambda kv: kv[1]["push"])
        print(
            f"RATIO {path} push / TCP = {tcp / best[1]['push']:.2f} (best chunk {best[0] // 1024} KiB), "
            f"{path} fetch / TCP = {tcp / min(r['fetch'] for r in results.values()):.2f} "
            f"(into out: {tcp / min(r['fetch into out'] for r in results.values()):.2f}); goal >= 0.8"
        )
    grpc_push = min(r["push"] for r in remote["gRPC"].values())
    print(
        f"RATIO gRPC push / bare gRPC stream = {min(bare.values()) / grpc_push:.2f} "
        "(what cargohold's own encoding costs on top of gRPC Python)"
    )
    print(f"RATIO TCP / memcpy(1 thread) = {memcpy1 / tcp:.2f}")
    for kind, seconds in shared.items():
        print(
            f"{'co-located ' + kind + ' (shared memory)':34} {seconds:8.3f} {gbps(seconds):7.2f} {tcp / seconds:7.2f}"
        )
    print(
        f"RATIO co-located push / memcpy(1 thread) = {memcpy1 / shared['push']:.2f}, "
        f"co-located fetch / memcpy(1 thread) = {memcpy1 / shared['fetch']:.2f}; goal >= 0.9"
    )

    per_mib = stage_chunk / MiB
    print(f"\nWhere a push's CPU goes, per {stage_chunk // 1024} KiB chunk (timed alone in this process):")
    print(f"{'stage':50} {'copies':>14} {'us/MiB':>8} {'GB/s':>6}")
    client = server = 0.0
    for name, copies, seconds in stages:
        if seconds != seconds:  # nan: not timed here
            print(f"{name:50} {copies:>14} {'-':>8} {'-':>6}")
            continue
        us = seconds / per_mib * 1e6
        print(f"{name:50} {copies:>14} {us:8.0f} {stage_chunk / seconds / 1e9:6.2f}")
        if name.startswith("client") and copies != "(counted)":
            client += us
        elif name.startswith("server"):
            server += us
    push_us = grpc_push / (nbytes / MiB) * 1e6
    print(
        f"CPU per MiB moved: client {client:.0f} us, server {server:.0f} us (SegmentState.push adds none: "
        f"an fp32 gradient is used in place); measured: push {push_us:.0f} us/MiB, bare gRPC stream "
        f"{min(bare.values()) / (nbytes / MiB) * 1e6:.0f} us/MiB, raw TCP {tcp / (nbytes / MiB) * 1e6:.0f} us/MiB"
    )
    print(
        "Copies of the payload per gRPC push: client 3 (tobytes, into the request built in place, serialize), "
        "kernel 2, server 3 (parse, the one read of chunk.data, into the assembled tensor) = 8. "
        "Per gRPC fetch of prepared weights: server 3 (tobytes, into the message, serialize), "
        "kernel 2, client 3 (parse, one read, into the tensor, or straight into the caller's out=) = 8. "
        "Over the bulk socket: the kernel's 2 each way (sendall from the tensor, recv_into the pooled "
        "buffer or out=), plus one read of each side for the CRC-32C; 1 with shared memory."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=int, default=256, help="gradient size in MiB")
    parser.add_argument("--chunks", default=f"{256 * 1024},{MiB},{4 * MiB}", help="chunk sizes in bytes")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    threads = os.cpu_count() or 1
    chunk_sizes = [int(c) for c in args.chunks.split(",")]
    gradient = torch.randn(args.megabytes * MiB // 4, generator=torch.Generator().manual_seed(0)) * 1e-3
    nbytes = gradient.numel() * 4

    stages = stage_costs(gradient, MiB)
    memcpy1 = measure_memcpy(gradient, args.reps, 1)
    memcpy_all = measure_memcpy(gradient, args.reps, threads)
    torch.set_num_threads(1)
    tcp = [measure_tcp(gradient, args.reps)]  # again between and after the paths: the best of all

    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    server = context.Process(target=serve, args=(child,), daemon=True)
    server.start()
    try:
        address, bare_address = parent.recv()
        bare = measure_bare_grpc(bare_address, gradient, chunk_sizes, args.reps)
        grpc_results = measure_remote(address, gradient, chunk_sizes, args.reps, bulk=False)
        tcp.append(measure_tcp(gradient, args.reps))
        bulk_results = measure_remote(address, gradient, chunk_sizes, args.reps, bulk=True)
        tcp.append(measure_tcp(gradient, args.reps))
        shared = measure_shared_memory(address, gradient, args.reps)
    finally:
        parent.send("stop")
        server.join(timeout=30)
        if server.is_alive():
            server.terminate()
            server.join()
    remote = {"gRPC": grpc_results, "bulk": bulk_results}
    report(nbytes, remote, bare, min(tcp), memcpy1, memcpy_all, threads, stages, MiB, shared)


if __name__ == "__main__":
    main()
