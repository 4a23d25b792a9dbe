"""Saving a checkpoint of a state server whose state lives on the NVMe tier, with real
files: the tier's partition files become part of a checkpoint by hard link (no bytes
copied), by a copy of the pinned version when the checkpoint is on another filesystem,
and by a write for the partitions resident in RAM, which the next update waits for; the
checkpoint keeps the saved state while the tier moves on; one payload format whatever
the tier; a full disk fails the save naming the file. Restoring is in
test_tier_checkpoint_restore.py, crashes in test_tier_checkpoint_crash.py.

Another filesystem is a real tmpfs mounted for the test (it skips where mounting is not
allowed)."""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from system import mounted_tmpfs
from tier_checkpoints import (
    LR,
    NORM,
    NUMEL,
    PER_PARTITION,
    RUN,
    SEGMENTS,
    assert_same_state,
    checkpoint_file,
    disk_rows,
    fresh_registry,
    push_steps,
    read_checkpoint,
    save_checkpoint,
    specs,
    state_of,
    tier_config,
    whole_segments,
)

from cargohold.services.checkpoint import CheckpointDir
from cargohold.services.checkpoint.writer import SegmentCheckpointer
from cargohold.services.core.errors import CheckpointError
from cargohold.services.segments.segment_registry import SegmentRegistry
from cargohold.services.tiers.fileformat import ARRAYS, HEADER_BYTES, FileLayout, parse_header
from cargohold.services.tiers.storage import TieredStorage

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def other_filesystem(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB tmpfs: another device than tmp_path, room for one checkpoint of the
    two segments here (~630 KiB in partition files) but not two."""
    with mounted_tmpfs(tmp_path / "other-fs", "1024k") as mount:
        assert os.stat(mount).st_dev != os.stat(tmp_path).st_dev
        yield mount


def test_disk_partitions_are_hard_linked_and_keep_the_saved_state(tmp_path: Path) -> None:
    registry = fresh_registry(tier_config(tmp_path))
    try:
        push_steps(registry, range(1, 4))
        saved = state_of(registry)
        on_disk = disk_rows(registry)
        partitions = len(registry.storage.rows(RUN))
        assert 0 < len(on_disk) < partitions, "some partitions on disk, some in RAM"
        path, how = save_checkpoint(CheckpointDir(tmp_path / "ckpt"), registry, 3)

        assert how == {"linked": len(on_disk), "copied": 0, "written": partitions - len(on_disk)}
        for key, tier_file in on_disk.items():
            linked = checkpoint_file(path, key)
            assert os.path.samefile(linked, tier_file), f"{linked} is not the tier's file"
            assert os.stat(linked).st_nlink == 2
        written = [f for f in path.glob("*.tier") if os.stat(f).st_nlink == 1]
        assert len(written) == partitions - len(on_disk)
        assert_same_state(read_checkpoint(path), saved)

        push_steps(registry, range(4, 7))  # every tier file is replaced by a new version
        assert all(os.stat(f).st_nlink == 1 for f in path.glob("*.tier")), "the tier let go of the old versions"
        assert not any(os.path.samefile(checkpoint_file(path, k), p) for k, p in disk_rows(registry).items())
        assert_same_state(read_checkpoint(path), saved)
    finally:
        registry.close()
    assert list(path.glob("*.tier")), "closing the tier leaves the checkpoint's files"
    assert_same_state(read_checkpoint(path), saved)


@pytest.mark.parametrize("saved_by", ["all-in-ram", "nvme-tier"])
def test_one_payload_format_whatever_the_tier(tmp_path: Path, saved_by: str) -> None:
    """All in RAM or with an NVMe tier, a checkpoint's payload is partition files in the
    tier's format: each is the partition its name and its segment record say, at the
    manifest's update count, with the size and header checksum the manifest records; the
    checkpoint restores bitwise into either kind of storage and training continues."""
    store = CheckpointDir(tmp_path / "ckpt")
    original = fresh_registry(tier_config(tmp_path / "a") if saved_by == "nvme-tier" else None)
    try:
        push_steps(original, range(1, 4))
        saved = state_of(original)
        partitions = len(original.storage.rows(RUN))
        path, how = save_checkpoint(store, original, 3)
        push_steps(original, range(4, 6))
        expected = state_of(original)
    finally:
        original.close()
    manifest = store.load(path)
    if saved_by == "all-in-ram":  # one partition per segment, copied and written
        assert partitions == SEGMENTS and how == {"linked": 0, "copied": 0, "written": SEGMENTS}
    else:
        assert partitions > SEGMENTS and how["linked"] > 0 and sum(how.values()) == partitions
    assert len(manifest.segments) == len(manifest.files) == partitions == len(list(path.glob("*.tier")))
    records = {f.name: f for f in manifest.files}
    for segment in manifest.segments:
        raw = (path / segment.file).read_bytes()
        header = parse_header(raw[:HEADER_BYTES], path=segment.file)
        assert checkpoint_file(path, header.key).name == segment.file
        assert header.key.run_id == RUN and header.key.segment_id == segment.segment_id
        assert header.numel == segment.stop - segment.start
        assert header.updates == manifest.updates == 3
        assert len(raw) == FileLayout(header.numel).file_bytes == records[segment.file].nbytes
        assert header.checksum() == records[segment.file].crc32c
    for target in (None, tier_config(tmp_path / "b")):
        restored = SegmentRegistry(TieredStorage(target))
        try:
            SegmentCheckpointer(restored, "server0").restore(str(path), manifest, whole_segments())
            assert_same_state(state_of(restored), saved)
            push_steps(restored, range(4, 6))
            assert_same_state(state_of(restored), expected)
        finally:
            restored.close()


def test_on_another_filesystem_the_pinned_version_is_copied(tmp_path: Path, other_filesystem: Path) -> None:
    """Links across filesystems fail (EXDEV): the files are opened when the checkpoint
    begins and copied afterwards, and the copies hold the saved version even though the
    tier replaced every file before they ran."""
    registry = fresh_registry(tier_config(tmp_path))
    try:
        push_steps(registry, range(1, 3))
        saved = state_of(registry)
        on_disk = disk_rows(registry)
        directory = other_filesystem / "pinned"
        directory.mkdir()
        copies = []
        for spec in specs():
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
        push_steps(registry, range(3, 5))  # the tier moves on before the copies run
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
        after = state_of(registry)
        path, how = save_checkpoint(CheckpointDir(other_filesystem / "ckpt"), registry, 4)
        assert how["linked"] == 0 and how["copied"] == len(disk_rows(registry))
        assert all(os.stat(f).st_nlink == 1 for f in path.glob("*.tier"))
        assert_same_state(read_checkpoint(path), after)
    finally:
        registry.close()


def test_a_full_checkpoint_disk_fails_the_save_and_keeps_the_last_one(tmp_path: Path, other_filesystem: Path) -> None:
    store = CheckpointDir(other_filesystem, keep_last=3)
    registry = fresh_registry(tier_config(tmp_path))
    try:
        push_steps(registry, range(1, 3))
        saved = state_of(registry)
        first, _ = save_checkpoint(store, registry, 2)
        push_steps(registry, range(3, 5))
        with pytest.raises(CheckpointError, match=r"No space left on device \(.*step-0000000004.partial/server0-"):
            save_checkpoint(store, registry, 4)
        assert store.latest() == first and not list(other_filesystem.glob("*.partial"))
        assert_same_state(read_checkpoint(first), saved)
        push_steps(registry, range(5, 6))  # training goes on: the tier is untouched by the failure
    finally:
        registry.close()


def test_the_next_update_waits_for_the_ram_partitions_to_be_written(tmp_path: Path) -> None:
    """RAM partitions are written after the checkpoint began, while training goes on: an
    update that reaches one first waits, so the file holds the saved state."""
    registry = fresh_registry(tier_config(tmp_path))
    try:
        push_steps(registry, range(1, 3))
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
    registry = fresh_registry(tier_config(tmp_path))
    try:
        push_steps(registry, range(1, 2))
        directory = tmp_path / "cancelled"
        directory.mkdir()
        _, preserved = registry.get(RUN, 0).preserve(str(directory), lambda key: f"{key.index}.tier")
        written = [p.name for p in preserved if p.how == "written"]
        assert written
        for part in preserved:
            if part.pending is not None:
                part.pending.cancel()
        push_steps(registry, range(2, 3))  # would wait for ever on a write never run nor cancelled
        assert not [name for name in written if (directory / name).exists()], "a cancelled write wrote"
    finally:
        registry.close()


@pytest.mark.parametrize("direct_io", ["on", "off"])
def test_live_direct_writes_skip_fsync_and_a_checkpoint_syncs_what_it_links(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct_io: str
) -> None:
    """The tier's O_DIRECT writes of live partition files are not fsynced (the files need
    to outlive the server process, not the machine), and a checkpoint fsyncs every file it
    hard-links before its manifest; buffered writes keep their fsync (only clean pages can
    be dropped from the page cache). The real fsync runs: the spy only records its files."""
    synced: list[str] = []
    inodes: set[tuple[int, int]] = set()
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        inodes.add((os.fstat(fd).st_dev, os.fstat(fd).st_ino))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    registry = fresh_registry(tier_config(tmp_path, direct_io=direct_io))
    try:
        push_steps(registry, range(1, 3))
        live = [p for p in synced if ".part-" in os.path.basename(p)]  # the tier's files and their temporaries
        if direct_io == "on":
            assert not live, f"live O_DIRECT writes were fsynced: {live[:3]}"
        else:
            assert live, "buffered live writes must be fsynced"
        on_disk = disk_rows(registry)
        inodes.clear()
        path, how = save_checkpoint(CheckpointDir(tmp_path / "ckpt"), registry, 2)
        assert how["linked"] == len(on_disk) > 0
        unsynced = [key for key in on_disk if _inode(checkpoint_file(path, key)) not in inodes]
        assert not unsynced, f"linked but not fsynced: {unsynced[:3]}"
    finally:
        registry.close()


def _inode(path: Path) -> tuple[int, int]:
    status = os.stat(path)
    return status.st_dev, status.st_ino
