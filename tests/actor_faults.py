"""Faults the recovery tests inject into a run's Ray actors: a SIGKILL, now or at the
start of a given step."""

from __future__ import annotations

import os
import signal

import pytest
import ray


def kill_actor(actor) -> int:
    """SIGKILL the process of Ray ``actor`` (a state server or a worker); returns its pid."""
    pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))
    os.kill(pid, signal.SIGKILL)
    return pid


def kill_a_worker_in_step(monkeypatch: pytest.MonkeyPatch, step: int, rank: int = 1) -> list[int]:
    """Make ``TrainingSession.step`` SIGKILL worker ``rank`` once, just before data step
    ``step`` runs; the list it returns gets the killed pid."""
    from cargohold.cluster.launcher import TrainingSession

    original_step = TrainingSession.step
    killed: list[int] = []

    def step_with_fault(session: TrainingSession):
        if not killed and session.step_count == step - 1:
            killed.append(kill_actor(session.workers[rank]))
        return original_step(session)

    monkeypatch.setattr(TrainingSession, "step", step_with_fault)
    return killed
