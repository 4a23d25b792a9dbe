"""Checkpoints, resume and fault recovery with real actors: a run that is interrupted —
stopped and resumed, resumed onto another number of state servers, or hit by a SIGKILLed
state server or worker — ends bitwise where the uninterrupted run ends: weights, both
Adam moments and step counters."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import urllib.request
from pathlib import Path

import pytest
import ray
import torch
from actor_faults import kill_actor
from prometheus_client.parser import text_string_to_metric_families
from reference import tiny_config
from system import mounted_tmpfs

from cargohold.cluster.launcher import TrainingSession
from cargohold.cluster.supervise import train
from cargohold.services.checkpoint import CheckpointDir, read_flat_range
from cargohold.services.checkpoint.reshard import saved_layout
from cargohold.services.core.errors import CheckpointError, ConfigError, TrainingError
from cargohold.services.core.layout import gather_params, scatter_params
from cargohold.services.metrics.launcher import LauncherMetrics

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
STEPS = 8


def _final_state(directory: Path) -> dict[str, torch.Tensor]:
    store = CheckpointDir(directory)
    latest = store.latest()
    manifest = store.load(latest)
    assert manifest.step == STEPS
    return read_flat_range(latest, manifest, 0, manifest.total)


def _state_at(root: Path, step: int) -> dict[str, torch.Tensor]:
    store = CheckpointDir(root)
    path = store.final_dir(step)
    manifest = store.load(path)
    return read_flat_range(path, manifest, 0, manifest.total)


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    for key in ("master", "exp_avg", "exp_avg_sq"):
        assert torch.equal(a[key], b[key]), f"{key} differs by up to {(a[key] - b[key]).abs().max():.3e}"


@pytest.fixture(scope="module")
def uninterrupted_root(ray_local, tmp_path_factory) -> Path:
    """The checkpoints of a run of STEPS steps, uninterrupted: of step 4 (where the resume
    tests start from) and of the last step."""
    root = tmp_path_factory.mktemp("uninterrupted")
    result = train(
        tiny_config(steps=STEPS, state_server__num_servers=2, checkpoint__dir=str(root), checkpoint__every_steps=4)
    )
    assert len(result.checkpoints) == 2 and result.restarts == 0
    return root


@pytest.fixture(scope="module")
def uninterrupted(uninterrupted_root) -> dict[str, torch.Tensor]:
    return _final_state(uninterrupted_root)


def _copy_of_step_4(uninterrupted_root: Path, into: Path) -> Path:
    """A checkpoint folder of its own holding a copy of the uninterrupted run's step-4
    checkpoint (saved by 2 workers and 2 servers), for a test that resumes from it, damages
    it or saves beside it: one run fewer than training its own."""
    saved = CheckpointDir(uninterrupted_root).final_dir(4)
    shutil.copytree(saved, into / saved.name)
    return into


# Fewer, the same and more; the same (2) is also every other resume test's case.
@pytest.mark.parametrize("resume_servers", [pytest.param(n, marks=pytest.mark.slow) for n in (1, 2)] + [3])
def test_a_resume_onto_any_number_of_servers_ends_bitwise(
    uninterrupted, uninterrupted_root, tmp_path, resume_servers: int
) -> None:
    """Saved by 2 servers after 4 of 8 steps (the lr schedule spans all 8: the
    uninterrupted run's checkpoint), resumed onto fewer, the same and more."""
    second = tiny_config(
        steps=STEPS,
        state_server__num_servers=resume_servers,
        checkpoint__dir=str(tmp_path),
        checkpoint__resume=str(uninterrupted_root / "step-0000000004"),
    )
    resumed = train(second)
    assert resumed.first_step == 4 and len(resumed.losses) == STEPS - 4
    _assert_same(_final_state(tmp_path), uninterrupted)


def _tier(root: Path, partition_kib: int) -> dict[str, object]:
    """Most of the tiny model's state on disk (as in the training contract's NVMe test)."""
    return {
        "nvme_paths": [str(root / "nvme")],
        "ram_budget_bytes": 320 << 10,
        "partition_bytes": partition_kib << 10,
        "buffer_count": 3,
    }


# fast: tests/test_tier_checkpoint.py (the links) and test_a_resume_onto_any_number_of_servers_ends_bitwise
@pytest.mark.slow
def test_an_nvme_tier_checkpoint_links_its_files_and_resumes_bitwise(uninterrupted, tmp_path) -> None:
    """Saved with most state on the NVMe tier: the checkpoint hard-links the tier's
    partition files (they have a second name while the tier holds that version). Resumed
    onto one server with another partition size, the run ends where the uninterrupted one
    does."""
    checkpoints = tmp_path / "checkpoints"
    first = tiny_config(
        steps=STEPS,
        state_server__num_servers=2,
        checkpoint__dir=str(checkpoints),
        state_server__tier=_tier(tmp_path, 64),
    )
    store = CheckpointDir(checkpoints)
    with TrainingSession(first) as session:
        for _ in range(4):
            session.step()
        pending = session.checkpoint_begin(store)
        saved = session.checkpoint_finish(store, pending)
        files = sorted(saved.path.glob("*.tier"))
        linked = [f for f in files if f.stat().st_nlink == 2]
        assert len(files) == 28 and len(linked) >= 20, f"{len(linked)} of {len(files)} files linked"
        assert saved.linked_bytes == sum(f.stat().st_size for f in linked)
        assert saved.written_bytes == sum(f.stat().st_size for f in files) - saved.linked_bytes
        tier_files = {(f.stat().st_dev, f.stat().st_ino) for f in (tmp_path / "nvme").rglob("*.bin")}
        assert {(f.stat().st_dev, f.stat().st_ino) for f in linked} <= tier_files
    assert all(f.stat().st_nlink == 1 for f in files), "the stopped tier removed its names, the checkpoint kept its own"
    second = tiny_config(
        steps=STEPS,
        state_server__num_servers=1,
        checkpoint__dir=str(checkpoints),
        checkpoint__resume="latest",
        state_server__tier=_tier(tmp_path, 32),
    )
    resumed = train(second)
    assert resumed.first_step == 4
    _assert_same(_final_state(checkpoints), uninterrupted)


@pytest.mark.slow  # 26 s; resume without dropout is bitwise in the default run
def test_resume_with_dropout_is_bitwise(ray_local, tmp_path) -> None:
    """Dropout draws random masks every step: they are a function of (seed, step, rank),
    not of how many steps this process has run, so a resumed run draws the same masks."""
    dropout = {"model__dropout": 0.2, "steps": 6}
    whole = tmp_path / "whole"
    train(tiny_config(checkpoint__dir=str(whole), **dropout))
    halves = tmp_path / "halves"
    train(tiny_config(checkpoint__dir=str(halves), checkpoint__every_steps=3, **dropout))
    shutil.rmtree(CheckpointDir(halves).final_dir(6))
    resumed = train(tiny_config(checkpoint__dir=str(halves), checkpoint__resume="latest", **dropout))
    assert resumed.first_step == 3
    expected, got = (_state_at(root, 6) for root in (whole, halves))
    _assert_same(got, expected)


def _scrape(address: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.labels
    }


@pytest.mark.parametrize(
    "victim",
    [
        pytest.param("state-server", marks=pytest.mark.slow),
        "worker",
    ],  # a killed server: tests/test_faults.py, the soaks
)
def test_a_killed_actor_is_recovered_live_or_from_the_last_checkpoint(
    uninterrupted, tmp_path, monkeypatch, victim: str
) -> None:
    """A killed worker is replaced from the state servers' live state; a killed state
    server restarts everything from the last checkpoint. Either way the run ends where the
    uninterrupted one does and takes the same checkpoints."""
    original_step = TrainingSession.step
    killed = []

    def step_with_fault(session: TrainingSession):
        if not killed and session.step_count == 5:  # after the checkpoint of step 4
            killed.append(victim)
            kill_actor(session.servers[1] if victim == "state-server" else session.workers[1])
        return original_step(session)

    monkeypatch.setattr(TrainingSession, "step", step_with_fault)
    config = tiny_config(
        steps=STEPS,
        state_server__num_servers=2,
        checkpoint__dir=str(tmp_path),
        checkpoint__every_steps=2,
        checkpoint__max_failures=1,
    )
    metrics = LauncherMetrics()
    metrics.start(host="127.0.0.1")
    try:
        result = train(config, metrics=metrics)
        scraped = _scrape(metrics.address)
    finally:
        metrics.stop()
    assert killed == [victim] and result.restarts == 1 and len(result.recovery_seconds) == 1
    assert result.live_recoveries == (victim == "worker")
    # A server's death restarts from step 4's checkpoint: step 5, completed, is computed again.
    assert result.steps_recomputed == (victim == "state-server")
    assert len(result.losses) == STEPS
    _assert_same(_final_state(tmp_path), uninterrupted)
    # A checkpoint lands one step after it began: steps 2 and 4 before the kill (before
    # step 6), then 6 and 8 after the recovery (from step 4 after a server's death).
    assert [p.name for p in result.checkpoints] == [f"step-{s:010d}" for s in (2, 4, 6, 8)]
    # The launcher's metrics, scraped.
    assert scraped["cargohold_failures_total"] == 1 and scraped["cargohold_restarts_total"] == 1
    assert scraped["cargohold_live_recoveries_total"] == (victim == "worker")
    assert scraped["cargohold_steps_recomputed_total"] == result.steps_recomputed
    assert scraped["cargohold_recovery_seconds_count"] == 1 and scraped["cargohold_recovery_seconds_sum"] > 0
    assert scraped["cargohold_checkpoints_total"] == 4
    assert scraped["cargohold_checkpoint_bytes_total"] > 0
    assert scraped["cargohold_checkpoint_stall_seconds_count"] == scraped["cargohold_checkpoints_total"]


@pytest.mark.slow  # fast: test_a_killed_actor_is_recovered_live_or_from_the_last_checkpoint, tests/test_weights_nvme.py
def test_weights_on_nvme_with_a_killed_worker_end_where_weights_in_memory_end(
    uninterrupted, tmp_path, monkeypatch
) -> None:
    """Every block's weights in files (the window of 2 blocks) and most of the optimizer
    state on the NVMe tier (the update streamed through it, gradients staged beside the
    disk partitions), worker 1 SIGKILLed after the checkpoint of step 4: the replaced
    workers rebuild their files from the servers' live state, the run ends bitwise where the run with
    everything in memory ends, and the killed worker's folder and the tier are swept."""
    original_step = TrainingSession.step
    killed = []

    def step_with_fault(session: TrainingSession):
        if not killed and session.step_count == 5:
            killed.append(True)
            kill_actor(session.workers[1])
        return original_step(session)

    monkeypatch.setattr(TrainingSession, "step", step_with_fault)
    weights = tmp_path / "weights"
    config = tiny_config(
        steps=STEPS,
        state_server__num_servers=2,
        checkpoint__dir=str(tmp_path / "checkpoints"),
        checkpoint__every_steps=2,
        checkpoint__max_failures=1,
        worker__weights_nvme_path=str(weights),
        worker__weight_window=2,
        state_server__tier=_tier(tmp_path, partition_kib=64),
    )
    result = train(config)
    assert killed and result.restarts == 1 and result.live_recoveries == 1
    _assert_same(_final_state(tmp_path / "checkpoints"), uninterrupted)
    assert not any(weights.iterdir()), f"left behind: {sorted(p.name for p in weights.rglob('*'))}"
    assert not any((tmp_path / "nvme").iterdir()), "tier files left behind"


@pytest.mark.parametrize("earlier_run", [pytest.param(False, marks=pytest.mark.slow), True])
def test_a_failure_before_the_first_checkpoint_lands_is_recovered_leaving_nothing_behind(
    uninterrupted, uninterrupted_root, tmp_path, monkeypatch, caplog, earlier_run: bool
) -> None:
    """A state server dies while the first checkpoint is being written (begun after step
    2, its manifest not yet landed): its files are incomplete, so the checkpoint is
    discarded and the run restarts from the initial state, never from a checkpoint of an
    earlier run sharing the folder. The run ends bitwise where the uninterrupted one does,
    and the restart finds nothing of the dead attempt: no tier folder (the killed
    server's too), no partial checkpoint, no actor. (A lost worker recovers live, the
    servers finishing the checkpoint first: tests/test_live_recovery.py.)"""
    checkpoints, nvme = tmp_path / "checkpoints", tmp_path / "nvme"
    if earlier_run:  # an identical earlier run's last checkpoint, later than any of this run's
        shutil.copytree(uninterrupted_root / "step-0000000008", checkpoints / "step-0000000008")
    original_start, original_step = TrainingSession._start, TrainingSession.step
    starts: list[dict] = []

    def observed_start(session: TrainingSession) -> None:
        starts.append(
            {
                "run_id": session.run_id,
                "resume": session.resume,
                "tier": sorted(str(p.relative_to(nvme)) for p in nvme.rglob("*")) if nvme.exists() else [],
                "partial": sorted(p.name for p in checkpoints.glob("*.partial")),
                "actors": sorted(ray.util.list_named_actors()),
            }
        )
        original_start(session)

    def step_with_fault(session: TrainingSession):
        if len(starts) == 1 and session.step_count == 2:  # the checkpoint of step 2 is pending
            kill_actor(session.servers[1])  # a lost worker recovers live: tests/test_live_recovery.py
        return original_step(session)

    monkeypatch.setattr(TrainingSession, "_start", observed_start)
    monkeypatch.setattr(TrainingSession, "step", step_with_fault)
    config = tiny_config(
        steps=STEPS,
        state_server__num_servers=2,
        state_server__tier=_tier(tmp_path, 64),
        checkpoint__dir=str(checkpoints),
        checkpoint__every_steps=2,
        checkpoint__max_failures=1,
    )
    with caplog.at_level(logging.WARNING, logger="cargohold.cluster.launcher"):
        result = train(config)
    assert result.restarts == 1 and len(starts) == 2
    teardown = [r.getMessage() for r in caplog.records if r.name == "cargohold.cluster.launcher"]
    # A worker whose push met the dead server fails its step; its peer waits for it in a
    # collective, and is stopped at once, not after its shutdown's 30 s timeout.
    assert not [m for m in teardown if "timed out" in m], teardown
    assert [m for m in teardown if "blocked in a collective" in m], teardown
    first, restart = starts
    assert restart["resume"] is None  # the pending checkpoint lost a server's files
    assert restart["tier"] == [], "the dead attempt's tier folders are swept before the restart"
    assert restart["partial"] == [], "the pending checkpoint is completed or discarded before the restart"
    assert not [a for a in restart["actors"] if a.startswith(first["run_id"])]
    assert result.first_step == 0 and len(result.losses) == STEPS
    assert [p.name for p in result.checkpoints] == [f"step-{s:010d}" for s in (2, 4, 6, 8)]
    _assert_same(_final_state(checkpoints), uninterrupted)
    assert not list(checkpoints.glob("*.partial")) and not list(nvme.iterdir())


def test_failures_beyond_the_limit_stop_the_run(ray_local, tmp_path, monkeypatch) -> None:
    original_step = TrainingSession.step

    def always_fail(session: TrainingSession):
        if session.step_count == 3:
            kill_actor(session.servers[0])
        return original_step(session)

    monkeypatch.setattr(TrainingSession, "step", always_fail)
    config = tiny_config(steps=6, checkpoint__dir=str(tmp_path), checkpoint__every_steps=2, checkpoint__max_failures=1)
    with pytest.raises(TrainingError, match="step 4"):
        train(config)


def test_a_checkpoint_of_another_model_or_config_is_refused_or_warned(uninterrupted_root, tmp_path, caplog) -> None:
    """The manifest holds the saving run's config: a resume that changes a key giving the
    saved state another meaning is refused naming it before any actor starts (the model's
    width; its head count, which keeps every parameter's shape), a key that does not (the
    learning rate) is warned about and the run trains on from the checkpoint."""
    folder = _copy_of_step_4(uninterrupted_root, tmp_path)
    for key, saved, now in (("n_embd", 64, 32), ("n_head", 2, 4)):
        other = tiny_config(steps=6, checkpoint__dir=str(folder), checkpoint__resume="latest", **{f"model__{key}": now})
        with pytest.raises(ConfigError, match=rf"model\.{key} is {saved} there and {now} here \(another model"):
            train(other)
    faster = tiny_config(steps=6, optim__lr=0.02, checkpoint__dir=str(folder), checkpoint__resume="latest")
    with caplog.at_level("WARNING", logger="cargohold.cluster.resume"):
        resumed = train(faster)
    assert resumed.first_step == 4 and len(resumed.losses) == 2
    assert "config keys changed" in caplog.text and "optim.lr: 0.01 -> 0.02" in caplog.text


def test_a_flipped_byte_is_named_on_resume(uninterrupted_root, tmp_path) -> None:
    folder = _copy_of_step_4(uninterrupted_root, tmp_path)
    victim = sorted(CheckpointDir(folder).latest().glob("*.tier"))[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x40
    victim.write_bytes(bytes(data))
    with pytest.raises(TrainingError, match=victim.name):
        train(tiny_config(steps=6, checkpoint__dir=str(folder), checkpoint__resume="latest"))


def test_resume_onto_another_number_of_workers_restores_every_tensor(uninterrupted_root, tmp_path) -> None:
    """Saved by 2 workers and 2 servers, restored onto 1 worker and 3 servers: the flat
    space is laid out otherwise, yet every parameter's master weights, both moments and
    the workers' weights come back bitwise, and padding is zero."""
    saved_dir = CheckpointDir(_copy_of_step_4(uninterrupted_root, tmp_path)).latest()
    manifest = CheckpointDir(tmp_path).load(saved_dir)
    saved_space = saved_layout(manifest, str(saved_dir))
    flat = read_flat_range(saved_dir, manifest, 0, manifest.total)
    saved = {key: gather_params(saved_space, flat[key]) for key in flat}
    config = tiny_config(steps=6, worker__num_workers=1, state_server__num_servers=3)
    with TrainingSession(config, resume=saved_dir) as session:
        assert session.step_count == 4
        layout = session.layout
        assert layout.total != saved_space.total
        restored = {key: torch.full((layout.total,), float("nan")) for key in saved}
        for snapshot in session.server_snapshots():
            for segment_id, tensors in snapshot.items():
                segment = layout.segments[segment_id]
                assert int(tensors["step"]) == 4
                for key in saved:
                    restored[key][segment.start : segment.stop] = tensors[key]
        for key in saved:
            assert torch.equal(restored[key], scatter_params(layout, saved[key])), key
        assert torch.equal(session.all_worker_weights(), scatter_params(layout, saved["master"]))
        assert session.step().step == 5


def test_sigusr1_takes_a_checkpoint_on_demand(ray_local, tmp_path) -> None:
    def ask_at_step_3(report) -> None:
        if report.step == 3:
            os.kill(os.getpid(), signal.SIGUSR1)

    result = train(tiny_config(steps=5, checkpoint__dir=str(tmp_path)), on_step=ask_at_step_3)
    assert [p.name for p in result.checkpoints] == ["step-0000000003", "step-0000000005"]


@pytest.fixture
def small_disk(tmp_path):
    """A real 2.5 MiB filesystem: room for one checkpoint of the tiny model, not two."""
    with mounted_tmpfs(tmp_path / "small", "2560k") as mount:
        yield mount


# Each policy once in the default run: stop on a full disk, continue without a folder.
@pytest.mark.parametrize("policy", ["continue", pytest.param("stop", marks=pytest.mark.slow)])
def test_a_checkpoint_folder_that_cannot_be_created_follows_the_policy(ray_local, tmp_path, policy: str) -> None:
    """On a filesystem with no inode left, a checkpoint's folder cannot be created: the
    save policy covers that too, stopping the run naming the folder or training on."""
    with mounted_tmpfs(tmp_path / "no-inodes", "1m", inodes=1) as full:
        config = tiny_config(
            steps=4, checkpoint__dir=str(full), checkpoint__every_steps=2, checkpoint__on_save_error=policy
        )
        if policy == "continue":
            result = train(config)
            assert len(result.losses) == 4 and result.checkpoints == []
        else:
            with pytest.raises(
                CheckpointError, match=rf"creating checkpoint directory {full}/step-0000000002\.partial"
            ):
                train(config)
        assert list(full.iterdir()) == []


@pytest.mark.parametrize("policy", [pytest.param("continue", marks=pytest.mark.slow), "stop"])
def test_a_full_disk_keeps_the_last_checkpoint_and_follows_the_policy(ray_local, small_disk, policy: str) -> None:
    config = tiny_config(
        steps=6,
        checkpoint__dir=str(small_disk),
        checkpoint__every_steps=2,
        checkpoint__keep_last=3,
        checkpoint__on_save_error=policy,
    )
    if policy == "continue":
        result = train(config)
        assert len(result.losses) == 6
    else:
        with pytest.raises((TrainingError, CheckpointError), match="No space left on device"):
            train(config)
    store = CheckpointDir(small_disk)
    latest = store.latest()
    assert latest is not None and latest.name == "step-0000000002"
    manifest = store.load(latest)
    assert read_flat_range(latest, manifest, 0, manifest.total)["master"].isfinite().all()
    assert not list(small_disk.glob("*.partial")), "a failed save leaves no partial folder"
