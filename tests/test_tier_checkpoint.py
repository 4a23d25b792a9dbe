"""Checkpoints of a state server whose state lives on the NVMe tier, with real files: the
tier's partition files become part of a checkpoint by hard link (no bytes copied), by a
copy of the pinned version when the checkpoint is on another filesystem, and by a write
for the partitions resident in RAM; the checkpoint keeps the saved state while the tier
moves on; restoring it, onto the same or another partitioning or all-RAM, continues
bitwise; damage and a full disk are reported naming the file.

Another filesystem is a real tmpfs mounted for the test (it skips where mounting is not
allowed)."""

from __future__ import annotations

import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from system import mounted_tmpfs, run_measured

from cargohold.cluster.config import TierConfig
from cargohold.services.checkpoint import CheckpointDir, Manifest, read_flat_range
from cargohold.services.checkpoint.writer import ShardCheckpointer
from cargohold.services.errors import CheckpointError, CorruptCheckpointError
from cargohold.services.layout import build_layout
from cargohold.services.optim import AdamWHyperParams
from cargohold.services.reshard import layout_record
from cargohold.services.segment_state import SegmentRegistry, SegmentSpec
from cargohold.services.tiers.fileformat import ARRAYS, HEADER_BYTES, FileLayout, parse_header
from cargohold.services.tiers.residency import PartitionKey, Residency
from cargohold.services.tiers.storage import TieredStorage

pytestmark = pytest.mark.timeout(120)

RUN = "run-ck"
HYPER = AdamWHyperParams(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, max_grad_norm=1.0)
PER_PARTITION = 1344  # 16 KiB partitions
NUMEL = 10 * PER_PARTITION + 320  # 11 partitions, the last one short
FRAGMENTS = ((0, 5000), (5056, 6000), (11072, 2688))
SHARDS = 2
TOTAL = SHARDS * NUMEL
BUFFER_BYTES = FileLayout(PER_PARTITION).file_bytes
LR = 1e-2
NORM = 2.0  # > max_grad_norm: clipping is active
FLAT = (("flat", (TOTAL,)),)
"""The model signature of the checkpoints: one flat parameter."""


def _tier(root: Path, **changes: object) -> TierConfig:
    fields: dict[str, object] = dict(
        nvme_paths=[str(root / "d0"), str(root / "d1")],
        ram_budget_bytes=5 * BUFFER_BYTES,
        partition_bytes=16 << 10,
        buffer_count=3,
        io_threads=2,
    )
    fields.update(changes)
    return TierConfig(**fields)  # type: ignore[arg-type]


def _specs() -> list[SegmentSpec]:
    return [
        SegmentSpec(
            run_id=RUN,
            segment_id=i,
            start=i * NUMEL,
            numel=NUMEL,
            fragments=FRAGMENTS,
            grad_dtype="float32",
            hyper=HYPER,
        )
        for i in range(SHARDS)
    ]


def _whole() -> list[tuple[SegmentSpec, tuple[tuple[int, int, int], ...]]]:
    """Each spec with the run restoring all of it from where it was saved (same layout)."""
    return [(spec, ((0, spec.start, spec.numel),)) for spec in _specs()]


def _fresh(tier: TierConfig | None) -> SegmentRegistry:
    registry = SegmentRegistry(TieredStorage(tier))
    for spec in _specs():
        registry.register(spec, torch.randn(NUMEL, generator=torch.Generator().manual_seed(spec.segment_id)))
    return registry


def _push(registry: SegmentRegistry, steps: range) -> None:
    for step in steps:
        for spec in _specs():
            gradient = torch.randn(NUMEL, generator=torch.Generator().manual_seed(1000 * step + spec.segment_id))
            registry.get(RUN, spec.segment_id).apply_gradient(step, gradient, global_norm=NORM, lr=LR)


def _state(registry: SegmentRegistry) -> dict[str, torch.Tensor]:
    shards = [registry.get(RUN, spec.segment_id).snapshot() for spec in _specs()]
    return {key: torch.cat([s[key] for s in shards]) for key in ARRAYS}


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    for key in ARRAYS:
        assert torch.equal(a[key], b[key]), f"{key} differs"


def _checkpoint(store: CheckpointDir, registry: SegmentRegistry, step: int) -> tuple[Path, dict[str, int]]:
    checkpointer = ShardCheckpointer(registry, server_index=0)
    directory = store.begin(step)
    update = checkpointer.begin(RUN, str(directory), step)
    try:
        records = checkpointer.wait()
    except CheckpointError:
        store.abort(step)
        raise
    manifest = Manifest(
        step=step,
        updates=update,
        run_id=RUN,
        config_hash="cfg",
        model_signature=FLAT,
        layout=layout_record(build_layout(FLAT, num_workers=1, num_servers=1, align=1)),
        total=TOTAL,
        shards=tuple(sorted((r for r, _ in records), key=lambda r: r.start)),
        files=tuple(f for _, f in records),
    )
    return store.commit(step, manifest), checkpointer.preserved


def _read(path: Path) -> dict[str, torch.Tensor]:
    manifest = CheckpointDir(path.parent).load(path)
    return read_flat_range(path, manifest, 0, manifest.total)


def _disk_rows(registry: SegmentRegistry) -> dict[PartitionKey, str]:
    return {r.key: r.path for r in registry.storage.rows(RUN) if r.actual is Residency.NVME}


def _checkpoint_file(path: Path, key: PartitionKey) -> Path:
    return path / f"server0-shard{key.segment_id:06d}-part{key.index:05d}.tier"


@pytest.fixture
def other_filesystem(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB tmpfs: another device than tmp_path, room for one checkpoint of the
    two shards here (~630 KiB in partition files) but not two."""
    with mounted_tmpfs(tmp_path / "other-fs", "1024k") as mount:
        assert os.stat(mount).st_dev != os.stat(tmp_path).st_dev
        yield mount


def test_disk_partitions_are_hard_linked_and_keep_the_saved_state(tmp_path: Path) -> None:
    registry = _fresh(_tier(tmp_path))
    try:
        _push(registry, range(1, 4))
        saved = _state(registry)
        on_disk = _disk_rows(registry)
        partitions = len(registry.storage.rows(RUN))
        assert 0 < len(on_disk) < partitions, "some partitions on disk, some in RAM"
        path, how = _checkpoint(CheckpointDir(tmp_path / "ckpt"), registry, 3)

        assert how == {"linked": len(on_disk), "copied": 0, "written": partitions - len(on_disk)}
        for key, tier_file in on_disk.items():
            linked = _checkpoint_file(path, key)
            assert os.path.samefile(linked, tier_file), f"{linked} is not the tier's file"
            assert os.stat(linked).st_nlink == 2
        written = [f for f in path.glob("*.tier") if os.stat(f).st_nlink == 1]
        assert len(written) == partitions - len(on_disk)
        _assert_equal(_read(path), saved)

        _push(registry, range(4, 7))  # every tier file is replaced by a new version
        assert all(os.stat(f).st_nlink == 1 for f in path.glob("*.tier")), "the tier let go of the old versions"
        assert not any(os.path.samefile(_checkpoint_file(path, k), p) for k, p in _disk_rows(registry).items())
        _assert_equal(_read(path), saved)
    finally:
        registry.close()
    assert list(path.glob("*.tier")), "closing the tier leaves the checkpoint's files"
    _assert_equal(_read(path), saved)


@pytest.mark.parametrize("target", ["same-partitions", "other-partitions", "all-in-ram"])
def test_a_tier_checkpoint_restores_and_continues_bitwise(tmp_path: Path, target: str) -> None:
    store = CheckpointDir(tmp_path / "ckpt")
    original = _fresh(_tier(tmp_path / "a"))
    try:
        _push(original, range(1, 4))
        saved = _state(original)
        path, _ = _checkpoint(store, original, 3)
        _push(original, range(4, 6))
        expected = _state(original)
    finally:
        original.close()

    tier = {
        "same-partitions": _tier(tmp_path / "b"),
        "other-partitions": _tier(tmp_path / "b", partition_bytes=40 << 10, ram_budget_bytes=4 * (40 << 10)),
        "all-in-ram": None,
    }[target]
    restored = SegmentRegistry(TieredStorage(tier))
    try:
        ShardCheckpointer(restored, server_index=0).restore(str(path), store.load(path), _whole())
        assert all(restored.get(RUN, s.segment_id).updates == 3 for s in _specs())
        if tier is not None:
            assert _disk_rows(restored), "the restored state is back on disk"
        _assert_equal(_state(restored), saved)
        _push(restored, range(4, 6))
        _assert_equal(_state(restored), expected)
    finally:
        restored.close()


@pytest.mark.parametrize("saved_by", ["all-in-ram", "nvme-tier"])
def test_one_payload_format_whatever_the_tier(tmp_path: Path, saved_by: str) -> None:
    """All in RAM or with an NVMe tier, a checkpoint's payload is partition files in the
    tier's format: each is the partition its name and its shard record say, at the
    manifest's update count, with the size and header checksum the manifest records; the
    checkpoint restores bitwise into either kind of storage and training continues."""
    store = CheckpointDir(tmp_path / "ckpt")
    original = _fresh(_tier(tmp_path / "a") if saved_by == "nvme-tier" else None)
    try:
        _push(original, range(1, 4))
        saved = _state(original)
        partitions = len(original.storage.rows(RUN))
        path, how = _checkpoint(store, original, 3)
        _push(original, range(4, 6))
        expected = _state(original)
    finally:
        original.close()
    manifest = store.load(path)
    if saved_by == "all-in-ram":  # one partition per segment, copied and written
        assert partitions == SHARDS and how == {"linked": 0, "copied": 0, "written": SHARDS}
    else:
        assert partitions > SHARDS and how["linked"] > 0 and sum(how.values()) == partitions
    assert len(manifest.shards) == len(manifest.files) == partitions == len(list(path.glob("*.tier")))
    records = {f.name: f for f in manifest.files}
    for shard in manifest.shards:
        raw = (path / shard.file).read_bytes()
        header = parse_header(raw[:HEADER_BYTES], path=shard.file)
        assert _checkpoint_file(path, header.key).name == shard.file
        assert header.key.run_id == RUN and header.key.segment_id == shard.segment_id
        assert header.numel == shard.stop - shard.start
        assert header.step == manifest.updates == 3
        assert len(raw) == FileLayout(header.numel).file_bytes == records[shard.file].nbytes
        assert header.checksum() == records[shard.file].crc32c
    for target in (None, _tier(tmp_path / "b")):
        restored = SegmentRegistry(TieredStorage(target))
        try:
            ShardCheckpointer(restored, server_index=0).restore(str(path), manifest, _whole())
            _assert_equal(_state(restored), saved)
            _push(restored, range(4, 6))
            _assert_equal(_state(restored), expected)
        finally:
            restored.close()


def test_on_another_filesystem_the_pinned_version_is_copied(tmp_path: Path, other_filesystem: Path) -> None:
    """Links across filesystems fail (EXDEV): the files are opened when the checkpoint
    begins and copied afterwards, and the copies hold the saved version even though the
    tier replaced every file before they ran."""
    registry = _fresh(_tier(tmp_path))
    try:
        _push(registry, range(1, 3))
        saved = _state(registry)
        on_disk = _disk_rows(registry)
        directory = other_filesystem / "pinned"
        directory.mkdir()
        copies = []
        for spec in _specs():
            _, preserved = registry.get(RUN, spec.segment_id).preserve(
                str(directory), lambda key: f"{key.segment_id}-{key.index}.tier"
            )
            assert {p.how for p in preserved} == {"copied", "written"}
            for part in preserved:
                if part.how == "written":
                    part.pending.run()  # before the next update, which waits for it
                else:
                    copies.append(part.pending)
        assert len(copies) == len(on_disk)
        _push(registry, range(3, 5))  # the tier moves on before the copies run
        for copy in copies:
            copy.run()
        for key in on_disk:
            start = key.index * PER_PARTITION
            stop = min(NUMEL, start + PER_PARTITION)
            raw = (directory / f"{key.segment_id}-{key.index}.tier").read_bytes()
            offset = HEADER_BYTES
            for name in ARRAYS:
                got = torch.frombuffer(bytearray(raw[offset : offset + 4 * (stop - start)]), dtype=torch.float32)
                assert torch.equal(got, saved[name][key.segment_id * NUMEL + start : key.segment_id * NUMEL + stop])
                offset += FileLayout(stop - start).region_bytes

        # the whole save through the checkpointer: copies in the background, then committed
        shutil.rmtree(directory)  # the small filesystem holds one copy
        after = _state(registry)
        path, how = _checkpoint(CheckpointDir(other_filesystem / "ckpt"), registry, 4)
        assert how["linked"] == 0 and how["copied"] == len(_disk_rows(registry))
        assert all(os.stat(f).st_nlink == 1 for f in path.glob("*.tier"))
        _assert_equal(_read(path), after)
    finally:
        registry.close()


def test_a_full_checkpoint_disk_fails_the_save_and_keeps_the_last_one(tmp_path: Path, other_filesystem: Path) -> None:
    store = CheckpointDir(other_filesystem, keep_last=3)
    registry = _fresh(_tier(tmp_path))
    try:
        _push(registry, range(1, 3))
        saved = _state(registry)
        first, _ = _checkpoint(store, registry, 2)
        _push(registry, range(3, 5))
        with pytest.raises(CheckpointError, match=r"No space left on device \(.*step-0000000004.partial/server0-"):
            _checkpoint(store, registry, 4)
        assert store.latest() == first and not list(other_filesystem.glob("*.partial"))
        _assert_equal(_read(first), saved)
        _push(registry, range(5, 6))  # training goes on: the tier is untouched by the failure
    finally:
        registry.close()


@pytest.mark.parametrize("damage", ["array byte", "header byte", "truncated", "another version"])
def test_a_damaged_partition_file_is_named(tmp_path: Path, damage: str) -> None:
    store = CheckpointDir(tmp_path / "ckpt", keep_last=5)
    registry = _fresh(_tier(tmp_path))
    try:
        _push(registry, range(1, 3))
        older, _ = _checkpoint(store, registry, 2)
        _push(registry, range(3, 5))
        path, _ = _checkpoint(store, registry, 4)
        _push(registry, range(5, 6))  # the checkpoint's files are its own now (one link)
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


def test_a_partition_file_named_for_another_shard_is_refused(tmp_path: Path) -> None:
    registry = _fresh(_tier(tmp_path))
    try:
        _push(registry, range(1, 2))
        path, _ = _checkpoint(CheckpointDir(tmp_path / "ckpt"), registry, 1)
    finally:
        registry.close()
    manifest = CheckpointDir(tmp_path / "ckpt").load(path)
    first, second = manifest.shards[0], manifest.shards[len(manifest.shards) // 2]
    swapped = [
        s
        if s not in (first, second)
        else type(s)(s.segment_id, s.start, s.stop, s.step, second.file if s is first else first.file)
        for s in manifest.shards
    ]
    bad = Manifest(**{**{f: getattr(manifest, f) for f in manifest.__dataclass_fields__}, "shards": tuple(swapped)})
    with pytest.raises(CorruptCheckpointError, match="the manifest puts shard"):
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
        from cargohold.cluster.config import TierConfig
        from cargohold.services.checkpoint import CheckpointDir, Manifest
        from cargohold.services.checkpoint.writer import ShardCheckpointer
        from cargohold.services.layout import build_layout
        from cargohold.services.optim import AdamWHyperParams
        from cargohold.services.reshard import layout_record
        from cargohold.services.segment_state import SegmentRegistry, SegmentSpec
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
        checkpointer = ShardCheckpointer(saving, 0)
        checkpointer.begin("rss", str(store.begin(1)), 1)
        records = checkpointer.wait()
        flat = (("flat", (N,)),)
        path = store.commit(1, Manifest(step=1, updates=1, run_id="rss", config_hash="", model_signature=flat,
                                        layout=layout_record(build_layout(flat, num_workers=1, num_servers=1)),
                                        total=N, shards=tuple(r for r, _ in records),
                                        files=tuple(f for _, f in records)))
        saving.close()
        del state, saving
        restoring = SegmentRegistry(TieredStorage(tier(root + "/b")))
        manifest = store.load(path)
        base = reset_peak_rss()
        ShardCheckpointer(restoring, 0).restore(str(path), manifest, [(spec, ((0, 0, N),))])
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


def test_the_next_update_waits_for_the_ram_partitions_to_be_written(tmp_path: Path) -> None:
    """RAM partitions are written after the checkpoint began, while training goes on: an
    update that reaches one first waits, so the file holds the saved state."""
    registry = _fresh(_tier(tmp_path))
    try:
        _push(registry, range(1, 3))
        saved = registry.get(RUN, 0).snapshot()
        directory = tmp_path / "pending"
        directory.mkdir()
        _, preserved = registry.get(RUN, 0).preserve(str(directory), lambda key: f"{key.index}.tier")
        writes = [p for p in preserved if p.how == "written"]
        assert writes and all(p.pending is not None for p in preserved if p.how != "linked")
        gradient = torch.randn(NUMEL, generator=torch.Generator().manual_seed(3))
        pushing = threading.Thread(
            target=lambda: registry.get(RUN, 0).apply_gradient(3, gradient, global_norm=NORM, lr=LR), daemon=True
        )
        pushing.start()
        pushing.join(timeout=1.0)
        assert pushing.is_alive(), "the update ran over a partition its checkpoint had not written yet"
        for part in writes:
            part.pending.run()
        pushing.join(timeout=30)
        assert not pushing.is_alive() and registry.get(RUN, 0).updates == 3
        for part in writes:
            raw = (directory / part.name).read_bytes()
            got = torch.frombuffer(
                bytearray(raw[HEADER_BYTES : HEADER_BYTES + 4 * (part.stop - part.start)]), dtype=torch.float32
            )
            assert torch.equal(got, saved["master"][part.start : part.stop]), f"{part.name} holds step 3"
    finally:
        registry.close()


def test_a_cancelled_write_releases_the_partition(tmp_path: Path) -> None:
    registry = _fresh(_tier(tmp_path))
    try:
        _push(registry, range(1, 2))
        directory = tmp_path / "cancelled"
        directory.mkdir()
        _, preserved = registry.get(RUN, 0).preserve(str(directory), lambda key: f"{key.index}.tier")
        written = [p.name for p in preserved if p.how == "written"]
        assert written
        for part in preserved:
            if part.pending is not None:
                part.pending.cancel()
        _push(registry, range(2, 3))  # would wait for ever on a write never run nor cancelled
        assert not [name for name in written if (directory / name).exists()], "a cancelled write wrote"
    finally:
        registry.close()


# --- crash consistency: a writer SIGKILLed at random points, resumed each time -------------

CRASH_KEEP = 2


def crash_writer(root: str, tier_root: str) -> None:
    """Resume from the latest checkpoint under ``root`` (or start fresh), then train and
    checkpoint one step after another until killed; prints "ready" once restored, "saving"
    when a checkpoint begins and "saved <step> <seconds of the step> <seconds of the
    checkpoint>" after each commit. Run in a child process."""
    store = CheckpointDir(Path(root), keep_last=CRASH_KEEP)
    latest = store.latest()
    if latest is None:
        registry, step = _fresh(_tier(Path(tier_root))), 0
    else:
        manifest = store.load(latest)
        registry, step = SegmentRegistry(TieredStorage(_tier(Path(tier_root)))), manifest.step
        ShardCheckpointer(registry, server_index=0).restore(str(latest), manifest, _whole())
    print("ready", flush=True)
    while True:
        step += 1
        started = time.perf_counter()
        _push(registry, range(step, step + 1))
        print("saving", flush=True)
        saving = time.perf_counter()
        _checkpoint(store, registry, step)
        done = time.perf_counter()
        print(f"saved {step} {done - started:.6f} {done - saving:.6f}", flush=True)


class CrashWriter:
    """A child process running :func:`crash_writer`."""

    def __init__(self, root: Path, tier_root: Path) -> None:
        script = (
            f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            f"from test_tier_checkpoint import crash_writer; crash_writer({str(root)!r}, {str(tier_root)!r})"
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        line = self.proc.stdout.readline().strip()
        if line != "ready":
            self.proc.kill()
            pytest.fail(f"the writer did not start ({line!r}): {self.proc.stderr.read()[-3000:]}")

    def wait_for(self, line: str) -> None:
        while (got := self.proc.stdout.readline()) and got.strip() != line:
            pass

    def kill(self) -> list[str]:
        """SIGKILL it; the lines it printed after "ready"."""
        self.proc.send_signal(signal.SIGKILL)
        out, _ = self.proc.communicate(timeout=60)
        assert self.proc.returncode == -signal.SIGKILL, f"the writer ended by itself ({self.proc.returncode})"
        return out.split("\n")


def _reference_states(steps: int) -> list[dict[str, torch.Tensor]]:
    """The state after each step 0..steps of an uninterrupted all-RAM run (bitwise the
    tiered one's)."""
    registry = _fresh(None)
    states = [_state(registry)]
    for step in range(1, steps + 1):
        _push(registry, range(step, step + 1))
        states.append(_state(registry))
    return states


def _kill_trials(tmp_path: Path, trials: int, seed: int) -> None:
    root, tier_root = tmp_path / "ckpt", tmp_path / "tier"
    calibration = CrashWriter(tmp_path / "calibration", tmp_path / "calibration-tier")
    time.sleep(1.0)
    saves = [line.split()[2:] for line in calibration.kill() if line.startswith("saved")]
    assert saves, "the writer saved nothing in a second"
    per_save = statistics.median(float(step) for step, _ in saves)
    per_checkpoint = statistics.median(float(checkpoint) for _, checkpoint in saves)
    store = CheckpointDir(root, keep_last=CRASH_KEEP)
    expected = _reference_states(0)
    partial_seen = 0
    for trial in range(trials):
        before = store.complete_steps()
        writer = CrashWriter(root, tier_root)
        if trial % 2:  # anywhere in the next three steps
            delay = random.Random(seed + trial).uniform(0.0, 3.0 * per_save)
        else:  # inside a checkpoint: links made, RAM partitions being written, manifest...
            writer.wait_for("saving")
            delay = random.Random(seed + trial).uniform(0.0, per_checkpoint)
        time.sleep(delay)
        writer.kill()
        names = sorted(os.listdir(root)) if root.exists() else []
        state = f"trial {trial}, killed {delay * 1000:.1f} ms in (a save ~{per_save * 1000:.1f} ms), left {names}"
        partial_seen += any(name.endswith(".partial") for name in names)
        steps = store.complete_steps()
        assert not before or steps[-1] >= before[-1], f"{state}: a complete checkpoint went away"
        latest = store.latest()
        if latest is None:
            assert steps == [], state
            continue
        assert latest == store.final_dir(steps[-1]) and len(steps) <= CRASH_KEEP + 1, state
        if steps[-1] >= len(expected):
            expected = _reference_states(steps[-1] + 10)
        for step in steps:  # every complete checkpoint holds exactly its step's state
            try:
                _assert_equal(_read(store.final_dir(step)), expected[step])
            except (AssertionError, CheckpointError) as error:
                pytest.fail(f"{state}: step {step}: {error}")
    assert partial_seen > 0 and store.complete_steps(), (partial_seen, store.complete_steps())


def test_sigkill_during_tier_saves_never_exposes_a_partial_checkpoint(tmp_path: Path) -> None:
    """A writer that resumes from its latest checkpoint, trains and saves (hard links,
    RAM partitions written in the background, manifest last) is SIGKILLed at random
    points 20 times: every complete checkpoint is always exactly its step's state, and
    the next writer always resumes from one."""
    _kill_trials(tmp_path, trials=20, seed=7_000)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkill_during_tier_saves_many_trials(tmp_path: Path) -> None:
    _kill_trials(tmp_path, trials=150, seed=90_000)
