"""What does a checkpoint of NVMe-tier state cost training, against copying the state?

    python benchmarks/tier_checkpoint.py --path /mnt/nvme0/cargohold-bench
    python benchmarks/tier_checkpoint.py --path /tmp/bench --other-path /dev/shm/bench

In one run, on the disk under ``--path``:

1. **Tier.** One segment of ``--state-mib`` of optimizer state on a state server with a
   ``--budget-mib`` RAM budget, so most partitions are files; two optimizer steps.
2. **Our checkpoint** into a folder on the same filesystem (SegmentCheckpointer, as a state
   server runs it), with the next optimizer step started right away as training would:
   ``begin`` is what the launcher waits (the hard links), ``next step`` the step that
   runs while the RAM-resident partitions are written (it waits for any it reaches
   first) against ``plain step`` without a checkpoint, and ``total`` the time until the
   checkpoint could be committed.
3. **Baseline: a full copy.** The same partition files copied with ``shutil.copyfile``
   and fsynced, as a checkpoint that copies every byte would at least cost.
4. **Baseline: through RAM.** What cargohold did before linking: the whole segment read
   back into memory (``snapshot``) and written as one file (a partition file since the
   checkpoint format has one payload format), training waiting.

With ``--other-path`` (another filesystem) the checkpoint goes there: links are refused
and the pinned files are copied in the background; ``stall`` stays short and ``total``
approaches the copy.

Ratios printed: the stall (begin, plus what the next step took beyond a plain one) over
the full copy and over the previous way (lower is better). The checkpoint is read back and checked bitwise against
the state it was taken from. Files are deleted at the end.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import tempfile
import time

import torch
from timing import timed

from cargohold.cluster.schema.server import TierConfig
from cargohold.services.checkpoint import CheckpointReader, FileRecord, Manifest, SegmentRecord
from cargohold.services.checkpoint.reshard import layout_record
from cargohold.services.checkpoint.writer import SegmentCheckpointer
from cargohold.services.core.layout import build_layout
from cargohold.services.core.optim import AdamWHyperParams
from cargohold.services.core.segment_spec import SegmentSpec
from cargohold.services.segments.segment_registry import SegmentRegistry
from cargohold.services.segments.segment_state import SegmentState
from cargohold.services.tiers.fileformat import FileLayout
from cargohold.services.tiers.io_pool import AlignedBuffer
from cargohold.services.tiers.nvme import write_partition_file
from cargohold.services.tiers.residency import PartitionKey, Residency
from cargohold.services.tiers.storage import TieredStorage

MIB = 1 << 20


def copy_files(sources: list[str], directory: str) -> None:
    for source in sources:
        target = os.path.join(directory, os.path.basename(source))
        shutil.copyfile(source, target)
        fd = os.open(target, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_through_ram(state: SegmentState, path: str) -> None:
    """The whole segment read back into memory and written as one partition file."""
    snapshot = state.snapshot()
    layout = FileLayout(state.spec.numel, state.spec.state_dtype)
    buffer = AlignedBuffer(layout.file_bytes)
    buffer.arrays(layout).load_(snapshot["master"], (snapshot["exp_avg"], snapshot["exp_avg_sq"]))
    write_partition_file(path, buffer, PartitionKey("bench", 0, 0), layout, state.updates, direct=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", default=None, help="a directory on the tier's disk (default: a temp dir)")
    parser.add_argument("--other-path", default=None, help="checkpoint onto this (another filesystem) instead")
    parser.add_argument("--state-mib", type=int, default=1536)
    parser.add_argument("--budget-mib", type=int, default=320)
    parser.add_argument("--partition-mib", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    base = args.path or tempfile.mkdtemp(prefix="cargohold-bench-")
    os.makedirs(base, exist_ok=True)
    checkpoints = os.path.join(args.other_path or base, "checkpoint")
    baseline = os.path.join(base, "full-copy")
    numel = args.state_mib * MIB // 12 // 64 * 64
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, kernel {platform.release()}")
    print(
        f"tier on {base}; checkpoint on {args.other_path or base} "
        f"({'another' if args.other_path else 'the same'} filesystem)"
    )

    spec = SegmentSpec(
        run_id="bench",
        segment_id=0,
        start=0,
        numel=numel,
        fragments=((0, numel),),
        grad_dtype="float32",
        hyper=AdamWHyperParams(weight_decay=0.01),
    )
    tier = TierConfig(
        nvme_paths=[os.path.join(base, "tier")],
        ram_budget_bytes=args.budget_mib * MIB,
        partition_bytes=args.partition_mib * MIB,
        buffer_count=3,
        io_threads=4,
    )
    registry = SegmentRegistry(TieredStorage(tier))
    try:
        state = registry.register(spec, torch.randn(numel, generator=torch.Generator().manual_seed(0)))
        gradient = torch.randn(numel, generator=torch.Generator().manual_seed(1)).mul_(1e-2)
        for step in (1, 2):
            state.apply_gradient(step, gradient, global_norm=1.0, lr=1e-3)
        plain_step = timed(lambda: state.apply_gradient(3, gradient, global_norm=1.0, lr=1e-3))
        rows = registry.storage.rows("bench")
        disk = [r.path for r in rows if r.actual is Residency.NVME]
        on_disk = sum(12 * r.numel for r in rows if r.actual is Residency.NVME)
        print(
            f"state: {12 * numel / MIB:.0f} MiB in {len(rows)} partitions, {on_disk / MIB:.0f} MiB on disk "
            f"({len(disk)} files), {(12 * numel - on_disk) / MIB:.0f} MiB in RAM"
        )

        os.makedirs(baseline)
        copy_seconds = timed(lambda: copy_files(disk, baseline))
        shutil.rmtree(baseline)
        os.makedirs(baseline)
        saved = state.snapshot()
        through_ram = timed(lambda: write_through_ram(state, os.path.join(baseline, "segment.tier")))
        shutil.rmtree(baseline)

        os.makedirs(checkpoints)
        checkpointer = SegmentCheckpointer(registry, "server0")
        started = time.perf_counter()
        updates = checkpointer.begin("bench", checkpoints, 3)
        begin = time.perf_counter() - started
        next_step = timed(lambda: state.apply_gradient(4, gradient, global_norm=1.0, lr=1e-3))
        records: list[tuple[SegmentRecord, FileRecord]] = checkpointer.wait()
        total = time.perf_counter() - started
        how = checkpointer.preserved
        stall = begin + max(0.0, next_step - plain_step)

        flat = (("flat", (numel,)),)
        manifest = Manifest(
            step=3,
            updates=updates,
            run_id="bench",
            config={},
            model_signature=flat,
            layout=layout_record(build_layout(flat, num_workers=1, num_servers=1)),
            total=numel,
            segments=tuple(r for r, _ in records),
            files=tuple(f for _, f in records),
        )
        reader = CheckpointReader(checkpoints, manifest)
        for start in range(0, numel, 16 << 20):
            got = reader.read(start, min(numel, start + (16 << 20)))
            for key in got:
                assert torch.equal(got[key], saved[key][start : start + got[key].numel()]), key
    finally:
        registry.close()
        for folder in (checkpoints, baseline):
            shutil.rmtree(folder, ignore_errors=True)
        if args.path is None:
            shutil.rmtree(base, ignore_errors=True)

    print(f"checkpoint: {how['linked']} files linked, {how['copied']} copied, {how['written']} written from RAM")
    print(f"full copy of the {len(disk)} disk files: {copy_seconds:.3f} s ({on_disk / copy_seconds / 1e9:.2f} GB/s)")
    print(f"through RAM (snapshot + one file, the previous way): {through_ram:.3f} s")
    print(
        f"ours: begin {begin:.3f} s, next step {next_step:.3f} s (plain step {plain_step:.3f} s), "
        f"stall {stall:.3f} s, total {total:.3f} s"
    )
    print(
        f"ratio stall / full copy: {stall / copy_seconds:.3f}   ratio total / full copy: {total / copy_seconds:.3f}   "
        f"ratio stall / through RAM: {stall / through_ram:.3f}"
    )
    print("checkpoint read back bitwise equal to the state")


if __name__ == "__main__":
    main()
