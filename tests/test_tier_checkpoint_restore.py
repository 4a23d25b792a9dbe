"""Restoring a tier checkpoint: onto the same or another partitioning or all-RAM, it
continues bitwise; within the RAM budget however large the state; damage (a flipped
byte, a truncated file, another version, a file named for another segment, NaN or Inf
written with every checksum recomputed) is reported naming the file."""

from __future__ import annotations

import re
import struct
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from system import run_measured
from tier_checkpoints import (
    NUMEL,
    RUN,
    TOTAL,
    assert_same_state,
    disk_rows,
    fresh_registry,
    push_steps,
    save_checkpoint,
    specs,
    state_of,
    tier_config,
    whole_segments,
)

from cargohold.cluster.schema.server import TierConfig
from cargohold.services.checkpoint import MANIFEST_NAME, CheckpointDir, Manifest, read_flat_range
from cargohold.services.checkpoint.writer import SegmentCheckpointer
from cargohold.services.core.checksum import crc32c
from cargohold.services.core.errors import CorruptCheckpointError
from cargohold.services.core.state_precision import StateDtype
from cargohold.services.segments.segment_registry import SegmentRegistry
from cargohold.services.tiers.fileformat import HEADER_BYTES, FileLayout, parse_header
from cargohold.services.tiers.storage import TieredStorage

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("target", ["same-partitions", "other-partitions", "all-in-ram"])
def test_a_tier_checkpoint_restores_and_continues_bitwise(tmp_path: Path, target: str) -> None:
    store = CheckpointDir(tmp_path / "ckpt")
    original = fresh_registry(tier_config(tmp_path / "a"))
    try:
        push_steps(original, range(1, 4))
        saved = state_of(original)
        path, _ = save_checkpoint(store, original, 3)
        push_steps(original, range(4, 6))
        expected = state_of(original)
    finally:
        original.close()

    tier = {
        "same-partitions": tier_config(tmp_path / "b"),
        "other-partitions": tier_config(tmp_path / "b", partition_bytes=40 << 10, ram_budget_bytes=6 * (40 << 10)),
        "all-in-ram": None,
    }[target]
    restored = SegmentRegistry(TieredStorage(tier))
    try:
        SegmentCheckpointer(restored, "server0").restore(str(path), store.load(path), whole_segments())
        assert all(restored.get(RUN, s.segment_id).updates == 3 for s in specs())
        if tier is not None:
            assert disk_rows(restored), "the restored state is back on disk"
        assert_same_state(state_of(restored), saved)
        push_steps(restored, range(4, 6))
        assert_same_state(state_of(restored), expected)
    finally:
        restored.close()


@pytest.mark.parametrize("damage", ["array byte", "header byte", "truncated", "another version"])
def test_a_damaged_partition_file_is_named(tmp_path: Path, damage: str) -> None:
    store = CheckpointDir(tmp_path / "ckpt", keep_last=5)
    registry = fresh_registry(tier_config(tmp_path))
    try:
        push_steps(registry, range(1, 3))
        older, _ = save_checkpoint(store, registry, 2)
        push_steps(registry, range(3, 5))
        path, _ = save_checkpoint(store, registry, 4)
        push_steps(registry, range(5, 6))  # the checkpoint's files are its own now (one link)
    finally:
        registry.close()
    victim = sorted(path.glob("*.tier"))[3]
    data = bytearray(victim.read_bytes())
    if damage == "array byte":
        data[HEADER_BYTES + 4 * 100] ^= 0x10
        reason = "master checksum mismatch"
    elif damage == "header byte":
        data[20] ^= 0x01
        reason = "header checksum mismatch"
    elif damage == "truncated":
        data = data[: len(data) - 4096]
        reason = "bytes"
    else:
        data = bytearray((older / victim.name).read_bytes())
        reason = "header checksum differs from the manifest's"
    victim.unlink()  # never write through a link: that would change the other names too
    victim.write_bytes(bytes(data))
    manifest = store.load(path)
    with pytest.raises(CorruptCheckpointError, match=reason) as caught:
        read_flat_range(path, manifest, 0, TOTAL)
    assert str(victim) in str(caught.value)


def test_a_partition_file_named_for_another_segment_is_refused(tmp_path: Path) -> None:
    registry = fresh_registry(tier_config(tmp_path))
    try:
        push_steps(registry, range(1, 2))
        path, _ = save_checkpoint(CheckpointDir(tmp_path / "ckpt"), registry, 1)
    finally:
        registry.close()
    manifest = CheckpointDir(tmp_path / "ckpt").load(path)
    first, second = manifest.segments[0], manifest.segments[len(manifest.segments) // 2]
    swapped = [
        s
        if s not in (first, second)
        else type(s)(s.segment_id, s.start, s.stop, s.step, second.file if s is first else first.file)
        for s in manifest.segments
    ]
    bad = Manifest(**{**{f: getattr(manifest, f) for f in manifest.__dataclass_fields__}, "segments": tuple(swapped)})
    with pytest.raises(CorruptCheckpointError, match="the manifest puts segment"):
        read_flat_range(path, bad, 0, TOTAL)


RSS_OVERHEAD = 4 << 20
"""Beyond the budget: one partition's scratch as read from the checkpoint (its three
arrays), the 1 MiB checksum buffer and allocator slack. Measured at most 0.9 MiB; before
the reader reused its buffers, glibc's dynamic mmap threshold let per-partition
allocations pile up to 5-20 MiB, varying run to run."""


@pytest.mark.parametrize("saved_by", ["tier", "ram"])
def test_a_restore_stays_within_the_ram_budget_while_the_state_is_six_times_larger(
    tmp_path: Path, saved_by: str
) -> None:
    """A checkpoint of 48 MiB of state — tier partition files, or one 48 MiB partition
    file written from RAM — restored into a tier with an 8 MiB budget: the peak RSS of the
    restoring process grows by the budget plus a stated overhead, not by the state."""
    script = textwrap.dedent("""
        import json, sys, torch
        torch.set_num_threads(1)
        from pathlib import Path
        from cargohold.cluster.schema.server import TierConfig
        from cargohold.services.checkpoint import CheckpointDir, Manifest
        from cargohold.services.checkpoint.writer import SegmentCheckpointer
        from cargohold.services.core.layout import build_layout
        from cargohold.services.core.optim import AdamWHyperParams
        from cargohold.services.checkpoint.reshard import layout_record
        from cargohold.services.core.segment_spec import SegmentSpec
        from cargohold.services.segments.segment_registry import SegmentRegistry
        from cargohold.services.tiers.storage import TieredStorage
        from system import proc_status, reset_peak_rss

        root, budget, saved_by = sys.argv[1], int(sys.argv[2]), sys.argv[3]
        N = 4 << 20  # 48 MiB of state
        spec = SegmentSpec(run_id="rss", segment_id=0, start=0, numel=N, fragments=((0, N),),
                         grad_dtype="float32", hyper=AdamWHyperParams())
        def tier(path):
            return TierConfig(nvme_paths=[path], ram_budget_bytes=budget, partition_bytes=1 << 20,
                              buffer_count=3, io_threads=2)
        store = CheckpointDir(Path(root) / "ckpt")
        saving = SegmentRegistry(TieredStorage(tier(root + "/a") if saved_by == "tier" else None))
        state = saving.register(spec, torch.randn(N, generator=torch.Generator().manual_seed(0)))
        state.apply_gradient(1, torch.randn(N, generator=torch.Generator().manual_seed(1)), global_norm=1.0, lr=1e-3)
        expected = state.snapshot()
        checkpointer = SegmentCheckpointer(saving, "server0")
        checkpointer.begin("rss", str(store.begin(1)), 1)
        records = checkpointer.wait()
        flat = (("flat", (N,)),)
        path = store.commit(1, Manifest(step=1, updates=1, run_id="rss", config={}, model_signature=flat,
                                        layout=layout_record(build_layout(flat, num_workers=1, num_servers=1)),
                                        total=N, segments=tuple(r for r, _ in records),
                                        files=tuple(f for _, f in records)))
        saving.close()
        del state, saving
        restoring = SegmentRegistry(TieredStorage(tier(root + "/b")))
        manifest = store.load(path)
        base = reset_peak_rss()
        SegmentCheckpointer(restoring, "server0").restore(str(path), manifest, [(spec, ((0, 0, N),))])
        growth = proc_status("VmHWM") - base
        got = restoring.get("rss", 0).snapshot()
        same = all(torch.equal(got[k], expected[k]) for k in expected)
        print(json.dumps({"growth": growth, "state": 12 * N, "nvme": restoring.bytes_by_tier()["nvme"],
                          "files": sorted(p.suffix for p in path.iterdir()), "same": same}))
        restoring.close()
    """)
    budget = 8 << 20
    result = run_measured(script, tmp_path, budget, saved_by, timeout=100)
    assert result["same"], "the restored state differs from the saved one"
    assert set(result["files"]) == {".json", ".tier"}
    assert result["state"] >= 6 * budget and result["nvme"] > result["state"] * 0.8
    assert result["growth"] <= budget + RSS_OVERHEAD, (
        f"RSS grew {result['growth'] / 2**20:.1f} MiB restoring into a {budget / 2**20:.0f} MiB budget"
    )


# --- restored state that training cannot go on from (issue 40 row 4) ----------------------


def _registry_of(kind: StateDtype, tier: TierConfig | None) -> SegmentRegistry:
    """:func:`fresh_registry` with the moments stored as ``kind``."""
    registry = SegmentRegistry(TieredStorage(tier))
    for spec in specs():
        values = torch.randn(NUMEL, generator=torch.Generator().manual_seed(spec.segment_id))
        registry.register(replace(spec, state_dtype=kind), values)
    return registry


BLOCK_2 = r"(the block from )?flat element 14272"
"""Block 2 of segment 1 (its first element): its scale as stored, or its first decoded moment."""


def _poison(path: Path, segment: int, array: int, index: int, value: float, *, scale: bool) -> Path:
    """Write fp32 ``value`` as element ``index`` of array ``array`` (or, with ``scale``, as
    its block scale ``index``) in the file of segment ``segment``'s first partition, then
    recompute every checksum that covers it: the array's in the header, the header's own,
    the manifest's record of the file. Returns the file."""
    manifest = CheckpointDir(path.parent).load(path)
    record = next(s for s in manifest.segments if s.segment_id == segment)
    victim = path / record.file
    data = bytearray(victim.read_bytes())
    header = parse_header(data[:HEADER_BYTES], path=str(victim))
    layout = FileLayout(header.numel, header.dtype)
    region = layout.offset(array)
    struct.pack_into("<f", data, region + (layout.scales_offset if scale else 0) + 4 * index, value)
    checksums = list(header.checksums)
    checksums[array] = crc32c(memoryview(data)[region : region + layout.region_bytes_of(array)])
    header = replace(header, checksums=tuple(checksums))
    data[:HEADER_BYTES] = header.pack()
    victim.unlink()  # never write through a link: the saving tier's file may share it
    victim.write_bytes(bytes(data))
    files = tuple(replace(f, crc32c=header.checksum()) if f.name == record.file else f for f in manifest.files)
    (path / MANIFEST_NAME).write_text(replace(manifest, files=files).to_json())
    return victim


@pytest.mark.parametrize(
    ("kind", "array", "value", "named"),
    [  # 8 bits: the stored scales where a piece keeps them (same partitions), else the decoded moments
        ("blockwise8", 2, float("nan"), rf"exp_avg_sq( block scale)? of segment 1 holds nan at {BLOCK_2}"),
        ("blockwise8", 1, float("inf"), rf"exp_avg( block scale)? of segment 1 holds (inf|nan) at {BLOCK_2}"),
        ("float32", 0, float("nan"), r"master of segment 1 holds nan at flat element 13780"),
        ("float32", 2, float("-inf"), r"exp_avg_sq of segment 1 holds -inf at flat element 13780"),
    ],
    ids=["8-bit-scale-nan", "8-bit-scale-inf", "master-nan", "exp_avg_sq-inf"],
)
@pytest.mark.parametrize("target", ["same-partitions", "other-partitions"])
def test_restored_state_that_is_not_finite_is_refused_naming_file_and_segment(
    tmp_path: Path, kind: StateDtype, array: int, value: float, named: str, target: str
) -> None:
    """Every checksum recomputed, so only the values tell: a resume from them exited 0
    and its next checkpoint held NaN master weights."""
    saving = _registry_of(kind, tier_config(tmp_path / "a"))
    try:
        push_steps(saving, range(1, 3))
        path, _ = save_checkpoint(CheckpointDir(tmp_path / "ckpt"), saving, 2)
    finally:
        saving.close()
    victim = _poison(path, 1, array, 2 if kind == "blockwise8" else 20, value, scale=kind == "blockwise8")
    tier = tier_config(tmp_path / "b")
    if target == "other-partitions":
        tier = tier_config(tmp_path / "b", partition_bytes=40 << 10, ram_budget_bytes=6 * (40 << 10))
    restoring = SegmentRegistry(TieredStorage(tier))
    try:
        segments = [(replace(spec, state_dtype=kind), runs) for spec, runs in whole_segments()]
        with pytest.raises(CorruptCheckpointError, match=named) as caught:
            SegmentCheckpointer(restoring, "server0").restore(
                str(path), CheckpointDir(path.parent).load(path), segments
            )
    finally:
        restoring.close()
    assert f"checkpoint file {victim} is corrupt" in str(caught.value)
    with pytest.raises(CorruptCheckpointError, match=re.escape(str(victim))):  # read in any other way too
        read_flat_range(path, CheckpointDir(path.parent).load(path), 0, TOTAL)
