"""Faults are detected within a bounded time: when a state server or a worker process is
SIGKILLed mid-run, the next step fails with a TrainingError naming the cause, instead of
hanging in a collective or an RPC."""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray

from cargohold.cluster.launcher import TrainingSession
from cargohold.services.errors import TrainingError
from reference import tiny_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
DETECTION_LIMIT_S = 60.0


def _kill(actor) -> None:
    pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))
    os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("victim", ["state-server", "worker-1"])
def test_a_killed_actor_fails_the_next_step_quickly(ray_local, victim: str) -> None:
    with TrainingSession(tiny_config(steps=5)) as session:
        session.step()
        _kill(session.servers[0] if victim == "state-server" else session.workers[1])
        started = time.monotonic()
        with pytest.raises(TrainingError) as error:
            session.step()
        elapsed = time.monotonic() - started
    assert elapsed < DETECTION_LIMIT_S, f"took {elapsed:.1f}s to notice"
    assert "step 2" in str(error.value)
