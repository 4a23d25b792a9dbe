"""The checkpoint writers of the checkpoint tests: what a writer saves at each step (content
a pure function of the step), the loops the crash and failure tests run in writer
processes, and the check of what one left. Starting Python with torch costs seconds, so
one helper process (the "zygote", :class:`Zygote`) imports everything once and forks a
writer per call; the writers run the functions of this file, loaded by path.
"""

from __future__ import annotations

import os
import random
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from checkpoints import random_data, save

from cargohold.services.checkpoint import CheckpointDir, read_flat_range
from cargohold.services.core.errors import CheckpointError
from cargohold.services.tiers.fileformat import ARRAYS

WRITER_TOTAL = 3 * 2**18
"""Elements of the crash writer's buffer: 3 arrays x 3 MiB, so a save takes a while."""
WRITER_KEEP = 2


def writer_cuts(step: int, total: int = WRITER_TOTAL) -> list[int]:
    """Where the writer cuts its buffer into 3 files at ``step`` (varies with the step)."""
    return sorted(64 * u for u in random.Random(step).sample(range(1, total // 64), 2))


def save_writer_step(store: CheckpointDir, step: int) -> Path:
    """What the crash writer saves at ``step``: content a pure function of the step."""
    return save(store, step, random_data(WRITER_TOTAL, step), writer_cuts(step))


def writer_loop(root: str, timings: str) -> None:
    """Save steps after the latest one, forever (until killed); append each save's
    duration to ``timings`` so the test can aim its kills."""
    store = CheckpointDir(Path(root), keep_last=WRITER_KEEP)
    latest = store.latest()
    step = store.load(latest).step + 1 if latest is not None else 1
    while True:
        began = time.monotonic()
        save_writer_step(store, step)
        fd = os.open(timings, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.write(fd, f"{time.monotonic() - began:.6f}\n".encode())  # one small write: whole or nothing
        os.close(fd)
        step += 1


def save_steps(root: str, count: str) -> None:
    store = CheckpointDir(Path(root), keep_last=WRITER_KEEP)
    for step in range(1, int(count) + 1):
        save_writer_step(store, step)


def save_under_size_limit(root: str, limit: str, result: str) -> None:
    """Save step 2 of the writer with files limited to ``limit`` bytes; report the error."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(limit), hard))
    try:
        save_writer_step(CheckpointDir(Path(root), keep_last=WRITER_KEEP), 2)
        outcome = "saved"
    except CheckpointError as error:
        outcome = str(error)
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
    Path(result).write_text(outcome)


def verify_writer_checkpoint(path: Path) -> int:
    """Assert the checkpoint at ``path`` is complete and holds what the writer saves for
    its step; returns the step."""
    manifest = CheckpointDir(path.parent).load(path)
    assert path.name == f"step-{manifest.step:010d}"
    assert manifest.updates == manifest.step - 1
    assert [s.start for s in manifest.segments][1:] == writer_cuts(manifest.step)
    got = read_flat_range(path, manifest, 0, WRITER_TOTAL)
    expected = random_data(WRITER_TOTAL, manifest.step)
    for name in ARRAYS:
        assert torch.equal(got[name], expected[name]), f"{path}: {name} differs from step {manifest.step}'s"
    return manifest.step


# ------------------------------------------------------------------------------- zygote

ZYGOTE = r"""
import importlib.util, os, sys, traceback
import torch
torch.set_num_threads(1)  # no thread pools before fork
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[1])))  # its helpers, beside it
spec = importlib.util.spec_from_file_location("checkpoint_test_helpers", sys.argv[1])
helpers = importlib.util.module_from_spec(spec)
spec.loader.exec_module(helpers)
print("ready", flush=True)
for line in sys.stdin:
    command, *args = line.split()
    if command == "spawn":
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                getattr(helpers, args[0])(*args[1:])
            except BaseException:
                traceback.print_exc()
                code = 3
            sys.stderr.flush()
            os._exit(code)
        print(pid, flush=True)
    elif command == "wait":
        _, status = os.waitpid(int(args[0]), 0)
        print(os.waitstatus_to_exitcode(status), flush=True)
"""


class Zygote:
    """A Python process with torch and this file loaded, forking helper calls on demand."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self._log_file = open(log, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", ZYGOTE, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log_file,
            text=True,
        )
        self._reply("ready")

    def _reply(self, expected: str | None = None) -> str:
        line = self.proc.stdout.readline().strip()
        if not line or (expected is not None and line != expected):
            pytest.fail(f"zygote answered {line!r}; its log:\n{self.log.read_text()}")
        return line

    def _ask(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def spawn(self, function: str, *args: str) -> int:
        return int(self._ask(" ".join(["spawn", function, *args])))

    def wait(self, pid: int) -> int:
        """Reap a child; its exit code, or -signal if a signal ended it."""
        return int(self._ask(f"wait {pid}"))

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        self._log_file.close()
