"""Issue 27: two runs on one machine never destroy each other's state, and every way out
of a run leaves the last complete checkpoint resumable.

Row A (a second run with a live run's run id and tier path) at the launcher's level, row
B (two live runs with one ``checkpoint.dir``) and row D (KeyboardInterrupt, SystemExit,
an exception from a callback or SIGTERM while a checkpoint is being written), each on a
real Ray cluster with real state servers on loopback.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import ray
import yaml
from reference import tiny_config

from cargohold.cluster.claims import claimed_folders
from cargohold.cluster.schema.io import to_user_dict
from cargohold.cluster.schema.train import TrainConfig
from cargohold.cluster.supervise import train
from cargohold.services.checkpoint import CheckpointDir, Manifest
from cargohold.services.core.errors import ConfigError
from cargohold.services.worker.step_report import StepReport

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _config(root: Path, **overrides: object) -> TrainConfig:
    return tiny_config(
        steps=4,
        checkpoint__dir=str(root / "checkpoints"),
        checkpoint__every_steps=2,
        **overrides,
    )


def _tier(nvme: Path) -> dict[str, object]:
    """Most of the tiny model's state in partition files under ``nvme``."""
    return {"nvme_paths": [str(nvme)], "ram_budget_bytes": 320 << 10, "partition_bytes": 64 << 10, "buffer_count": 3}


def _manifest(path: Path) -> Manifest:
    return CheckpointDir(path.parent).load(path)


class Interrupt:
    """How a run is left in :func:`test_every_way_out_leaves_the_pending_checkpoint_resumable`."""

    @staticmethod
    def error(report: StepReport) -> None:
        raise ValueError("a user's on_step failed")

    @staticmethod
    def ctrl_c(report: StepReport) -> None:
        raise KeyboardInterrupt

    @staticmethod
    def exit(report: StepReport) -> None:
        sys.exit(3)

    @staticmethod
    def sigterm(report: StepReport) -> None:
        os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.parametrize(
    ("way", "raised"),
    [
        ("error", ValueError),
        ("sigterm", SystemExit),
        # the same way out as an error's (any BaseException): in the long run only
        pytest.param("ctrl_c", KeyboardInterrupt, marks=pytest.mark.slow),
        pytest.param("exit", SystemExit, marks=pytest.mark.slow),
    ],
)
def test_every_way_out_leaves_the_pending_checkpoint_resumable(
    ray_local, tmp_path: Path, way: str, raised: type[BaseException]
) -> None:
    """Row D: the run leaves while the checkpoint of step 2 is being written (begun after
    step 2, finished after step 3's callbacks). It used to leave only step-2.partial:
    nothing to resume. Now the pending checkpoint is finished (``latest`` finds it complete,
    its files verified), the actors and tier folders are gone as after any run; SIGTERM
    leaves like Ctrl-C (exit status 143)."""
    nvme = tmp_path / "nvme"
    config = _config(tmp_path, state_server__tier=_tier(nvme))
    leave = getattr(Interrupt, way)
    seen: list[int] = []

    def on_step(report: StepReport) -> None:
        seen.append(report.step)
        if report.step == 3:
            leave(report)

    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(raised) as caught:
        train(config, on_step=on_step)
    if way == "sigterm":
        assert caught.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is handler  # the run's own is gone with it
    store = CheckpointDir(Path(config.checkpoint.dir))
    assert seen == [1, 2, 3]
    assert not list(store.root.glob("*.partial"))
    latest = store.resolve("latest")
    assert latest.name == "step-0000000002" and _manifest(latest).step == 2
    assert not [name for name in ray.util.list_named_actors() if "state-server" in name or "worker" in name]
    assert not list(nvme.iterdir())


def test_a_second_live_run_on_the_same_checkpoint_dir_is_refused(ray_local, tmp_path: Path) -> None:
    """Row B: two concurrent runs with one checkpoint.dir both exited 0 and the folder
    held only the second's checkpoints. The first run claims the folder for its life; a
    second, started while it trains, is refused before any actor starts (a ConfigError:
    exit status 2) and touches nothing; the first run's checkpoints are all there."""
    config = _config(tmp_path)
    second = dataclasses.replace(config, seed=8)
    refusals: list[str] = []

    def start_the_second(report: StepReport) -> None:
        if report.step == 3:  # the first run's checkpoint of step 2 is being written
            before = sorted(os.listdir(config.checkpoint.dir))
            with pytest.raises(ConfigError) as refused:
                train(second)
            refusals.append(str(refused.value))
            assert sorted(os.listdir(config.checkpoint.dir)) == before

    first = train(config, on_step=start_the_second)
    assert len(refusals) == 1
    assert "checkpoint.dir" in refusals[0] and "in use by another live run" in refusals[0]
    assert [p.name for p in first.checkpoints] == ["step-0000000002", "step-0000000004"]
    assert {_manifest(p).run_id for p in first.checkpoints} == {first.run_id}
    with claimed_folders(second):  # the claim ends with the run
        pass


@pytest.mark.slow  # three runs; test_checkpoint.py's test_pruning_removes_only_the_owners_checkpoints is fast
def test_pruning_leaves_another_runs_checkpoints(ray_local, tmp_path: Path) -> None:
    """Row B's pruning: a run that follows another in the same checkpoint.dir prunes only
    its own checkpoints (keep_last 1), never the earlier run's; a run resuming the
    earlier one prunes that run's in turn, and says which run it resumed."""
    config = _config(tmp_path, checkpoint__keep_last=1)
    earlier = train(config)
    root = Path(config.checkpoint.dir)
    assert [p.name for p in root.iterdir()] == ["step-0000000004"]
    later = train(dataclasses.replace(config, steps=2, seed=8))
    assert sorted(p.name for p in root.iterdir()) == ["step-0000000002", "step-0000000004"]
    assert _manifest(root / "step-0000000004").run_id == earlier.run_id
    assert _manifest(root / "step-0000000002").run_id == later.run_id
    resumed = train(
        dataclasses.replace(config, steps=6, checkpoint=dataclasses.replace(config.checkpoint, resume="latest"))
    )
    assert resumed.resumed_run_id == earlier.run_id
    assert sorted(p.name for p in root.iterdir()) == ["step-0000000002", "step-0000000006"]


@pytest.mark.slow
def test_a_second_run_with_a_live_runs_id_and_tier_path_deletes_nothing(ray_local, tmp_path: Path) -> None:
    """Row A end to end: while a run trains, ``cargohold train`` with its run id and tier
    path (its own Ray cluster) is refused ("in use") and its teardown sweep used to
    delete the live run's tier folder, which then died with DATA_LOSS. Now the live run
    ends normally and the second leaves nothing of its own."""
    nvme = tmp_path / "nvme"
    config = tiny_config(steps=6, run_id="run-shared", state_server__tier=_tier(nvme))
    second = tmp_path / "second.yaml"
    second.write_text(yaml.safe_dump(to_user_dict(dataclasses.replace(config, steps=2))))
    outcome: list[subprocess.CompletedProcess] = []

    def start_the_second(report: StepReport) -> None:
        if report.step == 2:
            outcome.append(
                subprocess.run(
                    [sys.executable, "-m", "cargohold.cluster.cli", "train", "--config", str(second)],
                    capture_output=True,
                    text=True,
                    timeout=240,
                )
            )
            assert list(nvme.rglob("*.bin")), "the live run's partition files are still there"

    result = train(config, on_step=start_the_second)
    assert len(result.losses) == 6
    assert outcome[0].returncode != 0 and "in use" in outcome[0].stderr, outcome[0].stderr[-2000:]
    assert not list(nvme.iterdir())
