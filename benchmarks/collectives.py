"""FSDP2's collectives between CPU workers on one host: shared memory against gloo.

    python benchmarks/collectives.py                          # 2 ranks, a demo block and a 0.3B block
    python benchmarks/collectives.py --ranks 3 --numels 1e6

Each rank is a process with one thread in a gloo group on loopback, as the workers are. For
each size (elements per unit, all ranks together) it times the all-gather (each rank's
chunk into everyone's output) and the average reduce-scatter (every rank's whole input
into its chunk), fp32, through gloo (``all_gather_into_tensor``, ``reduce_scatter_tensor``)
and through :mod:`cargohold.services.worker.colocated_collectives` (what the workers plug into
FSDP2). It prints each one's wall time and the rank's CPU time (all its threads: gloo's
own do the socket work) per call, best of ``--reps`` rounds of ``--calls`` calls after a
warm-up, and RATIO shared memory / gloo. Results are compared first: both give the same
bits at two ranks, and the same all-gather at any number. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import datetime
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cargohold.services.worker.colocated_collectives import connect

TIMEOUT = datetime.timedelta(seconds=120)


def measure(call, calls: int, reps: int) -> tuple[float, float]:
    """Best (wall, CPU) seconds per call over ``reps`` rounds of ``calls`` calls, every rank
    starting each round together."""
    call()
    best = (float("inf"), float("inf"))
    for _ in range(reps):
        dist.barrier()
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, ((time.perf_counter() - wall) / calls, (time.process_time() - cpu) / calls))
    return best


def time_unit(shared, rank: int, ranks: int, numel: int, calls: int, reps: int) -> tuple:
    """(numel, whether both give the same results, {what: (wall, CPU) per call}) for one unit."""
    n = -(-numel // ranks)
    full = torch.randn(n * ranks, generator=torch.Generator().manual_seed(rank))
    chunk = full[:n].clone()
    gathered, scattered = torch.empty(n * ranks), torch.empty(n)
    expected_gather, expected_scatter = torch.empty(n * ranks), torch.empty(n)
    dist.all_gather_into_tensor(expected_gather, chunk)
    dist.reduce_scatter_tensor(expected_scatter, full.clone(), op=dist.ReduceOp.AVG)
    shared.all_gather(gathered, chunk)
    shared.reduce_scatter(scattered, full, average=True)
    same = torch.equal(gathered, expected_gather) and (ranks > 2 or torch.equal(scattered, expected_scatter))
    timings = {
        "all-gather gloo": measure(lambda: dist.all_gather_into_tensor(gathered, chunk), calls, reps),
        "all-gather shared memory": measure(lambda: shared.all_gather(gathered, chunk), calls, reps),
        # gloo's reduce-scatter may write into its input: a fresh copy each call, timed alone below
        "reduce-scatter gloo": measure(
            lambda: dist.reduce_scatter_tensor(scattered, full.clone(), op=dist.ReduceOp.AVG), calls, reps
        ),
        "input copy (subtracted from gloo's reduce-scatter)": measure(lambda: full.clone(), calls, reps),
        "reduce-scatter shared memory": measure(
            lambda: shared.reduce_scatter(scattered, full, average=True), calls, reps
        ),
    }
    return numel, same, timings


def rank_main(rank: int, ranks: int, port: int, numels: list[int], calls: int, reps: int, out: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, ranks + 1, is_master=False, timeout=TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=ranks)
    try:
        group = dist.group.WORLD
        assert group is not None
        shared = connect(group, max(numels) * 4, "benchmark")
        if shared is None:
            raise SystemExit("the ranks could not share memory")
        rows = [time_unit(shared, rank, ranks, numel, calls, reps) for numel in numels]
        shared.close()
        if rank == 0:
            torch.save(rows, out)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--numels", default="1769472,12582912", help="elements per unit, comma-separated")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    numels = [int(float(n)) for n in args.numels.split(",")]
    # The parent holds the ranks' store on a port the kernel picked (no probe-and-release race).
    store = dist.TCPStore("127.0.0.1", 0, args.ranks + 1, is_master=True, timeout=TIMEOUT, wait_for_workers=False)
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder, "rows.pt"))
        mp.start_processes(
            rank_main,
            args=(args.ranks, store.port, numels, args.calls, args.reps, out),
            nprocs=args.ranks,
            start_method="spawn",
        )
        rows = torch.load(out)
    print(f"{args.ranks} ranks x 1 thread, fp32; per call, best of {args.reps} x {args.calls}; {os.cpu_count()} cores")
    for numel, same, timings in rows:
        print(f"unit of {numel:,} elements ({numel * 4 / 2**20:.1f} MiB){'' if same else ': RESULTS DIFFER'}")
        for name, (wall, cpu) in timings.items():
            print(f"  {name:<52} wall {wall * 1e3:8.2f} ms   CPU {cpu * 1e3:8.2f} ms")
        copy_wall, copy_cpu = timings["input copy (subtracted from gloo's reduce-scatter)"]
        for op in ("all-gather", "reduce-scatter"):
            wall, cpu = timings[f"{op} gloo"]
            if op == "reduce-scatter":
                wall, cpu = wall - copy_wall, cpu - copy_cpu
            ours_wall, ours_cpu = timings[f"{op} shared memory"]
            print(f"  RATIO {op} shared memory / gloo = {ours_wall / wall:.2f} (wall), {ours_cpu / cpu:.2f} (CPU)")


if __name__ == "__main__":
    main()
