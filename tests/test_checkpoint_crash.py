"""Crash consistency of checkpoints under SIGKILL: writer processes saving one step after
another are killed at random points, and every complete checkpoint always holds exactly
its step's data. The writers are forked by the zygote (``checkpoint_writers.py``; the
``zygote`` fixture is in conftest.py).
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import time
from pathlib import Path

import pytest
from checkpoint_writers import WRITER_KEEP, Zygote, verify_writer_checkpoint

from cargohold.services.checkpoint import CheckpointDir
from cargohold.services.core.errors import CheckpointError

pytestmark = pytest.mark.timeout(120)


# ------------------------------------------------------------------- crash consistency


def _crash_trials(zygote: Zygote, root: Path, trials: int, seed: int) -> None:
    started = time.monotonic()
    pid = zygote.spawn("save_steps", str(root.with_name("calibration")), "2")
    assert zygote.wait(pid) == 0, zygote.log.read_text()
    floor = (time.monotonic() - started) / 2
    timings = root.with_name("timings.txt")
    store = CheckpointDir(root)
    partial_seen = progress = 0
    for trial in range(trials):
        # aim at ~3 saves, so kills land in every phase; the duration of a save is the
        # median of the writers' recent ones (the machine's load changes), never below a
        # floor that grows while kills keep coming too early for any save to finish
        recent = [float(x) for x in timings.read_text().split()[-9:]] if timings.exists() else []
        per_save = max(floor, statistics.median(recent)) if recent else floor
        delay = random.Random(seed + trial).uniform(0.0, 3.0 * per_save)
        before = store.complete_steps()
        pid = zygote.spawn("writer_loop", str(root), str(timings))
        try:
            time.sleep(delay)
        finally:
            os.kill(pid, signal.SIGKILL)
            code = zygote.wait(pid)
        assert code == -signal.SIGKILL, f"writer ended by itself ({code}):\n{zygote.log.read_text()}"
        names = sorted(os.listdir(root)) if root.exists() else []
        state = f"trial {trial}, killed after {delay:.3f}s (a save ~{per_save:.3f}s), left {names}"
        partial_seen += any(name.endswith(".partial") for name in names)
        steps = store.complete_steps()
        progress += steps != before
        if steps == before and delay > 2.0 * per_save:
            floor = 1.5 * per_save
        latest = store.latest()
        if latest is None:
            assert steps == [], f"{state}: complete directories {steps} but latest() is None"
            continue
        assert not latest.name.endswith(".partial"), state
        # every directory under a complete name is complete and holds exactly its step's data
        try:
            assert [verify_writer_checkpoint(store.final_dir(s)) for s in steps] == steps
        except (AssertionError, CheckpointError) as error:
            pytest.fail(f"{state}: {error}")
        assert latest == store.final_dir(steps[-1]) and len(steps) <= WRITER_KEEP + 1, state
    # the kills landed mid-save at least once, and the writer got somewhere
    assert partial_seen > 0 and progress > 0, (partial_seen, progress, per_save, floor)


def test_sigkill_during_saves_never_exposes_a_partial_checkpoint(zygote: Zygote, tmp_path: Path) -> None:
    _crash_trials(zygote, tmp_path / "ckpt", trials=20, seed=1_000)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkill_during_saves_many_trials(zygote: Zygote, tmp_path: Path) -> None:
    _crash_trials(zygote, tmp_path / "ckpt", trials=200, seed=50_000)
