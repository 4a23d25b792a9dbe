"""What a state-server call costs beyond its bytes: wall time and CPU of both processes
for each call a co-located worker makes in a staged step, against a bare gRPC unary call.

    python benchmarks/control_path.py                  # 8 segments, 300 steps
    python benchmarks/control_path.py --steps 100 --segments 16

A co-located worker's step makes, for each segment, a staged push (a header naming the
gradient in its shared memory) and a commit that writes the weights back into it
(``weights_out``); gRPC carries only the call. On the demo model that is 32 calls a step,
and the state server's CPU is mostly their handling. This benchmark replays that pattern
on segments of ``--numel`` fp32 elements (small, so the bytes and the update do not
dominate), between a client in this process and a real state server (``GrpcStateServer``
over a ``SegmentRegistry``, 1 torch thread) in its own process, as under Ray.

Baseline in the same run and the same server process: a bare gRPC unary call (empty
request, empty reply, no interceptor, no auth), the floor of gRPC Python for one call.
CPU is read from ``/proc/<pid>/stat`` (server) and ``time.process_time`` (client) at the
edges of each timed window, nothing sampled inside it. Prints each call's wall and CPU
and its ratio to the bare call's.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time
from collections.abc import Callable

import grpc
import torch
from timing import cpu_seconds

from cargohold.services.core.optim import AdamWHyperParams
from cargohold.services.core.segment_spec import SegmentSpec
from cargohold.services.transport.grpc_client import StateServerClient
from cargohold.services.transport.shm import SharedRegion, region_name

RUN = "control-path-bench"


def serve(conn) -> None:
    """Child process: a state server and a bare unary server on 127.0.0.1 until told to stop."""
    from concurrent import futures

    from cargohold.services.metrics.server import StateServerMetrics
    from cargohold.services.segments.segment_registry import SegmentRegistry
    from cargohold.services.server.grpc_server import GrpcStateServer

    torch.set_num_threads(1)
    server = GrpcStateServer(SegmentRegistry(), StateServerMetrics("bench"), run_id=RUN, host="127.0.0.1")
    server.start()
    bare = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    bare.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "bench.Bare", {"Call": grpc.unary_unary_rpc_method_handler(lambda request, context: b"")}
            )
        ]
    )
    port = bare.add_insecure_port("127.0.0.1:0")
    bare.start()
    conn.send((server.address, f"127.0.0.1:{port}", os.getpid()))
    conn.recv()  # any message: stop
    server.stop(grace=0)
    bare.stop(0).wait()


class Window:
    """Wall time and the CPU of this process and the server's over a run of ``calls``
    calls (a tick of /proc is 10 ms: runs are long enough that it does not matter)."""

    def __init__(self, server_pid: int) -> None:
        self.server_pid = server_pid

    def measure(self, run: Callable[[], int]) -> dict[str, float]:
        server0, client0, wall0 = sum(cpu_seconds(self.server_pid)), time.process_time(), time.perf_counter()
        calls = run()
        wall, client, server = (
            time.perf_counter() - wall0,
            time.process_time() - client0,
            sum(cpu_seconds(self.server_pid)) - server0,
        )
        return {
            "calls": calls,
            "wall_us": wall / calls * 1e6,
            "client_us": client / calls * 1e6,
            "server_us": server / calls * 1e6,
        }


def bare_calls(channel: grpc.Channel, count: int) -> Callable[[], int]:
    """``count`` bare unary calls on ``channel``, one after another."""
    call = channel.unary_unary("/bench.Bare/Call")

    def run() -> int:
        for _ in range(count):
            call(b"", timeout=30)
        return count

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--segments", type=int, default=8)
    parser.add_argument("--numel", type=int, default=4096, help="fp32 elements a segment")
    parser.add_argument("--repeat", type=int, default=3, help="windows of each kind; the best is printed")
    args = parser.parse_args()
    torch.set_num_threads(1)
    numel, segments = args.numel, args.segments
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    server = context.Process(target=serve, args=(child,), daemon=True)
    server.start()
    region = SharedRegion.create(region_name(RUN, "bench"), 2 * segments * numel * 4)
    try:
        address, bare_address, server_pid = parent.recv()
        window = Window(server_pid)
        grads = region.tensor(torch.float32, 0, segments * numel)
        grads.copy_(torch.randn(segments * numel, generator=torch.Generator().manual_seed(0)) * 1e-3)
        weights_at = segments * numel * 4
        with StateServerClient(address) as client, grpc.insecure_channel(bare_address) as bare_channel:
            client.wait_ready()
            for segment in range(segments):
                spec = SegmentSpec(
                    run_id=RUN,
                    segment_id=segment,
                    start=segment * numel,
                    numel=numel,
                    fragments=((0, numel),),
                    grad_dtype="float32",
                    hyper=AdamWHyperParams(),
                )
                client.register(spec, torch.zeros(numel))
            step = 0

            def staged_steps() -> int:
                nonlocal step
                for _ in range(args.steps):
                    step += 1
                    for segment in range(segments):
                        gradient = grads[segment * numel : (segment + 1) * numel]
                        client.push(
                            RUN, segment, step, gradient, defer_update=True, shm=(region.path, segment * numel * 4)
                        )
                    for segment in range(segments):
                        client.commit(
                            RUN,
                            segment,
                            step,
                            global_norm=1.0,
                            lr=1e-3,
                            prepare="float32",
                            weights_to=(region.path, weights_at + segment * numel * 4),
                            numel=numel,
                        )
                return args.steps * segments * 2

            runs = {
                "bare unary call": bare_calls(bare_channel, args.steps * segments * 2),
                "staged push + commit (weights_out)": staged_steps,
            }
            for run in runs.values():
                run()  # warm, not measured: connections, buffers, mappings
            rows: dict[str, list[dict[str, float]]] = {name: [] for name in runs}
            for _ in range(args.repeat):
                for name, run in runs.items():
                    rows[name].append(window.measure(run))
    finally:
        region.close()
        parent.send("stop")
        server.join(timeout=30)
        if server.is_alive():
            server.terminate()
            server.join()
    report(rows, segments, numel)


def report(rows: dict[str, list[dict[str, float]]], segments: int, numel: int) -> None:
    best = {name: min(runs, key=lambda r: r["client_us"] + r["server_us"]) for name, runs in rows.items()}
    floor = best["bare unary call"]
    print(f"\nper call, {segments} segments of {numel} fp32 elements (best of {len(rows['bare unary call'])} windows)")
    print("| call | wall us | client CPU us | server CPU us | CPU vs bare unary |")
    print("| --- | --- | --- | --- | --- |")
    for name, row in best.items():
        ratio = (row["client_us"] + row["server_us"]) / (floor["client_us"] + floor["server_us"])
        print(f"| {name} | {row['wall_us']:.0f} | {row['client_us']:.0f} | {row['server_us']:.0f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
