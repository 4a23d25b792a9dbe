"""Crash consistency of tier checkpoints: a writer that resumes from its latest checkpoint,
trains and saves (hard links, RAM partitions written in the background, manifest last)
is SIGKILLed at random points; every complete checkpoint is always exactly its step's
state. The writer is a child process running :func:`crash_writer` of this file."""

from __future__ import annotations

import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tier_checkpoints import (
    assert_same_state,
    fresh_registry,
    push_steps,
    read_checkpoint,
    save_checkpoint,
    state_of,
    tier_config,
    whole_segments,
)

from cargohold.services.checkpoint import CheckpointDir
from cargohold.services.checkpoint.writer import SegmentCheckpointer
from cargohold.services.core.errors import CheckpointError
from cargohold.services.segments.segment_registry import SegmentRegistry
from cargohold.services.tiers.storage import TieredStorage

pytestmark = pytest.mark.timeout(120)


CRASH_KEEP = 2


def crash_writer(root: str, tier_root: str) -> None:
    """Resume from the latest checkpoint under ``root`` (or start fresh), then train and
    checkpoint one step after another until killed; prints "ready" once restored, "saving"
    when a checkpoint begins and "saved <step> <seconds of the step> <seconds of the
    checkpoint>" after each commit. Run in a child process."""
    store = CheckpointDir(Path(root), keep_last=CRASH_KEEP)
    latest = store.latest()
    if latest is None:
        registry, step = fresh_registry(tier_config(Path(tier_root))), 0
    else:
        manifest = store.load(latest)
        registry, step = SegmentRegistry(TieredStorage(tier_config(Path(tier_root)))), manifest.step
        SegmentCheckpointer(registry, "server0").restore(str(latest), manifest, whole_segments())
    print("ready", flush=True)
    while True:
        step += 1
        started = time.perf_counter()
        push_steps(registry, range(step, step + 1))
        print("saving", flush=True)
        saving = time.perf_counter()
        save_checkpoint(store, registry, step)
        done = time.perf_counter()
        print(f"saved {step} {done - started:.6f} {done - saving:.6f}", flush=True)


class CrashWriter:
    """A child process running :func:`crash_writer`."""

    def __init__(self, root: Path, tier_root: Path) -> None:
        script = (
            f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            f"from test_tier_checkpoint_crash import crash_writer; crash_writer({str(root)!r}, {str(tier_root)!r})"
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
    registry = fresh_registry(None)
    states = [state_of(registry)]
    for step in range(1, steps + 1):
        push_steps(registry, range(step, step + 1))
        states.append(state_of(registry))
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
        # a kill between a commit's rename and its prune leaves one checkpoint more than
        # keep_last; the next commit that finishes prunes them all (kills in that window
        # trial after trial add one each)
        assert latest == store.final_dir(steps[-1]), state
        assert len(steps) <= max(len(before), CRASH_KEEP) + 1, f"{state}: {steps} after {before}"
        if steps[-1] >= len(expected):
            expected = _reference_states(steps[-1] + 10)
        for step in steps:  # every complete checkpoint holds exactly its step's state
            try:
                assert_same_state(read_checkpoint(store.final_dir(step)), expected[step])
            except (AssertionError, CheckpointError) as error:
                pytest.fail(f"{state}: step {step}: {error}")
    assert partial_seen > 0 and store.complete_steps(), (partial_seen, store.complete_steps())


def test_sigkill_during_tier_saves_never_exposes_a_partial_checkpoint(tmp_path: Path) -> None:
    """A writer that resumes from its latest checkpoint, trains and saves (hard links,
    RAM partitions written in the background, manifest last) is SIGKILLed at random
    points 6 times (150 in the slow variant): every complete checkpoint is always exactly its step's state, and
    the next writer always resumes from one."""
    _kill_trials(tmp_path, trials=6, seed=7_000)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkill_during_tier_saves_many_trials(tmp_path: Path) -> None:
    _kill_trials(tmp_path, trials=150, seed=90_000)
