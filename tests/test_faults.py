"""Faults are detected within a bounded time: when a state server or a worker process is
SIGKILLed mid-run, the next step fails with a TrainingError naming the cause, instead of
hanging in a collective or an RPC."""

from __future__ import annotations

import time

import pytest
import ray
from actor_faults import kill_actor
from reference import tiny_config

from cargohold.cluster.actor_calls import get_all
from cargohold.cluster.launcher import TrainingSession
from cargohold.services.core.errors import ConfigError, TrainingError

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
DETECTION_LIMIT_S = 60.0


@pytest.mark.parametrize("victim", ["state-server", "worker-1"])
def test_a_killed_actor_fails_the_next_step_quickly(ray_local, victim: str) -> None:
    with TrainingSession(tiny_config(steps=5)) as session:
        session.step()
        kill_actor(session.servers[0] if victim == "state-server" else session.workers[1])
        started = time.monotonic()
        with pytest.raises(TrainingError) as error:
            session.step()
        elapsed = time.monotonic() - started
    assert elapsed < DETECTION_LIMIT_S, f"took {elapsed:.1f}s to notice"
    assert "step 2" in str(error.value)


def test_a_killed_state_servers_tier_folder_is_removed_at_teardown(ray_local, tmp_path) -> None:
    """A SIGKILLed server cannot delete its partition files; the launcher removes them on
    the server's node when the session closes, so restarts do not fill the drive."""
    nvme = tmp_path / "nvme"
    tier = {"nvme_paths": [str(nvme)], "ram_budget_bytes": 320 << 10, "partition_bytes": 64 << 10, "buffer_count": 3}
    with TrainingSession(tiny_config(steps=5, state_server__num_servers=2, state_server__tier=tier)) as session:
        session.step()
        folders = sorted(p.relative_to(nvme) for p in nvme.glob("*/server-*"))
        assert [str(f) for f in folders] == [f"{session.run_id}/server-0", f"{session.run_id}/server-1"]
        assert any((nvme / session.run_id / "server-0").iterdir())
        kill_actor(session.servers[0])
        with pytest.raises(TrainingError):
            session.step()
    assert not (nvme / session.run_id).exists(), sorted(nvme.rglob("*"))


def test_closing_during_a_delayed_update_stops_every_worker_cleanly(ray_local, caplog) -> None:
    """With the delayed update the last step's gather is still running collectives when
    the session closes; workers must let it finish before tearing down the process group
    (without that, this model segfaulted a worker at close in 4 runs out of 4)."""
    config = tiny_config(steps=3, worker__delayed_update=True, model__n_embd=256, model__n_layer=4)
    with caplog.at_level("WARNING", logger="cargohold.cluster.launcher"):
        with TrainingSession(config) as session:
            for _ in range(3):
                session.step()
            workers = list(session.workers)
    assert not [r for r in caplog.records if "teardown" in r.getMessage()], caplog.text
    for worker in workers:  # killed by close(), not dead of a crash before it
        with pytest.raises(ray.exceptions.RayActorError) as gone:
            ray.get(worker.__ray_call__.remote(lambda self: None), timeout=30)
        assert "SYSTEM_ERROR" not in str(gone.value), str(gone.value)


@ray.remote
class _NodeCheck:
    def refuse(self) -> None:
        raise ConfigError("worker.offload_params needs pinned host memory, which this worker cannot allocate")

    def fail(self) -> None:
        raise RuntimeError("boom")


def test_a_config_refused_inside_an_actor_stays_a_config_error(ray_local) -> None:
    """A key only a worker can check (pinned memory on its node) still exits with the bad
    config status and names the key; other failures of a call are training errors."""
    actor = _NodeCheck.remote()
    with pytest.raises(ConfigError, match="worker.offload_params") as error:
        get_all(actor.refuse.remote(), 60, "forming the worker process group")
    assert str(error.value).startswith("forming the worker process group: ")
    with pytest.raises(TrainingError, match="boom"):
        get_all(actor.fail.remote(), 60, "forming the worker process group")
