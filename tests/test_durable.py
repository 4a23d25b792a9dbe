"""The one durable-write helper on real files: the new content replaces the old whole,
and a write that fails part-way (an error in the writer, a full disk, a file size
limit, the process killed) leaves the previous file as it was; every failure the
process survives also leaves no temporary file behind."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from system import mounted_tmpfs

from cargohold.services.core.durable import TEMP_SUFFIX, replace_durably

pytestmark = pytest.mark.timeout(60)

OLD = b"the previous content\n" * 100


def _previous(directory: Path) -> Path:
    target = directory / "state.bin"
    target.write_bytes(OLD)
    return target


def _left(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_the_new_content_replaces_the_old(tmp_path: Path) -> None:
    target = _previous(tmp_path)
    with replace_durably(target) as temporary:
        assert temporary == str(target) + TEMP_SUFFIX
        Path(temporary).write_bytes(b"new")
        assert target.read_bytes() == OLD, "the target changes only when the block ends"
    assert target.read_bytes() == b"new"
    with replace_durably(tmp_path / "fresh.json", sync_directory=False, drop_cache=True) as temporary:
        Path(temporary).write_text("{}")
    assert (tmp_path / "fresh.json").read_text() == "{}"
    assert _left(tmp_path) == ["fresh.json", "state.bin"]


def test_an_error_part_way_keeps_the_previous_file(tmp_path: Path) -> None:
    target = _previous(tmp_path)
    with pytest.raises(ValueError, match="the writer failed"):
        with replace_durably(target) as temporary:
            with open(temporary, "wb") as out:
                out.write(b"half of the new content")
            raise ValueError("the writer failed")
    assert target.read_bytes() == OLD
    assert _left(tmp_path) == ["state.bin"]


def test_a_failed_rename_keeps_the_previous_file(tmp_path: Path) -> None:
    """The target became a directory: the rename fails, nothing is left over."""
    target = tmp_path / "taken"
    (target / "inside").mkdir(parents=True)
    with pytest.raises(OSError) as caught:
        with replace_durably(target) as temporary:
            Path(temporary).write_bytes(b"new")
    assert caught.value.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST)
    assert _left(tmp_path) == ["taken"] and _left(target) == ["inside"]


def test_a_full_disk_keeps_the_previous_file(tmp_path: Path) -> None:
    with mounted_tmpfs(tmp_path / "small", "256k") as mount:
        target = _previous(mount)
        with pytest.raises(OSError) as caught:
            with replace_durably(target) as temporary:
                Path(temporary).write_bytes(b"\xa5" * (1 << 20))
        assert caught.value.errno == errno.ENOSPC
        assert target.read_bytes() == OLD
        assert _left(mount) == ["state.bin"]


WRITER = textwrap.dedent("""
    import os, resource, signal, sys, time
    from cargohold.services.core.durable import replace_durably

    target, how = sys.argv[1], sys.argv[2]
    if how == "limit":  # a write past 64 KiB fails with EFBIG instead of killing the process
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    try:
        with replace_durably(target) as temporary:
            with open(temporary, "wb", buffering=0) as out:
                out.write(b"x" * 4096)
                print("writing", flush=True)
                while True:
                    out.write(b"x" * 4096)
                    if how == "kill":
                        time.sleep(0.001)
    except OSError as error:
        print(error.errno, flush=True)
""")


def _writer(target: Path, how: str) -> subprocess.Popen:
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(target), how], stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline().strip() == "writing"
    return writer


def test_a_file_size_limit_keeps_the_previous_file(tmp_path: Path) -> None:
    target = _previous(tmp_path)
    writer = _writer(target, "limit")
    with writer.stdout:  # not communicate(): readline() may have buffered the rest already
        out = writer.stdout.read()
    assert writer.wait(timeout=30) == 0 and out.strip() == str(errno.EFBIG)
    assert target.read_bytes() == OLD
    assert _left(tmp_path) == ["state.bin"]


def test_a_killed_writer_keeps_the_previous_file(tmp_path: Path) -> None:
    """SIGKILL leaves no chance to clean up: the temporary file may stay, the target holds
    the previous content, and the next write replaces both."""
    target = _previous(tmp_path)
    writer = _writer(target, "kill")
    writer.send_signal(signal.SIGKILL)
    writer.communicate(timeout=30)
    assert writer.returncode == -signal.SIGKILL
    assert target.read_bytes() == OLD
    assert os.path.getsize(str(target) + TEMP_SUFFIX) >= 4096, "killed part-way through the new content"
    with replace_durably(target) as temporary:
        Path(temporary).write_bytes(b"new")
    assert target.read_bytes() == b"new"
    assert _left(tmp_path) == ["state.bin"]
