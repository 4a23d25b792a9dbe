"""How close does the NVMe tier come to the disk, and what does it cost a step?

    python benchmarks/nvme_tier.py --path /mnt/nvme0/cargohold-bench
    python benchmarks/nvme_tier.py --path /tmp/bench --state-mib 1536 --budget-mib 320 --steps 4

In one run, on the disk under ``--path``:

1. **Raw disk.** Sequential O_DIRECT write (then fsync) and read of a ``--raw-mib`` file,
   three ways (benchmarks/disk_baselines.py): ``--block-mib`` requests from ``--io-threads``
   threads, and fio with libaio and with io_uring at ``--fio-depth`` requests of each of
   ``--fio-block-kib`` in flight (``apt-get install fio``). The best write and the best
   read are the bandwidth the disk offers.
2. **Tier.** One segment of ``--state-mib`` of optimizer state (fp32 master, exp_avg,
   exp_avg_sq) on a state server with a ``--budget-mib`` RAM budget, so most partitions
   live on disk; ``--steps`` optimizer steps (SegmentState.push, as a PushGradient ends
   in). It reports the bytes swapped in and out per step and their rate, and compares the
   step with the disk time the same bytes would take at the raw bandwidth
   (``read / raw_read + written / raw_write``): ``tier / raw`` is that ideal disk time
   over the measured step time, 1.0 when the tier moves data as fast as the disk can.
3. **RAM.** The same segment and steps with all state in RAM: the step's compute alone.

With ``--compare-state-dtypes`` it runs instead, on the same disk and budget, the tier
with the moments stored as float32, bfloat16 and blockwise8 (``optim.state_dtype``): one
segment of ``--state-mib`` *fp32-equivalent* parameters each (the same parameters, fewer
bytes), stepped in turn (interleaved, so load from other processes falls on all kinds
alike), and prints per kind the mean update time of steps 2..N and the bytes swapped in
and out per step, then ``RATIO <kind> / float32 update_time`` and ``... bytes_per_step``.
No raw-disk baseline is run then:

    python benchmarks/nvme_tier.py --compare-state-dtypes --path /tmp/bench --state-mib 768 --budget-mib 160 --steps 4

Ratios printed: tier throughput / raw disk bandwidth (goal >= 0.9) and step(NVMe) /
step(RAM). When the update itself is slower than the disk, the step cannot be shorter
than the RAM step, and the best the tier can do is hide its I/O behind it; the line
``overlap`` says how much of that it achieves. Weights are checked bitwise between the
RAM and the NVMe run. Step times are the mean of steps 2..N (step 1 starts cold). The
files are deleted at the end.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time
from dataclasses import replace

import torch
from disk_baselines import best, fio_bandwidth, thread_bandwidth

from cargohold.cluster.schema.server import TierConfig
from cargohold.services.core.optim import AdamWHyperParams
from cargohold.services.core.segment_spec import SegmentSpec
from cargohold.services.core.state_precision import STATE_DTYPES, StateDtype
from cargohold.services.segments.segment_registry import SegmentRegistry
from cargohold.services.tiers.storage import TieredStorage

MIB = 1 << 20


class Counter:
    """A TierObserver that adds up the tier's I/O."""

    def __init__(self) -> None:
        self.read = self.written = 0
        self.read_s = self.write_s = self.wait_s = 0.0
        self.hits = self.misses = 0

    def record_tier_io(self, op: str, nbytes: int, seconds: float) -> None:
        if op == "read":
            self.read, self.read_s = self.read + nbytes, self.read_s + seconds
        else:
            self.written, self.write_s = self.written + nbytes, self.write_s + seconds

    def set_tier_queue_depth(self, depth: int) -> None:
        pass

    def record_prefetch(self, hit: bool) -> None:
        self.hits += hit
        self.misses += not hit

    def add_tier_io_wait(self, seconds: float) -> None:
        self.wait_s += seconds

    def set_tier_plan(self, partitions: dict[str, int], predicted_io_seconds: float) -> None:
        self.plan = partitions


def run_steps(tier: TierConfig, numel: int, steps: int, observer: Counter | None):
    registry, state = open_segment(tier, numel, observer, "float32")
    gradient = _gradient(numel)
    try:
        times, moved = [], []
        for step in range(1, steps + 1):
            seconds, swapped = timed_step(state, step, gradient, observer)
            times.append(seconds)
            moved.append(swapped)
        weights = state.weights(steps, "float32")
        by_tier = registry.bytes_by_tier()
    finally:
        registry.close()
    return times, moved, weights, by_tier


def _gradient(numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(1)).mul_(1e-2)


def open_segment(tier: TierConfig, numel: int, observer: Counter | None, state_dtype: StateDtype):
    """A registry over ``tier`` holding one segment of ``numel`` parameters stored as ``state_dtype``."""
    spec = SegmentSpec(
        run_id="bench",
        segment_id=0,
        start=0,
        numel=numel,
        fragments=((0, numel),),
        grad_dtype="float32",
        hyper=AdamWHyperParams(weight_decay=0.01),
        state_dtype=state_dtype,
    )
    initial = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    registry = SegmentRegistry(TieredStorage(tier, observer=observer))
    try:
        return registry, registry.register(spec, initial)
    except BaseException:
        registry.close()
        raise


def timed_step(state, step: int, gradient: torch.Tensor, observer: Counter | None) -> tuple[float, tuple[int, int]]:
    """Seconds of one update and the bytes it read and wrote."""
    before = (observer.read, observer.written) if observer else (0, 0)
    started = time.perf_counter()
    state.apply_gradient(step, gradient, global_norm=1.0, lr=1e-3)
    seconds = time.perf_counter() - started
    after = (observer.read, observer.written) if observer else (0, 0)
    return seconds, (after[0] - before[0], after[1] - before[1])


def compare_state_dtypes(args: argparse.Namespace, base: str, numel: int) -> None:
    """The tier's update time and bytes per step for each ``optim.state_dtype``, interleaved."""
    segments = {}
    try:
        for kind in STATE_DTYPES:
            tier = TierConfig(
                nvme_paths=[os.path.join(base, f"tier-{kind}")],
                ram_budget_bytes=args.budget_mib * MIB,
                partition_bytes=args.partition_mib * MIB,
                buffer_count=args.buffers,
                io_threads=args.io_threads,
            )
            counter = Counter()
            registry, state = open_segment(tier, numel, counter, kind)
            segments[kind] = (registry, state, counter, [], [])
        gradient = _gradient(numel)
        for step in range(1, args.steps + 1):
            for _, state, counter, times, moved in segments.values():
                seconds, swapped = timed_step(state, step, gradient, counter)
                times.append(seconds)
                moved.append(swapped)
        by_tier = {kind: segment[0].bytes_by_tier() for kind, segment in segments.items()}
    finally:
        for registry, *_ in segments.values():
            registry.close()
    tail = slice(1, None) if args.steps > 1 else slice(None)
    mean_time, per_step = {}, {}
    for kind, (_, _, counter, times, moved) in segments.items():
        mean_time[kind] = statistics.mean(times[tail])
        read_b = statistics.mean(m[0] for m in moved[tail])
        write_b = statistics.mean(m[1] for m in moved[tail])
        per_step[kind] = read_b + write_b
        print(
            f"{kind:10s} state {by_tier[kind]['ram'] / MIB:6.0f} MiB in RAM, {by_tier[kind]['nvme'] / MIB:6.0f} MiB "
            f"on disk; per step in {read_b / MIB:6.0f} MiB, out {write_b / MIB:6.0f} MiB; update "
            f"{mean_time[kind]:.3f} s (steps {', '.join(f'{t:.3f}' for t in times)}); prefetch hits {counter.hits}, "
            f"misses {counter.misses}"
        )
    for kind in STATE_DTYPES[1:]:
        print(f"RATIO {kind} / float32 update_time {mean_time[kind] / mean_time['float32']:.3f}")
        print(f"RATIO {kind} / float32 bytes_per_step {per_step[kind] / per_step['float32']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", default=None, help="a directory on the disk to measure (default: a temp dir)")
    parser.add_argument("--state-mib", type=int, default=1536, help="optimizer state of the segment")
    parser.add_argument("--budget-mib", type=int, default=320, help="the state server's RAM budget")
    parser.add_argument("--partition-mib", type=int, default=64)
    parser.add_argument("--buffers", type=int, default=3)
    parser.add_argument("--io-threads", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--raw-mib", type=int, default=1024)
    parser.add_argument("--block-mib", type=int, default=64)
    parser.add_argument("--fio-depth", type=int, default=32)
    parser.add_argument("--fio-block-kib", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads for Adam")
    parser.add_argument(
        "--compare-state-dtypes", action="store_true", help="the tier per optim.state_dtype instead (no raw baseline)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    base = args.path or tempfile.mkdtemp(prefix="cargohold-bench-")
    os.makedirs(base, exist_ok=True)
    numel = args.state_mib * MIB // 12 // 64 * 64
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(
        f"machine: {platform.machine()} {cpu}, {os.cpu_count()} cores, torch threads {args.threads}, "
        f"kernel {platform.release()}"
    )
    print(f"disk: {base} ({shutil.disk_usage(base).free / 2**30:.0f} GiB free)")
    if args.compare_state_dtypes:
        print(f"load average before: {os.getloadavg()[0]:.2f}")
        try:
            compare_state_dtypes(args, base, numel)
        finally:
            if args.path is None:
                shutil.rmtree(base, ignore_errors=True)
        print(f"load average after: {os.getloadavg()[0]:.2f}")
        return
    try:
        baselines = [thread_bandwidth(base, args.raw_mib * MIB, args.block_mib * MIB, args.io_threads)]
        for engine in ("libaio", "io_uring"):
            for block_kib in args.fio_block_kib:
                found = fio_bandwidth(base, args.raw_mib * MIB, block_kib << 10, engine, args.fio_depth)
                if found is None:
                    print(f"fio {engine}: not run (fio missing or the engine unavailable: apt-get install fio)")
                    break
                baselines.append(replace(found, engine=f"{found.engine}, {block_kib} KiB"))
        for baseline in baselines:
            print(f"raw disk, {baseline.describe()}")
        raw = best(baselines)
        write, read = raw.write, raw.read
        print(f"raw disk, {raw.describe()}")

        tier = TierConfig(
            nvme_paths=[os.path.join(base, "tier")],
            ram_budget_bytes=args.budget_mib * MIB,
            partition_bytes=args.partition_mib * MIB,
            buffer_count=args.buffers,
            io_threads=args.io_threads,
        )
        counter = Counter()
        nvme_times, moved, nvme_weights, by_tier = run_steps(tier, numel, args.steps, counter)
        ram_times, _, ram_weights, _ = run_steps(TierConfig(), numel, args.steps, None)
    finally:
        if args.path is None:
            shutil.rmtree(base, ignore_errors=True)
    assert torch.equal(nvme_weights, ram_weights), "the NVMe run's weights differ from the RAM run's"

    tail = slice(1, None) if args.steps > 1 else slice(None)
    step_nvme, step_ram = statistics.mean(nvme_times[tail]), statistics.mean(ram_times[tail])
    read_b = statistics.mean(m[0] for m in moved[tail])
    write_b = statistics.mean(m[1] for m in moved[tail])
    ideal_io = read_b / read + write_b / write
    print(
        f"state: {12 * numel / MIB:.0f} MiB in {args.partition_mib} MiB partitions; budget "
        f"{args.budget_mib} MiB; resident {by_tier['ram'] / MIB:.0f} MiB, on disk {by_tier['nvme'] / MIB:.0f} MiB"
    )
    print(
        f"tier per step: swapped in {read_b / MIB:.0f} MiB, out {write_b / MIB:.0f} MiB; "
        f"prefetch hits {counter.hits}, misses {counter.misses}; update waited {counter.wait_s:.2f} s in all"
    )
    print(
        f"tier throughput: in {read_b / step_nvme / 1e9:.2f} GB/s, out {write_b / step_nvme / 1e9:.2f} GB/s, "
        f"total {(read_b + write_b) / step_nvme / 1e9:.2f} GB/s"
    )
    print(f"step: NVMe {step_nvme:.3f} s, RAM {step_ram:.3f} s; disk time at raw bandwidth {ideal_io:.3f} s")
    print(f"ratio tier / raw disk bandwidth: {ideal_io / step_nvme:.3f}   (goal >= 0.9)")
    print(f"ratio step(NVMe) / step(RAM): {step_nvme / step_ram:.3f}")
    print(
        f"overlap: step(NVMe) / max(step(RAM), raw disk time) = {step_nvme / max(step_ram, ideal_io):.3f}   "
        "(1.0 = I/O fully hidden or fully disk-bound)"
    )
    print("weights: NVMe run bitwise equal to RAM run")


if __name__ == "__main__":
    main()
