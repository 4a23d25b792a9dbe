"""``optim.state_dtype`` wired end to end: the moments of a segment stored as bf16 or as
8-bit blocks (:mod:`cargohold.services.core.state_precision`) in the RAM tier, in NVMe
partition files and in checkpoints, with the update decoding them around the same fused
kernel. The kernel's own accuracy is tests/test_state_precision.py's; here: the tiers
keep the stored form exactly (all in RAM, on disk, restored), files of a new kind are
checked like fp32 ones, the plan counts the smaller bytes, and real runs train within a
stated tolerance of fp32 and resume bitwise."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from actor_faults import kill_a_worker_in_step
from plans import nvme_tier
from reference import reference_train, tiny_config
from tier_stores import LR, NORM, NUMEL, cold_disk_file, open_storage, seeded_randn, tier_config, tier_segment_spec

from cargohold.cluster import cli
from cargohold.cluster.plan.render import render
from cargohold.cluster.plan.run import plan_run
from cargohold.services.core.errors import CorruptPartitionError
from cargohold.services.core.optim import clip_coefficient
from cargohold.services.core.state_precision import (
    BLOCK_ELEMENTS,
    StateDtype,
    apply_update_stored,
    bytes_per_parameter,
    decode,
    encode,
    stored_bytes,
    zeros,
)
from cargohold.services.segments.segment_registry import SegmentRegistry
from cargohold.services.segments.segment_state import SegmentState
from cargohold.services.tiers.fileformat import HEADER_BYTES, FileLayout, unpack_header
from cargohold.services.tiers.residency import Residency
from cargohold.services.transport.codec import spec_from_proto, spec_to_proto

pytestmark = pytest.mark.timeout(300)
KINDS: tuple[StateDtype, ...] = ("bfloat16", "blockwise8")
BF16_SLOW = [pytest.param("bfloat16", marks=pytest.mark.slow), "blockwise8"]
"""The Ray runs in the default suite for the 8-bit kind (bf16 in ``make test-slow``)."""


def _spec(kind: StateDtype):
    return replace(tier_segment_spec(), state_dtype=kind)


# --- the file layout and the spec ------------------------------------------------------------
def test_the_file_layout_of_each_kind() -> None:
    """float32 is the layout before stored kinds (4 KiB header, three fp32 regions); bf16
    moments take 2 bytes an element, 8-bit ones 1 and an fp32 scale per 256 elements,
    each region padded to 4 KiB."""
    n = 5000
    assert FileLayout(n).file_bytes == HEADER_BYTES + 3 * 20480
    assert FileLayout(n, "bfloat16").file_bytes == HEADER_BYTES + 20480 + 2 * 12288
    blocks = -(-n // BLOCK_ELEMENTS)
    assert FileLayout(n, "blockwise8").moment_region_bytes == -(-(5056 + 4 * blocks) // 4096) * 4096 == 8192
    for kind in ("float32", *KINDS):
        layout = FileLayout(n, kind)
        assert layout.offset(2) - layout.offset(1) == layout.moment_region_bytes
        assert layout.file_bytes - HEADER_BYTES - 4096 < stored_bytes(kind, n) + 3 * 4096


@pytest.mark.parametrize("kind", ["float32", *KINDS])
def test_the_spec_carries_the_state_dtype_over_the_wire(kind: StateDtype) -> None:
    assert spec_from_proto(spec_to_proto(_spec(kind))).state_dtype == kind


def test_bad_input_exits_2_naming_the_key(capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    monkeypatch.setattr(cli, "_train", lambda config: pytest.fail("a bad config reached training"))
    assert cli.main(["train", "--set", "optim.state_dtype=int8"]) == 2
    error = capsys.readouterr().err
    assert "optim.state_dtype" in error and "blockwise8" in error


# --- the tiers keep the stored form -----------------------------------------------------------
def _reference(kind: StateDtype, steps: int) -> dict[str, torch.Tensor]:
    """The segment's state after ``steps`` updates computed directly: the whole segment
    one piece, its moments decoded, the fused kernel over the fragments, encoded again;
    clipping by NORM as the segment does (fp32 factor)."""
    spec = _spec(kind)
    master = seeded_randn(0).clone()
    m, v = zeros(kind, "exp_avg", NUMEL), zeros(kind, "exp_avg_sq", NUMEL)
    for step in range(1, steps + 1):
        apply_update_stored(
            master, m, v, spec.fragment_groups(), seeded_randn(100 + step),
            step=torch.tensor(float(step)), coefficient=clip_coefficient(NORM, spec.hyper.max_grad_norm),
            lr=LR, owned=False,
        )  # fmt: skip
    return {"master": master, "exp_avg": decode(m), "exp_avg_sq": decode(v)}


@pytest.mark.parametrize("kind", KINDS)
def test_most_partitions_on_disk_equal_all_in_ram_and_the_direct_update_bitwise(tmp_path: Path, kind) -> None:
    """11 partitions, 9 of them in files of the kind: the update decodes and encodes each
    partition (cut on the 256-element blocks for 8 bits) exactly as the whole segment in
    RAM, and as the update computed directly; staged gradients (commit) too."""
    with open_storage(tier_config(tmp_path)) as storage:
        tiered = SegmentRegistry(storage).register(_spec(kind), seeded_randn(0))
        ram = SegmentState(_spec(kind), seeded_randn(0))
        rows = storage.rows()
        assert [r.actual for r in rows].count(Residency.NVME) >= 7
        if kind == "blockwise8":
            assert all(r.offset % BLOCK_ELEMENTS == 0 for r in rows)
        for step in range(1, 6):
            if step % 2:
                tiered.stage_gradient(step, seeded_randn(100 + step))
                assert tiered.commit(step, global_norm=NORM, lr=LR).applied
            else:
                assert tiered.apply_gradient(step, seeded_randn(100 + step), global_norm=NORM, lr=LR).applied
            assert ram.apply_gradient(step, seeded_randn(100 + step), global_norm=NORM, lr=LR).applied
        a, b, direct = tiered.snapshot(), ram.snapshot(), _reference(kind, 5)
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(a[key], b[key]), f"{key} differs between disk and RAM"
            assert torch.equal(a[key], direct[key]), f"{key} differs from the direct update"
        assert torch.equal(tiered.master_weights(), direct["master"])
        # the state is stored small: the disk partitions count the kind's bytes
        disk = sum(r.numel for r in storage.rows() if r.actual is Residency.NVME)
        assert (
            storage.state_bytes()[Residency.NVME]
            == sum(stored_bytes(kind, r.numel) for r in storage.rows() if r.actual is Residency.NVME)
            < 9 * disk
        )
        on_disk = [r for r in storage.rows() if r.path]
        assert on_disk and all(Path(r.path).stat().st_size == FileLayout(r.numel, kind).file_bytes for r in on_disk)


@pytest.mark.parametrize("kind", KINDS)
def test_the_moments_differ_from_fp32_within_the_kinds_precision(kind: StateDtype) -> None:
    """So the stored kind is really used: after 5 updates the moments are not fp32's, and
    the master weights are near fp32's: 5 updates move an element by at most 5 x lr =
    0.05; measured differences at most 1.5e-4 (bf16) and 1.7e-3 (8-bit), bounded here at
    about twice that."""
    ours, fp32 = _reference(kind, 5), _reference("float32", 5)
    assert not torch.equal(ours["exp_avg"], fp32["exp_avg"])
    bound = {"bfloat16": 3e-4, "blockwise8": 3.5e-3}[kind]
    assert 0 < (ours["master"] - fp32["master"]).abs().max() < bound


def test_decoding_and_encoding_8_bit_moments_again_changes_them() -> None:
    """Why a restore into the same kind copies the stored bytes (``CheckpointReader.read_stored``)
    instead of decoding and encoding: for exp_avg a block whose absmax is negative has no
    code for -1, so a second encoding picks another scale. The stop-and-resume test below
    fails without the copy."""
    spec = _spec("blockwise8")
    master = seeded_randn(0).clone()
    m, v = zeros("blockwise8", "exp_avg", NUMEL), zeros("blockwise8", "exp_avg_sq", NUMEL)
    apply_update_stored(
        master, m, v, spec.fragment_groups(), seeded_randn(101),
        step=torch.tensor(1.0), coefficient=None, lr=LR, owned=False,
    )  # fmt: skip
    again = encode(decode(m), "blockwise8", "exp_avg")
    assert not torch.equal(again.scales, m.scales)


@pytest.mark.parametrize("kind", KINDS)
def test_a_damaged_partition_file_of_a_new_kind_is_refused_naming_it(tmp_path: Path, kind: StateDtype) -> None:
    with open_storage(tier_config(tmp_path)) as storage:
        state = SegmentRegistry(storage).register(_spec(kind), seeded_randn(0))
        assert state.apply_gradient(1, seeded_randn(101), global_norm=NORM, lr=LR).applied
        victim = cold_disk_file(storage)
        layout = FileLayout(1344 if kind == "bfloat16" else 1280, kind)
        # the last byte of exp_avg_sq's values or, for 8 bits, of its block scales
        at = layout.offset(2) + (layout.scales_offset + 4 * layout.blocks - 1 if layout.blocks else 2 * 1344 - 1)
        data = bytearray(Path(victim).read_bytes())
        assert len(data) == layout.file_bytes
        data[at] ^= 0x10
        Path(victim).write_bytes(bytes(data))
        with pytest.raises(CorruptPartitionError, match=rf"{victim}.*exp_avg_sq checksum mismatch"):
            state.apply_gradient(2, seeded_randn(102), global_norm=NORM, lr=LR)


def test_a_file_of_another_kind_is_refused(tmp_path: Path) -> None:
    """A partition file that stores the moments as bf16 where the segment stores 8 bits
    (same size would not save it: the header names its kind)."""
    with open_storage(tier_config(tmp_path)) as storage:
        SegmentRegistry(storage).register(_spec("bfloat16"), seeded_randn(0))
        victim = cold_disk_file(storage)
        raw = Path(victim).read_bytes()[:HEADER_BYTES]
        key = next(r.key for r in storage.rows() if r.path == victim)
        with pytest.raises(CorruptPartitionError, match="stores the moments as bfloat16, expected blockwise8"):
            unpack_header(raw, path=victim, key=key, numel=1344, dtype="blockwise8")
        assert unpack_header(raw, path=victim, key=key, numel=1344, dtype="bfloat16").dtype == "bfloat16"


# --- the plan ------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["float32", *KINDS])
def test_the_plan_counts_the_kinds_bytes_per_parameter(tmp_path: Path, kind: StateDtype) -> None:
    """12 / 8 / ~6.03 B of state per parameter, in RAM and on NVMe together; with a
    smaller kind less of it is on disk under the same budget."""
    plan = plan_run(tiny_config(state_server__num_servers=2, optim__state_dtype=kind))
    for server in plan.servers:
        total = server.ram_state_bytes + server.nvme_state_bytes
        assert abs(total / server.elements - bytes_per_parameter(kind)) < 0.01
    label = {"float32": "12", "bfloat16": "8", "blockwise8": "6.03"}[kind]
    assert f"state in RAM ({label} B/param)" in render(plan)
    tiered = plan_run(
        tiny_config(state_server__num_servers=2, optim__state_dtype=kind, state_server__tier=nvme_tier(tmp_path))
    )
    fp32 = plan_run(tiny_config(state_server__num_servers=2, state_server__tier=nvme_tier(tmp_path)))
    for ours, theirs in zip(tiered.servers, fp32.servers):
        if kind == "float32":
            assert ours.nvme_file_bytes == theirs.nvme_file_bytes
        else:
            assert ours.nvme_file_bytes < theirs.nvme_file_bytes


# --- real runs -------------------------------------------------------------------------------
TOLERANCE = {"bfloat16": (0.06, 0.01, 0.01), "blockwise8": (0.35, 0.03, 0.015)}
"""Relative differences from fp32's loss over the tiny config's 20 steps: (any step, the
mean over the steps, the last step). Measured (deterministic runs, 2 servers): bf16 at
most 4.5% (step 12, a transient spike; every other step within 1.4%), mean 0.53%, last
0.18%; 8-bit at most 29% (step 11, a spike), mean 2.0%, last 0.72%. So the 1% of every
step does not hold on this config: at its lr (0.01) steps 10-13 amplify any disturbance of
the moments, fp32's too (benchmarks/state_dtype_spike.py, and the module docstring of
services/core/state_precision.py). tests/test_state_precision.py's 200-step regressions found
the same (1% bf16, 30% 8-bit); LONG_TOLERANCE below is the bound over 200 steps."""


def _losses_and_state(config) -> tuple[list[float], dict[str, torch.Tensor]]:
    from cargohold.cluster.launcher import TrainingSession

    with TrainingSession(config) as session:
        losses = [session.step().loss for _ in range(config.steps)]
        state = {}
        for snapshot in session.server_snapshots():
            for segment_id, tensors in snapshot.items():
                state[segment_id] = {k: tensors[k] for k in ("master", "exp_avg", "exp_avg_sq")}
    return losses, state


@pytest.fixture(scope="module")
def fp32_losses() -> list[float]:
    config = tiny_config(state_server__num_servers=2)
    return reference_train(config, config.steps).losses


@pytest.mark.slow  # 35 s a kind; the default run keeps 8-bit stop-and-resume, the unit bounds, RAM = disk
@pytest.mark.integration
@pytest.mark.parametrize("kind", KINDS)
def test_a_run_trains_within_tolerance_of_fp32_in_ram_and_on_nvme(
    ray_local, tmp_path: Path, fp32_losses: list[float], kind: StateDtype
) -> None:
    """Every step's loss within TOLERANCE of fp32's (but not equal: the kind is used), and
    with most state on disk the same bits as all in RAM."""
    config = tiny_config(state_server__num_servers=2, optim__state_dtype=kind)
    losses, ram_state = _losses_and_state(config)
    relative = [abs(a - b) / b for a, b in zip(losses, fp32_losses)]
    every, mean, last = TOLERANCE[kind]
    assert max(relative) <= every and sum(relative) / len(relative) <= mean and relative[-1] <= last, (
        f"relative loss differences {relative}"
    )
    assert losses != fp32_losses
    assert losses[-1] < losses[0] - 0.5, "the loss should fall visibly in 20 steps"

    nvme = tiny_config(state_server__num_servers=2, optim__state_dtype=kind, state_server__tier=nvme_tier(tmp_path))
    nvme_losses, nvme_state = _losses_and_state(nvme)
    assert nvme_losses == losses
    for segment_id, tensors in ram_state.items():
        for key, tensor in tensors.items():
            assert torch.equal(nvme_state[segment_id][key], tensor), f"segment {segment_id} {key} differs"


DEMO_OPTIM = {
    "optim__lr": 1e-3,
    "optim__betas": [0.9, 0.95],
    "optim__weight_decay": 0.01,
    "optim__max_grad_norm": 1.0,
    "optim__warmup_steps": 10,
}
"""examples/demo.yaml's AdamW (its schedule is cosine, as the tiny config's)."""
LONG_STEPS = 200
LONG_TOLERANCE = 0.01
"""The stated tolerance: with the demo's AdamW, every step's loss (the 200th included) within
1% of fp32's. Measured on the tiny model: at most 0.01% (bf16) and 0.08% (8-bit); on the
demo itself, docs/benchmarks.md. The tiny config's own AdamW (lr 0.01) is no ground for a
bound over 200 steps: there fp32 itself, its exp_avg_sq given 0.3% of random noise after
every update (less than bf16's rounding), strays up to 10% from fp32 and ends 3.7% away
(seed 1; benchmarks/state_dtype_spike.py)."""


@pytest.mark.slow  # ~1 min a kind; the default suite keeps the 20-step run above
@pytest.mark.integration
@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", KINDS)
def test_200_steps_with_the_demos_adamw_stay_within_1_percent_of_fp32(ray_local, kind: StateDtype) -> None:
    from cargohold.cluster.supervise import train

    config = tiny_config(steps=LONG_STEPS, state_server__num_servers=2, **DEMO_OPTIM)
    fp32 = reference_train(config, LONG_STEPS, norm="shards").losses
    losses = train(
        tiny_config(steps=LONG_STEPS, state_server__num_servers=2, optim__state_dtype=kind, **DEMO_OPTIM)
    ).losses
    relative = [abs(a - b) / b for a, b in zip(losses, fp32, strict=True)]
    worst = max(range(LONG_STEPS), key=relative.__getitem__)
    print(f"{kind}: largest {relative[worst]:.3%} at step {worst + 1}, step {LONG_STEPS} {relative[-1]:.3%}")
    assert relative[worst] <= LONG_TOLERANCE, f"step {worst + 1}: {relative[worst]:.3%} from fp32"
    assert losses != fp32, "the kind was used"
    assert fp32[-1] < 0.5 * fp32[0], "the run should have learnt something"


RESUME_STEPS = 8
RESHARD_TOLERANCE = 2e-3
"""The most the master weights of an 8-bit run resumed onto 3 servers may differ from the
uninterrupted run's after 4 more steps (measured 5.7e-4; the lr is 0.01)."""


def _resume_config(kind: StateDtype, root: Path, **more):
    """A run of RESUME_STEPS steps with most state on disk and checkpoints under ``root``."""
    settings = {
        "steps": RESUME_STEPS,
        "state_server__num_servers": 2,
        "optim__state_dtype": kind,
        "checkpoint__dir": str(root / "checkpoints"),
        "state_server__tier": nvme_tier(root),
    }
    return tiny_config(**{**settings, **more})


def _final(kind: StateDtype, root: Path) -> dict[str, torch.Tensor]:
    """The last checkpoint's state (decoded to fp32), of the last step."""
    from cargohold.services.checkpoint import CheckpointDir, read_flat_range

    store = CheckpointDir(root / "checkpoints")
    latest = store.latest()
    manifest = store.load(latest)
    assert manifest.step == RESUME_STEPS and manifest.config["optim"]["state_dtype"] == kind
    return read_flat_range(latest, manifest, 0, manifest.total)


def _assert_same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    for key in ("master", "exp_avg", "exp_avg_sq"):
        assert torch.equal(got[key], expected[key]), f"{key} differs by {(got[key] - expected[key]).abs().max():.3e}"


@pytest.fixture(scope="module")
def uninterrupted_run(ray_local, tmp_path_factory):
    """The uninterrupted run of each kind, run once: its root, with a checkpoint after
    step 4 (where the stop-and-resume tests start from) and after the last."""
    from cargohold.cluster.supervise import train

    roots: dict[str, Path] = {}

    def of(kind: StateDtype) -> Path:
        if kind not in roots:
            roots[kind] = tmp_path_factory.mktemp(f"uninterrupted-{kind}")
            train(_resume_config(kind, roots[kind], checkpoint__every_steps=4))
        return roots[kind]

    return of


@pytest.fixture(scope="module")
def uninterrupted(uninterrupted_run):
    """The final state of the uninterrupted run of each kind."""
    return lambda kind: _final(kind, uninterrupted_run(kind))


@pytest.mark.integration
@pytest.mark.parametrize("kind", BF16_SLOW)
def test_a_resume_from_a_checkpoint_the_run_trained_past_ends_bitwise_where_the_uninterrupted_run_ends(
    uninterrupted_run, uninterrupted, tmp_path: Path, kind
) -> None:
    """With most state on disk (files linked into the checkpoint, which the run then
    trained past) and 8-bit blocks whose decode and re-encode would not be exact: resumed
    from the uninterrupted run's checkpoint of step 4, the run restores the stored bytes."""
    from cargohold.cluster.supervise import train

    saved = uninterrupted_run(kind) / "checkpoints" / "step-0000000004"
    resumed = train(_resume_config(kind, tmp_path, checkpoint__resume=str(saved)))
    assert resumed.first_step == 4
    _assert_same(_final(kind, tmp_path), uninterrupted(kind))


@pytest.mark.integration
@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.slow) for k in KINDS])
def test_a_killed_worker_is_recovered_ending_bitwise_where_the_uninterrupted_run_ends(
    uninterrupted, tmp_path: Path, monkeypatch, kind: StateDtype
) -> None:
    """A worker SIGKILLed in step 6, after the checkpoint of step 4: the launcher restarts
    from it (the servers restore the stored moments) and the run ends where the
    uninterrupted one does."""
    from cargohold.cluster.supervise import train

    killed = kill_a_worker_in_step(monkeypatch, 6)
    result = train(_resume_config(kind, tmp_path, checkpoint__every_steps=2, checkpoint__max_failures=1))
    assert len(killed) == 1 and result.restarts == 1 and len(result.losses) == RESUME_STEPS
    _assert_same(_final(kind, tmp_path), uninterrupted(kind))


@pytest.mark.slow  # the default suite keeps the 8-bit run and its stop-and-resume
@pytest.mark.integration
def test_a_resume_onto_more_servers_converts_the_pieces_off_the_block_grid(uninterrupted, tmp_path: Path) -> None:
    """Saved by 2 servers with 8-bit moments, resumed onto 3: the new segments' partitions
    start off the saved files' 256-element blocks, so their moments are decoded and
    encoded again (not bitwise); the run ends near the uninterrupted one."""
    from cargohold.cluster.launcher import TrainingSession
    from cargohold.cluster.supervise import train
    from cargohold.services.checkpoint import CheckpointDir

    store = CheckpointDir(tmp_path / "checkpoints")
    with TrainingSession(_resume_config("blockwise8", tmp_path)) as session:
        for _ in range(4):
            session.step()
        session.checkpoint_finish(store, session.checkpoint_begin(store))
    resumed = train(_resume_config("blockwise8", tmp_path, checkpoint__resume="latest", state_server__num_servers=3))
    assert resumed.first_step == 4
    got, expected = _final("blockwise8", tmp_path), uninterrupted("blockwise8")
    difference = (got["master"] - expected["master"]).abs().max().item()
    print(f"master difference after a resume onto 3 servers: {difference:.3e}")
    assert difference < RESHARD_TOLERANCE


@pytest.mark.slow  # the default suite keeps the 8-bit run and its stop-and-resume
@pytest.mark.integration
def test_a_resume_into_another_kind_converts_the_moments_and_says_so(ray_local, tmp_path: Path, caplog) -> None:
    """Saved with 8-bit moments, resumed as fp32: the moments come back decoded (the
    checkpoint's reader decodes them), the change is logged naming the key."""
    from cargohold.cluster.supervise import train
    from cargohold.services.checkpoint import CheckpointDir, read_flat_range

    saved = tiny_config(steps=2, optim__state_dtype="blockwise8", checkpoint__dir=str(tmp_path))
    train(saved)
    store = CheckpointDir(tmp_path)
    first = store.latest()
    before = read_flat_range(first, store.load(first), 0, store.load(first).total)
    assert before["exp_avg"].abs().max() > 0
    # any range decodes as the whole does: off the 256-element block grid, across files
    for start, stop in (
        (64, 300),
        (1000, 1001),
        (4000, 9000),
        (before["master"].numel() - 77, before["master"].numel()),
    ):
        piece = read_flat_range(first, store.load(first), start, stop)
        for key, values in piece.items():
            assert torch.equal(values, before[key][start:stop]), f"{key} of [{start}, {stop})"
    resumed_config = tiny_config(steps=3, checkpoint__dir=str(tmp_path), checkpoint__resume="latest")
    with caplog.at_level(logging.WARNING, logger="cargohold.cluster.resume"):
        resumed = train(resumed_config)
    assert resumed.first_step == 2 and len(resumed.losses) == 1
    assert 'optim.state_dtype is "blockwise8" there and "float32" here' in caplog.text
    assert "converted" in caplog.text
    last = store.latest()
    manifest = store.load(last)
    assert manifest.config["optim"]["state_dtype"] == "float32"
    after = read_flat_range(last, manifest, 0, manifest.total)
    # one fp32 update later exp_avg_sq is 0.999 of the decoded one plus 0.001 g**2: carried over, not zeroed
    assert (after["exp_avg_sq"] >= 0.999 * before["exp_avg_sq"] * (1 - 1e-5)).all()
    assert not torch.equal(after["master"], before["master"])
