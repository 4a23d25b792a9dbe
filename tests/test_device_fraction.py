"""``worker.optimizer_on_device_fraction`` (issue 25, item 3): each unit's first share of
a worker's range is a device segment whose AdamW state the worker holds and updates
itself, with the same registry and kernel as the state servers; the rest stays on the
servers. On CPU workers the run equals plain ``torch.optim.AdamW(fused=True)`` bitwise,
whatever the share; checkpoints hold every segment, resume under another share, and a
killed worker's device state comes back from the last checkpoint. (On a GPU the fused
CUDA kernel rounds otherwise than the CPU one: tests/test_gpu_contract.py holds it to a
tolerance.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from actor_faults import kill_a_worker_in_step
from reference import DEVICE_SEGMENT_CASES, reference_train, tiny_config
from test_training_contract import _assert_matches_reference, _layout, _run

from cargohold.cluster import cli
from cargohold.cluster.export import master_weights
from cargohold.cluster.plan.description import ClusterDescription
from cargohold.cluster.plan.render import render
from cargohold.cluster.plan.run import plan_run
from cargohold.services.core.errors import LayoutError
from cargohold.services.core.layout import DEVICE, build_layout
from cargohold.services.core.state_precision import stored_bytes

SHAPES = [("wte", (300, 48)), ("ln", (48,)), ("fc", (100, 48)), ("bias", (100,)), ("head", (7, 48))]


# --- the layout ----------------------------------------------------------------------------
@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("workers, servers", [(1, 1), (2, 3), (3, 2)])
def test_device_segments_are_each_units_first_share_and_the_segments_still_tile_the_space(
    fraction: float, workers: int, servers: int
) -> None:
    layout = build_layout(
        SHAPES, num_workers=workers, num_servers=servers, unit_sizes=[2, 2, 1], device_fraction=fraction
    )
    covered = sorted((s.start, s.stop) for s in layout.segments)
    assert covered[0][0] == 0 and covered[-1][1] == layout.total
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:])), "the segments tile the flat space"
    for worker in range(workers):
        base = worker * layout.worker_size
        on_device = {s.unit: s for s in layout.device_segments(worker)}
        for unit in layout.units:
            size = unit.stop - unit.start
            expected = layout.align * round(fraction * size / layout.align)
            segment = on_device.get(unit.index)
            assert (segment.numel if segment else 0) == expected
            if segment:
                assert segment.start == base + unit.start and segment.server == DEVICE and segment.on_device
                assert segment.start % layout.align == 0 and segment.stop % layout.align == 0
    for server in range(servers):
        assert not any(s.on_device for s in layout.segments_of_server(server))
    if fraction == 1.0:
        assert not any(layout.segments_of_server(s) for s in range(servers)), "the servers own nothing"


def test_without_a_fraction_the_layout_is_the_servers_alone() -> None:
    plain = build_layout(SHAPES, num_workers=2, num_servers=2, unit_sizes=[2, 2, 1])
    assert plain == build_layout(SHAPES, num_workers=2, num_servers=2, unit_sizes=[2, 2, 1], device_fraction=0.0)
    assert not any(s.on_device for s in plain.segments)


@pytest.mark.parametrize("fraction", [-0.1, 1.01, float("nan")])
def test_a_fraction_outside_0_1_is_refused(fraction: float) -> None:
    with pytest.raises(LayoutError, match="device fraction"):
        build_layout(SHAPES, num_workers=1, num_servers=1, device_fraction=fraction)


@pytest.mark.parametrize("value", ["1.5", "-0.25", "half"])
def test_the_command_exits_2_naming_the_key(value: str, capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    monkeypatch.setattr(cli, "_train", lambda config: pytest.fail("a bad fraction reached training"))
    assert cli.main(["train", "--set", f"worker.optimizer_on_device_fraction={value}"]) == 2
    assert "worker.optimizer_on_device_fraction" in capsys.readouterr().err


def test_gpu_workers_with_a_share_of_the_optimizer_refuse_stored_moments_naming_both_keys(
    capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    monkeypatch.setattr(cli, "_train", lambda config: pytest.fail("the settings reached training"))
    settings = ["worker.optimizer_on_device_fraction=0.25", "optim.state_dtype=bfloat16"]
    assert cli.main(["train", *[a for s in [*settings, "worker.gpus=1"] for a in ("--set", s)]]) == 2
    error = capsys.readouterr().err
    assert "worker.optimizer_on_device_fraction" in error and "optim.state_dtype" in error
    tiny_config(worker__optimizer_on_device_fraction=0.25, optim__state_dtype="bfloat16")  # CPU workers: fine


# --- the plan ------------------------------------------------------------------------------
def test_the_plan_counts_the_device_segments_state_and_picks_the_fraction_that_fits() -> None:
    config = tiny_config(worker__gpus=1, worker__optimizer_on_device_fraction=0.5)
    layout = _layout(config)
    on_device = layout.device_segments(0)
    plan = plan_run(config, ClusterDescription(device_memory_bytes=1 << 30))
    staged_gradients = sum(s.numel for s in on_device) * 4  # clipping is on: fp32 gradients wait for the norm
    state = sum(stored_bytes("float32", s.numel) for s in on_device)
    assert plan.worker.device_state_bytes == state + staged_gradients
    without = plan_run(tiny_config(worker__gpus=1), ClusterDescription(device_memory_bytes=1 << 30))
    assert plan.worker.device_peak_bytes == (
        without.worker.device_peak_bytes + plan.worker.device_state_bytes + plan.worker.device_update_bytes
    )
    assert plan.device_fraction_fit == 1.0  # a GiB holds all of the tiny model's state
    assert "optimizer, 0.5 of the range" in render(plan)

    # The memory the step leaves, plus a quarter of the range's cost: the plan picks 0.25.
    spare = int(0.25 * plan.worker.device_state_per_element * layout.worker_size)
    tight = ClusterDescription(device_memory_bytes=without.worker.device_peak_bytes + spare)
    picked = plan_run(config, tight)
    assert picked.device_fraction_fit == pytest.approx(0.25, abs=0.01)
    assert "optimizer_on_device_fraction: up to 0.2" in render(picked)
    fitting = plan_run(tiny_config(worker__gpus=1, worker__optimizer_on_device_fraction=0.2), tight)
    assert fitting.fits
    assert not plan_run(config, tight).fits, "0.5 of the range does not fit what 0.25 just fits"
    assert plan_run(config).device_fraction_fit is None  # CPU workers: no GPU to fit


def test_8_bit_state_on_the_device_costs_its_stored_bytes() -> None:
    config = tiny_config(
        worker__optimizer_on_device_fraction=1.0,
        optim__state_dtype="blockwise8",
        optim__max_grad_norm=0.0,
        optim__nonfinite="ignore",
    )
    layout = _layout(config)
    plan = plan_run(config)
    assert plan.worker.device_state_bytes == sum(stored_bytes("blockwise8", s.numel) for s in layout.device_segments(0))
    assert plan.worker.device_state_bytes < 0.55 * 12 * layout.worker_size


# --- training, bitwise ---------------------------------------------------------------------
CASES = {
    **DEVICE_SEGMENT_CASES,
    "quarter-on-device-delayed-update": dict(steps=10, **DEVICE_SEGMENT_CASES["quarter-on-device-delayed-update"]),
}
IN_PROCESS_TOO = ("all-on-device-no-clip", "quarter-on-device-delayed-update")
"""Cases tests/test_step.py trains in-process in the default run (here slow)."""


@pytest.mark.integration
@pytest.mark.parametrize(
    "overrides",
    [pytest.param(c, marks=pytest.mark.slow) if k in IN_PROCESS_TOO else c for k, c in CASES.items()],
    ids=CASES.keys(),
)
def test_matches_torch_adamw_bitwise(ray_local, overrides: dict) -> None:
    config = tiny_config(**overrides)
    layout = _layout(config)
    assert layout.device_segments(0) and layout.device_segments(1)
    layout, losses, weights, server = _run(config)
    _assert_matches_reference(config, layout, losses, weights, server)


@pytest.mark.slow  # the default suite reads the workers' segments through the same holders (snapshots, checkpoints)
@pytest.mark.integration
def test_export_and_the_workers_memory_include_the_device_segments(ray_local) -> None:
    """The export reads every segment's masters, the workers' too; each worker reports its
    device segments' state as its "optimizer" memory (the metric's kind)."""
    from cargohold.cluster.launcher import TrainingSession

    config = tiny_config(steps=3, state_server__num_servers=2, worker__optimizer_on_device_fraction=0.5)
    layout = _layout(config)
    with TrainingSession(config) as session:
        for _ in range(config.steps):
            session.step()
        masters = master_weights(layout, session.server_masters())
        held = session.worker_resident_bytes()
    assert torch.equal(masters, reference_train(config, config.steps).flat(layout, "masters"))
    state = sum(stored_bytes("float32", s.numel) for s in layout.device_segments(0))
    assert state <= held["optimizer"] < state + 64 * 1024 * len(layout.device_segments(0))


# --- checkpoints ---------------------------------------------------------------------------
STEPS = 6


def _config(root: Path, fraction: float, **more):
    return tiny_config(
        steps=STEPS,
        state_server__num_servers=2,
        worker__optimizer_on_device_fraction=fraction,
        checkpoint__dir=str(root / "checkpoints"),
        **more,
    )


def _final(root: Path) -> dict[str, torch.Tensor]:
    """The state of the last checkpoint (the run's last step), and its files' owners."""
    from cargohold.services.checkpoint import CheckpointDir, read_flat_range

    store = CheckpointDir(root / "checkpoints")
    latest = store.latest()
    manifest = store.load(latest)
    assert manifest.step == STEPS
    return read_flat_range(latest, manifest, 0, manifest.total)


def _owners(root: Path, step: int) -> set[str]:
    """Who wrote checkpoint ``step``'s payload files ("server0", "worker1", ...)."""
    from cargohold.services.checkpoint import CheckpointDir

    store = CheckpointDir(root / "checkpoints")
    manifest = store.load(store.root / f"step-{step:010d}")
    return {file.name.split("-")[0] for file in manifest.files}


@pytest.fixture(scope="module")
def uninterrupted_root(ray_local, tmp_path_factory) -> Path:
    """The run with half of each unit on the workers, uninterrupted, with a checkpoint
    after step 3 (which the resume tests start from) and after the last."""
    from cargohold.cluster.supervise import train

    root = tmp_path_factory.mktemp("uninterrupted")
    train(_config(root, 0.5, checkpoint__every_steps=3))
    for step in (3, STEPS):
        assert _owners(root, step) == {"server0", "server1", "worker0", "worker1"}
    return root


@pytest.fixture(scope="module")
def uninterrupted(uninterrupted_root: Path) -> dict[str, torch.Tensor]:
    """The final state of that run."""
    return _final(uninterrupted_root)


def _assert_same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    for key in ("master", "exp_avg", "exp_avg_sq"):
        assert torch.equal(got[key], expected[key]), f"{key} differs by {(got[key] - expected[key]).abs().max():.3e}"


@pytest.mark.integration
@pytest.mark.parametrize("resumed_fraction", [0.25, pytest.param(0.0, marks=pytest.mark.slow)])
def test_a_resume_under_another_fraction_ends_bitwise_where_the_uninterrupted_run_ends(
    uninterrupted, uninterrupted_root: Path, tmp_path: Path, resumed_fraction: float
) -> None:
    """Saved with half of each unit on the workers (the uninterrupted run's checkpoint of
    step 3), resumed with a quarter (the workers' and the servers' segments cut elsewhere)
    or none (the servers take it all back)."""
    from cargohold.cluster.supervise import train

    saved = uninterrupted_root / "checkpoints" / "step-0000000003"
    resumed = train(_config(tmp_path, resumed_fraction, checkpoint__resume=str(saved)))
    assert resumed.first_step == 3
    owners = {"server0", "server1"} | ({"worker0", "worker1"} if resumed_fraction else set())
    assert _owners(tmp_path, STEPS) == owners
    _assert_same(_final(tmp_path), uninterrupted)


@pytest.mark.integration
def test_a_killed_worker_is_recovered_ending_bitwise_where_the_uninterrupted_run_ends(
    uninterrupted, tmp_path: Path, monkeypatch
) -> None:
    """A worker SIGKILLed before step 6 takes its device segments' state with it: the
    launcher restarts from the checkpoint of step 4, which holds them (no live recovery),
    computes step 5 again, and the run ends where the uninterrupted one does."""
    from cargohold.cluster.supervise import train

    killed = kill_a_worker_in_step(monkeypatch, 6)
    result = train(_config(tmp_path, 0.5, checkpoint__every_steps=2, checkpoint__max_failures=1))
    assert len(killed) == 1 and result.restarts == 1 and len(result.losses) == STEPS
    assert result.live_recoveries == 0 and result.steps_recomputed == 1
    _assert_same(_final(tmp_path), uninterrupted)
