"""Faults the recovery tests inject into a run's Ray actors: a SIGKILL, now or at the
start of a given step; a preemption notice during the next step."""

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


def notice_in_the_next_forward(worker) -> None:
    """Make worker actor ``worker`` send its own process SIGTERM (a spot reclaim's notice)
    from its next step's first loss: on its main thread, during the step."""

    def install(actor) -> None:  # nested: Ray pickles it by value (tests/ is not on the actors' path)
        original = actor.step.loss

        def loss_then_notice(model, batch, device):
            actor.step.loss = original
            os.kill(os.getpid(), signal.SIGTERM)
            return original(model, batch, device)

        actor.step.loss = loss_then_notice

    ray.get(worker.__ray_call__.remote(install))
