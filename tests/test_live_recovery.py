"""Live recovery with real actors (cluster/live_recovery.py): a worker SIGKILLed before or
during a step is replaced from the state servers' live state. The run ends bitwise where
the uninterrupted run ends, every loss it reports is the uninterrupted run's, and no
checkpoint is read (the run has none to read)."""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import ray
import torch
from actor_faults import notice_in_the_next_forward
from reference import tiny_config

from cargohold.cluster.launcher import TrainingSession
from cargohold.cluster.live_recovery import live_refusal
from cargohold.cluster.supervise import train
from cargohold.services.checkpoint import CheckpointDir, read_flat_range

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

STEPS = 8


def _config(root: Path, **overrides):
    """Two workers, two servers; a checkpoint only after the last step (to compare the
    final state), never one a recovery could read."""
    return tiny_config(
        **{
            "steps": STEPS,
            "state_server__num_servers": 2,
            "checkpoint__dir": str(root),
            "checkpoint__every_steps": STEPS,
            **overrides,
        }
    )


def _final(root: Path) -> dict[str, torch.Tensor]:
    store = CheckpointDir(root)
    (step,) = store.complete_steps()
    assert step == STEPS
    path = store.final_dir(step)
    return read_flat_range(path, store.load(path), 0, store.load(path).total)


@pytest.fixture(scope="module")
def uninterrupted(ray_local, tmp_path_factory) -> tuple[dict[str, torch.Tensor], list[float]]:
    root = tmp_path_factory.mktemp("uninterrupted")
    result = train(_config(root))
    return _final(root), result.losses


def _assert_same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    for key in ("master", "exp_avg", "exp_avg_sq"):
        assert torch.equal(got[key], expected[key]), f"{key} differs"


def _pid(worker) -> int | None:
    """The worker's process id; None where it is dead (a kill timed for a step's end can land
    after the step, before the next begins)."""
    try:
        return ray.get(worker.__ray_call__.remote(lambda actor: os.getpid()))
    except ray.exceptions.RayActorError:
        return None


LOSSES = {2: (1, 0.0), 4: (0, 0.2), 6: (1, 0.7)}
"""Steps done before each loss -> (the worker's rank, the fraction of the step before's
time into the next step at which it is SIGKILLed; 0: just before that step starts)."""


class Losses:
    """Installed as ``TrainingSession.step``: SIGKILLs the workers a plan of losses names
    (as :data:`LOSSES`) and records each worker's process as each step (attempt) began."""

    def __init__(self, plan: dict[int, tuple[int, float]], monkeypatch: pytest.MonkeyPatch) -> None:
        self.plan = plan
        self.done: set[int] = set()
        self.processes: list[tuple[int, list[int | None]]] = []  # steps done, each worker's pid
        self._began: list[float] = []
        self._timers: list[threading.Timer] = []
        original = TrainingSession.step
        monkeypatch.setattr(TrainingSession, "step", lambda session: (self._before(session), original(session))[1])

    def _before(self, session: TrainingSession) -> None:
        self._began.append(time.monotonic())
        pids = [_pid(w) for w in session.workers]
        self.processes.append((session.step_count, pids))
        if (count := session.step_count) in self.plan and count not in self.done:
            self.done.add(count)
            rank, fraction = self.plan[count]  # the pid now: an actor in a step answers no call
            pid = pids[rank]
            assert pid is not None, f"worker {rank} died before its planned loss"
            if fraction == 0.0:
                os.kill(pid, signal.SIGKILL)
            else:
                delay = fraction * (self._began[-1] - self._began[-2])
                self._timers.append(threading.Timer(delay, os.kill, [pid, signal.SIGKILL]))
                self._timers[-1].start()

    def joined(self) -> None:
        for timer in self._timers:
            timer.join()
        assert self.done == set(self.plan)


def test_workers_killed_before_and_during_steps_are_replaced_live_and_the_run_ends_bitwise(
    uninterrupted, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three losses in one run, each replaced live from the servers: worker 1 just before
    step 3; worker 0 0.2 of a step's time into step 5 (forward and backward); worker 1 0.7
    into step 7 (the pushes and the commit: the step in flight is settled on the servers,
    finished where some segments committed it). The placement group, the servers and the
    surviving worker's process are kept (only the lost worker's process starts again), no
    step is computed again, and the run ends bitwise where the uninterrupted run ends."""
    starts = []
    original_start = TrainingSession._start
    monkeypatch.setattr(TrainingSession, "_start", lambda session: (starts.append(1), original_start(session)))
    losses_of_run = Losses(LOSSES, monkeypatch)
    started = time.monotonic()
    result = train(_config(tmp_path, checkpoint__max_failures=len(LOSSES)))
    losses_of_run.joined()
    state, losses = uninterrupted
    took = f"{time.monotonic() - started:.1f}s"
    assert result.restarts == len(LOSSES) and result.live_recoveries == len(LOSSES), took
    assert len(starts) == 1, "the placement group and the state servers were kept"
    processes = losses_of_run.processes
    for count, (rank, _) in LOSSES.items():  # the next attempt runs on the survivor's process and a new one
        attempt = next(i for i, (done_steps, _) in enumerate(processes) if done_steps == count)
        before, after = processes[attempt][1], processes[attempt + 1][1]
        assert after[rank] != before[rank] and after[1 - rank] == before[1 - rank], f"{count}: {before} -> {after}"
    assert result.steps_recomputed == 0
    assert len(result.losses) == STEPS
    assert result.losses[:4] == losses[:4], "a loss before a step changes no loss"
    # A step the kill did not stop before its update landed everywhere has no report (nan).
    assert all(got == want or math.isnan(got) for got, want in zip(result.losses, losses, strict=True))
    _assert_same(_final(tmp_path), state)


FP16 = {
    "worker__compute_dtype": "float16",
    "worker__grad_wire_dtype": "float16",
    "optim__loss_scale__init_scale": 2.0**18,
    "optim__loss_scale__growth_interval": 2,
}
"""fp16 compute with a first scale the tiny model's gradients overflow at and growth every
2 clean steps: steps 1 and 4 overflow, the scale grows after steps 3 and 6."""


@pytest.mark.slow  # 40 s; the default run has its parts: test_step_ledger.py, test_fp16's resume
def test_an_fp16_run_goes_on_live_with_the_loss_scale_its_lost_workers_held(
    ray_local, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Worker 1 killed just before step 5 (the scale backed off at step 4: a replacement
    starting from the first scale would overflow again) and worker 0 0.7 into step 6 (the
    step whose clean update grows the scale): the run goes on live each time, with the
    scale the launcher replayed, and ends bitwise where the uninterrupted fp16 run ends,
    with the same skipped steps and final scale."""
    whole = train(_config(tmp_path / "whole", **FP16))
    assert whole.skipped_steps == [1, 4], "the plan above needs these overflows"
    plan = {4: (1, 0.0), 5: (0, 0.7)}
    losses_of_run = Losses(plan, monkeypatch)
    result = train(_config(tmp_path / "live", checkpoint__max_failures=len(plan), **FP16))
    losses_of_run.joined()
    assert result.live_recoveries == len(plan) and result.steps_recomputed == 0
    assert result.skipped_steps == whole.skipped_steps and result.loss_scale == whole.loss_scale
    assert all(got == want or math.isnan(got) for got, want in zip(result.losses, whole.losses, strict=True))
    _assert_same(_final(tmp_path / "live"), _final(tmp_path / "whole"))


def test_an_update_a_lost_worker_committed_on_some_segments_is_finished_on_the_rest(
    uninterrupted, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The worker dies between two of its commits of step 5's update: the servers hold
    that update applied on some segments and staged on others; the live recovery finishes
    it on those with the terms the others were committed with, and the run goes on from
    step 6, ending bitwise where the uninterrupted run ends."""

    def die_after_the_first_commit(actor) -> int:  # defined here: Ray pickles it by value
        """Run in a worker actor: from now on, its process kills itself right after its first
        commit of the next update lands; its other segments' commits (issued from a pool,
        at once) wait and are never sent. Returns how many segments it commits."""
        port, next_update = actor.step.port, actor.step.updates + 1
        original, first = port.update, threading.Lock()

        def update_then_die(segment, update, *, gradient, terms, out=None):
            if update == next_update and gradient is None and terms is not None:
                if not first.acquire(blocking=False):
                    threading.Event().wait()  # until the first commit's kill
                original(segment, update, gradient=gradient, terms=terms, out=out)
                os.kill(os.getpid(), signal.SIGKILL)
            return original(segment, update, gradient=gradient, terms=terms, out=out)

        port.update = update_then_die
        return len(actor.step.segments)

    original_step = TrainingSession.step
    segments: list[int] = []

    def step_with_fault(session: TrainingSession):
        if not segments and session.step_count == 4:
            segments.append(ray.get(session.workers[1].__ray_call__.remote(die_after_the_first_commit)))
        return original_step(session)

    monkeypatch.setattr(TrainingSession, "step", step_with_fault)
    caplog.set_level(logging.INFO, logger="cargohold.cluster.live_recovery")
    result = train(_config(tmp_path, checkpoint__max_failures=1))
    state, losses = uninterrupted
    assert segments[0] >= 2, "the worker must commit more than one segment for a part-committed update"
    finished = [r.args for r in caplog.records if r.getMessage().split(": ")[-1].startswith("update 5 finished on")]
    assert finished, "the update was not finished on the segments left staged"
    assert finished[0][-1] >= segments[0] - 1, "every segment but the one committed was finished"
    assert result.restarts == 1 and result.live_recoveries == 1
    assert result.losses[:4] == losses[:4] and result.losses[5:] == losses[5:]
    _assert_same(_final(tmp_path), state)


def test_a_worker_given_a_preemption_notice_finishes_its_step_and_is_replaced_without_a_failure(
    uninterrupted, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM (a spot reclaim's notice) reaches worker 1 in the middle of step 5: it
    finishes the step and reports that it is leaving; the launcher replaces it after step
    5 (worker 0's process joins the next group with its replacement) from the servers'
    live state, counting no failure and recomputing nothing, and the run ends bitwise
    where the uninterrupted run ends."""

    starts = []
    original_start, original_step = TrainingSession._start, TrainingSession.step
    monkeypatch.setattr(TrainingSession, "_start", lambda session: (starts.append(1), original_start(session)))
    noticed: list[list[int]] = []  # the ranks leaving after each step

    processes: list[list[int]] = []  # each worker's pid as each step began

    def step_with_notice(session: TrainingSession):
        processes.append([_pid(w) for w in session.workers])
        if session.step_count == 4 and len(noticed) == 4:
            notice_in_the_next_forward(session.workers[1])
        report = original_step(session)
        noticed.append(list(session.leaving))
        return report

    monkeypatch.setattr(TrainingSession, "step", step_with_notice)
    result = train(_config(tmp_path, checkpoint__max_failures=0))  # a planned loss is no failure
    state, losses = uninterrupted
    assert noticed[4] == [1] and not any(noticed[5:]), "worker 1 reported leaving with step 5, and only then"
    assert processes[5][0] == processes[4][0] and processes[5][1] != processes[4][1], "only worker 1 was replaced"
    assert result.preemptions == 1 and result.restarts == 0 and result.steps_recomputed == 0
    assert len(starts) == 1, "the placement group and the state servers were kept"
    assert result.losses == losses
    _assert_same(_final(tmp_path), state)


@pytest.mark.slow  # 45 s; the default run has its parts: test_settlement.py, test_step_ledger.py
def test_a_delayed_update_committed_nowhere_goes_on_live_as_a_resume_from_its_step_does(
    ray_local, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A delayed-update run whose update 4 (committed during step 5's compute) reaches no
    segment: both workers' commits of it are held back and both are killed just before step
    5 (a node with every worker reclaimed). The servers stand at update 3 with update 4
    staged everywhere; the launcher finishes it with the
    terms step 4 reported, and the run goes on live. Its pipeline starts afresh, as a run
    resumed from the step-4 checkpoint starts: it ends bitwise where that resumed run ends,
    with its losses, recomputing nothing."""

    def hold_the_next_commits(actor) -> None:  # defined here: Ray pickles it by value
        """Run in a worker actor: the commits of its next update are never sent."""
        port, next_update = actor.step.port, actor.step.updates + 1
        original = port.update

        def update_or_hold(segment, update, *, gradient, terms, out=None):
            if update == next_update and gradient is None and terms is not None:
                threading.Event().wait()
            return original(segment, update, gradient=gradient, terms=terms, out=out)

        port.update = update_or_hold

    delayed = {"worker__delayed_update": True}
    saved = train(_config(tmp_path / "saved", **delayed, checkpoint__every_steps=4))
    resumed = train(
        _config(tmp_path / "resumed", **delayed, checkpoint__resume=str(tmp_path / "saved" / "step-0000000004"))
    )
    original_step = TrainingSession.step

    killed: list[int] = []

    def step_holding_commits(session: TrainingSession):
        if session.step_count == 3 and not killed:
            ray.get([w.__ray_call__.remote(hold_the_next_commits) for w in session.workers])
        if session.step_count == 4 and not killed and (pid := _pid(session.workers[0])) is not None:
            killed.append(pid)
            os.kill(pid, signal.SIGKILL)  # worker 1 by the plan below
        return original_step(session)

    monkeypatch.setattr(TrainingSession, "step", step_holding_commits)
    losses_of_run = Losses({4: (1, 0.0)}, monkeypatch)
    live = train(_config(tmp_path / "live", **delayed, checkpoint__max_failures=1))
    losses_of_run.joined()
    assert killed and live.live_recoveries == 1 and live.steps_recomputed == 0
    assert live.losses[:4] == saved.losses[:4] and live.losses[4:] == resumed.losses
    _assert_same(_final(tmp_path / "live"), _final(tmp_path / "resumed"))


def test_only_device_segments_are_refused_live_naming_them() -> None:
    assert live_refusal(tiny_config()) is None
    assert live_refusal(tiny_config(**FP16)) is None, "fp16's loss scale is the launcher's to replay"
    assert live_refusal(tiny_config(worker__delayed_update=True)) is None, "its pipeline starts afresh"
    reason = live_refusal(tiny_config(worker__optimizer_on_device_fraction=0.5))
    assert reason is not None and "optimizer_on_device_fraction" in reason
