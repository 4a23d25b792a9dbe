"""Test helpers that use the real system: a small tmpfs mounted for one test, and the
peak memory of a script run in its own process (as the kernel counts it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


@contextmanager
def mounted_tmpfs(mount: Path, size: str, *, inodes: int | None = None, read_only: bool = False) -> Iterator[Path]:
    """A real tmpfs of ``size`` (mount's syntax, e.g. "1024k") and at most ``inodes``
    files and folders (its root is one) at ``mount``, read-only if asked, created here and
    unmounted after; skips the test where mounting is not allowed."""
    mount.mkdir()
    options = f"size={size}" + (f",nr_inodes={inodes}" if inodes is not None else "") + (",ro" if read_only else "")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount)], capture_output=True, text=True, timeout=30
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=30)


def proc_status(field: str) -> int:
    """A byte count from /proc/self/status (VmRSS, VmHWM)."""
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak_rss() -> int:
    """Reset the peak (VmHWM) to the current RSS and return that RSS."""
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")
    return proc_status("VmRSS")


def run_measured(script: str, *args: object, timeout: float) -> dict:
    """Run ``script`` in a fresh Python (it may ``from system import ...``) and return the
    JSON object its last output line holds."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
