"""Damaged checkpoints and failed saves: a flipped byte, a truncated file, a symbolic link
or a FIFO in the folder is caught naming the file (and skipped by latest()); a full disk,
a file-size limit (in a writer forked by the zygote, ``checkpoint_writers.py``) or an
unwritable place fails the save naming the file and the reason, and keeps the previous
checkpoint.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch
from checkpoint_writers import WRITER_KEEP, Zygote, save_writer_step, verify_writer_checkpoint
from checkpoints import (
    flat_manifest,
    random_data,
    save,
    write_segments,
)

from cargohold.services.checkpoint import MANIFEST_NAME, CheckpointDir, read_flat_range
from cargohold.services.core.errors import CheckpointError, CorruptCheckpointError
from cargohold.services.tiers.fileformat import ARRAYS, HEADER_BYTES, FileLayout

pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------------------- corruption


@pytest.mark.parametrize("where", ["magic", "header run id", "header checksum", "data start", "data end", "padding"])
def test_a_flipped_byte_is_caught_naming_the_file(tmp_path: Path, where: str) -> None:
    store = CheckpointDir(tmp_path)
    path = save(store, 4, random_data(4_000, 4), [1_000])
    manifest = store.load(path)
    segment = manifest.segments[1]
    victim = path / segment.file
    raw = bytearray(victim.read_bytes())
    layout = FileLayout(segment.stop - segment.start)
    offset = {
        "magic": 0,
        "header run id": raw.index(b"run-test"),
        "header checksum": raw.index(struct.pack("<I", manifest.files[1].crc32c), 0, HEADER_BYTES),
        "data start": HEADER_BYTES,
        "data end": layout.offset(2) + layout.array_bytes - 1,
        "padding": layout.file_bytes - 1,
    }[where]
    assert manifest.files[1].name == segment.file
    assert layout.file_bytes == len(raw) > layout.offset(2) + layout.array_bytes  # the last region has padding
    raw[offset] ^= 0x10
    victim.write_bytes(raw)
    with pytest.raises(CorruptCheckpointError, match=str(victim)):
        read_flat_range(path, manifest, 0, 4_000)
    read_flat_range(path, manifest, 0, 1_000)  # the other file is fine


def test_a_truncated_file_is_caught_and_skipped_by_latest(tmp_path: Path) -> None:
    store = CheckpointDir(tmp_path)
    older = save(store, 1, random_data(3_000, 1), [1_500])
    newer = save(store, 2, random_data(3_000, 2), [1_500])
    manifest = store.load(newer)
    victim = newer / manifest.segments[0].file
    for size in (victim.stat().st_size - 1, 50):
        with open(victim, "r+b") as handle:
            handle.truncate(size)
        with pytest.raises(CorruptCheckpointError, match=str(victim)):
            read_flat_range(newer, manifest, 0, 3_000)
        assert store.latest() == older


@pytest.mark.timeout(60)  # before reads refused FIFOs, opening one blocked for good
@pytest.mark.parametrize("kind", ["symbolic link", "FIFO"])
@pytest.mark.parametrize("victim", ["payload", "manifest"])
def test_only_regular_files_in_the_folder_are_read(tmp_path: Path, kind: str, victim: str) -> None:
    """A checkpoint's file that is a symbolic link (to an identical copy outside the
    folder) or a FIFO is refused at once naming it, by every reader: a symbolic link is
    never followed out of the folder, and a FIFO never blocks the open. Nothing is lost:
    the previous checkpoint is the latest, the link's target is untouched."""
    store = CheckpointDir(tmp_path / "ckpt")
    older = save(store, 1, random_data(3_000, 1), [1_500])
    newer = save(store, 2, random_data(3_000, 2), [1_500])
    manifest = store.load(newer)
    path = newer / (manifest.files[0].name if victim == "payload" else MANIFEST_NAME)
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.move(path, outside / path.name)
    if kind == "FIFO":
        os.mkfifo(path)
    else:
        path.symlink_to(outside / path.name)
    assert store.latest() == older
    with pytest.raises(CheckpointError, match=rf"{path}.*{kind}") as refused:
        store.resolve(str(newer))
    if victim == "manifest":
        assert isinstance(refused.value, CheckpointError)
        with pytest.raises(CheckpointError, match=rf"{path}.*{kind}"):
            store.load(newer)
    else:
        with pytest.raises(CorruptCheckpointError, match=rf"{path}.*{kind}"):
            read_flat_range(newer, manifest, 0, 3_000)
    assert (outside / path.name).stat().st_nlink == 1
    assert torch.equal(read_flat_range(older, store.load(older), 0, 3_000)["master"], random_data(3_000, 1)["master"])


# ----------------------------------------------------------------------------- disk full


def _mount_tmpfs(mountpoint: Path, size: str) -> None:
    mountpoint.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mountpoint)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if result.returncode != 0:
        pytest.skip(
            f"cannot mount a {size} tmpfs here ({result.stderr.strip() or result.returncode}); "
            "test_a_file_size_limit_fails_the_save covers a failed write instead"
        )


def _fill(directory: Path) -> Path:
    """Write a file until the filesystem is full."""
    filler = directory / "filler"
    block = b"\xa5" * 4096
    with open(filler, "wb", buffering=0) as handle:
        try:
            while True:
                handle.write(block)
        except OSError as error:
            assert error.errno == errno.ENOSPC
    return filler


def test_disk_full_fails_the_save_and_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    mountpoint = tmp_path / "small"
    _mount_tmpfs(mountpoint, "2m")
    try:
        store = CheckpointDir(mountpoint / "ckpt", keep_last=3)
        first_data = random_data(32_768, 1)  # 384 KiB
        first = save(store, 1, first_data, [16_384])
        full = os.strerror(errno.ENOSPC)

        # a payload that does not fit: the failing file is named and removed
        with pytest.raises(CheckpointError, match=rf"failed: {full} \(\S+/server0-shard000001-part00000\.tier\)"):
            save(store, 2, random_data(196_608, 2), [98_304])  # 2 x 1.1 MiB
        assert sorted(p.name for p in store.partial_dir(2).iterdir()) == ["server0-shard000000-part00000.tier"]
        store.abort(2)

        # payload written, then the manifest does not fit: the commit fails, nothing is left
        directory = store.begin(3)
        records = write_segments(directory, 3, 3, random_data(1_024, 3), [(0, 0, 1_024)])
        filler = _fill(mountpoint)
        manifest = flat_manifest(3, 3, 1_024, records)
        with pytest.raises(CheckpointError, match=rf"{MANIFEST_NAME} failed: {full}"):
            store.commit(3, manifest)
        assert not directory.exists()

        for _ in range(2):
            assert store.latest() == first
            got = read_flat_range(first, store.load(first), 0, 32_768)
            assert all(torch.equal(got[n], first_data[n]) for n in ARRAYS)
            filler.unlink(missing_ok=True)
        assert store.latest() == first
        assert save(store, 3, random_data(1_024, 3), []) == store.latest()  # space again: saves work
    finally:
        subprocess.run(["umount", str(mountpoint)], capture_output=True, timeout=30)


def test_a_file_size_limit_fails_the_save(zygote: Zygote, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    store = CheckpointDir(root, keep_last=WRITER_KEEP)
    first = save_writer_step(store, 1)
    result = tmp_path / "result.txt"
    pid = zygote.spawn("save_under_size_limit", str(root), str(1 << 20), str(result))
    assert zygote.wait(pid) == 0, zygote.log.read_text()
    message = result.read_text()
    named = re.search(rf"failed: {os.strerror(errno.EFBIG)} \((\S+)\)", message)
    assert named, message
    assert Path(named.group(1)).parent == store.partial_dir(2)
    assert not Path(named.group(1)).exists()
    assert not any(p.name.endswith(".tmp") for p in store.partial_dir(2).iterdir())
    assert store.latest() == first
    assert verify_writer_checkpoint(first) == 1


def test_an_unwritable_place_names_the_file_and_reason(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir"
    with pytest.raises(
        CheckpointError,
        match=rf"into {missing} failed: {os.strerror(errno.ENOENT)} "
        rf"\({missing}/server0-shard000000-part00000\.tier\)",
    ):
        write_segments(missing, 1, 1, random_data(64, 0), [(0, 0, 64)])
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(CheckpointError, match="file/step-0000000001.partial"):
        CheckpointDir(blocker).begin(1)
