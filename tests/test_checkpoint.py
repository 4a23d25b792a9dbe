"""The checkpoint format on real files: round trips under any cut, restoring onto other
worker and server counts, and the manifest-last rule. The checkpoints are written as
state servers write them (:class:`SegmentCheckpointer`, here all in RAM) and committed as
the launcher commits them (``checkpoints.py``); the manifest's own checks are in
``test_checkpoint_manifest.py``, crash consistency in ``test_checkpoint_crash.py``,
corruption and failed writes in ``test_checkpoint_damage.py``.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from checkpoints import (
    RUN,
    SHAPES,
    random_data,
    restore,
    save,
    save_layout,
    unit_layout,
    write_segments,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cargohold.cluster.schema.server import TierConfig
from cargohold.services.checkpoint import MANIFEST_NAME, CheckpointDir, Manifest, read_flat_range
from cargohold.services.checkpoint.reshard import segment_runs
from cargohold.services.core.errors import CheckpointError, CorruptCheckpointError
from cargohold.services.core.layout import scatter_params
from cargohold.services.segments.segment_registry import SegmentRegistry
from cargohold.services.tiers.fileformat import ARRAYS, FileLayout
from cargohold.services.tiers.partitions import elements_per_partition
from cargohold.services.tiers.storage import TieredStorage

pytestmark = pytest.mark.timeout(120)


# --------------------------------------------------------------------------- round trip


def test_round_trip_latest_and_arbitrary_ranges(tmp_path: Path) -> None:
    store = CheckpointDir(tmp_path / "ckpt")
    data = random_data(10_000, seed=1)
    path = save(store, 12, data, [1_000, 6_400])
    assert path == tmp_path / "ckpt" / "step-0000000012"
    assert store.latest() == path
    assert store.resolve("latest") == path == store.resolve(str(path)) == store.resolve(str(tmp_path / "ckpt"))
    manifest = store.load(path)
    assert manifest.step == 12 and manifest.updates == 11
    assert Manifest.from_json(manifest.to_json(), source="x") == manifest
    for start, stop in [(0, 10_000), (999, 1_001), (6_400, 6_400), (3, 9_999), (6_399, 6_401)]:
        got = read_flat_range(path, manifest, start, stop)
        for name in ARRAYS:
            assert torch.equal(got[name], data[name][start:stop]), (name, start, stop)
    with pytest.raises(CheckpointError, match=r"\[9999, 10001\) is not a range inside .*\[0, 10000\)"):
        read_flat_range(path, manifest, 9_999, 10_001)
    assert [(s.start, s.stop) for s in manifest.segments] == [(0, 1_000), (1_000, 6_400), (6_400, 10_000)]
    middle = manifest.segments[1].file
    for record in manifest.files:  # the middle file alone holds its range
        if record.name != middle:
            (path / record.name).unlink()
    got = read_flat_range(path, manifest, 1_000, 6_400)
    assert all(torch.equal(got[n], data[n][1_000:6_400]) for n in ARRAYS)


@st.composite
def _cuts_and_ranges(draw: st.DrawFn) -> tuple[int, list[int], list[int]]:
    total = draw(st.integers(min_value=1, max_value=3_000))
    interior = st.integers(min_value=1, max_value=max(1, total - 1))
    write_cuts = sorted(draw(st.sets(interior, max_size=5 if total > 1 else 0)))
    read_cuts = sorted(draw(st.sets(interior, max_size=6 if total > 1 else 0)))
    return total, write_cuts, read_cuts


@settings(max_examples=30, deadline=None, database=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(case=_cuts_and_ranges(), seed=st.integers(0, 2**32 - 1))
def test_any_write_cut_reads_back_under_any_read_cut(case: tuple[int, list[int], list[int]], seed: int) -> None:
    total, write_cuts, read_cuts = case
    data = random_data(total, seed)
    with tempfile.TemporaryDirectory() as root:
        store = CheckpointDir(Path(root))
        path = save(store, 3, data, write_cuts)
        assert store.latest() == path
        manifest = store.load(path)
        bounds = [0, *read_cuts, total]
        pieces = [read_flat_range(path, manifest, a, b) for a, b in zip(bounds, bounds[1:])]
        for piece, (a, b) in zip(pieces, zip(bounds, bounds[1:])):
            for name in ARRAYS:
                assert torch.equal(piece[name], data[name][a:b])
        for name in ARRAYS:
            assert torch.equal(torch.cat([p[name] for p in pieces]), data[name])


# --------------------------------------------------------------- restore onto other layouts


def _model_state(seed: int) -> dict[str, dict[str, torch.Tensor]]:
    """master/exp_avg/exp_avg_sq of every parameter of ``SHAPES``, by name."""
    generator = torch.Generator().manual_seed(seed)
    return {key: {name: torch.randn(shape, generator=generator) for name, shape in SHAPES} for key in ARRAYS}


def _small_partitions(root: Path) -> TierConfig:
    """An NVMe tier of 16 KiB partitions (1344 elements): runs cross partition bounds."""
    buffer = FileLayout(elements_per_partition(16 << 10)).file_bytes
    return TierConfig(
        nvme_paths=[str(root)], ram_budget_bytes=6 * buffer, partition_bytes=16 << 10, buffer_count=3, io_threads=2
    )


@pytest.mark.parametrize(
    ("saved_at", "restored_at"),
    [
        ((2, 2), (1, 1)),
        ((1, 2), (3, 3)),
        ((2, 3), (4, 2)),
        ((4, 1), (2, 5)),
        ((3, 2), (3, 1)),
    ],
)
@pytest.mark.parametrize("tier", [False, True], ids=["ram", "nvme-tier"])
def test_a_checkpoint_restores_bitwise_onto_any_workers_and_servers(
    tmp_path: Path, saved_at: tuple[int, int], restored_at: tuple[int, int], tier: bool
) -> None:
    """Saved under W workers and S servers, restored onto W' and S' through the state
    server's restore path: every parameter element of every array where the new layout
    puts it, padding zero."""
    state = _model_state(seed=5)
    saved = unit_layout(*saved_at)
    path = save_layout(
        CheckpointDir(tmp_path / "ckpt"), 40, saved, {key: scatter_params(saved, state[key]) for key in ARRAYS}
    )
    target = unit_layout(*restored_at)
    expected = {key: scatter_params(target, state[key]) for key in ARRAYS}
    got = {key: torch.full((target.total,), float("nan")) for key in ARRAYS}
    for server in range(target.num_servers):
        registry = SegmentRegistry(TieredStorage(_small_partitions(tmp_path / f"nvme{server}") if tier else None))
        try:
            restore(path, target, server, registry)
            for segment in registry.segments(RUN):
                assert segment.updates == 40
                for key, values in segment.snapshot().items():
                    got[key][segment.spec.start : segment.spec.start + segment.spec.numel] = values
        finally:
            registry.close()
    for key in ARRAYS:
        assert torch.equal(got[key], expected[key]), key


def test_a_server_reads_only_the_files_its_segments_need(tmp_path: Path) -> None:
    """The other files of the checkpoint may be gone: a server restoring its segments
    never opens them."""
    state = _model_state(seed=6)
    saved, target = unit_layout(2, 4), unit_layout(4, 4)
    path = save_layout(CheckpointDir(tmp_path), 1, saved, {key: scatter_params(saved, state[key]) for key in ARRAYS})
    manifest = CheckpointDir(tmp_path).load(path)

    def needed_by(server: int) -> set[str]:
        return {
            segment.file
            for seg in target.segments_of_server(server)
            for _, flat, length in segment_runs(saved, target, seg)
            for segment in manifest.segments
            if segment.start < flat + length and flat < segment.stop
        }

    needed = needed_by(0)
    assert 0 < len(needed) < len(manifest.files)
    for record in manifest.files:
        if record.name not in needed:
            (path / record.name).unlink()
    registry = SegmentRegistry(TieredStorage(None))
    restore(path, target, 0, registry)
    expected = scatter_params(target, state["exp_avg_sq"])
    for segment in registry.segments(RUN):
        spec = segment.spec
        assert torch.equal(segment.snapshot()["exp_avg_sq"], expected[spec.start : spec.start + spec.numel])
    other = next(server for server in range(1, target.num_servers) if needed_by(server) - needed)
    with pytest.raises(CorruptCheckpointError, match="the file is missing"):
        restore(path, target, other, SegmentRegistry(TieredStorage(None)))


# ---------------------------------------------------------------------- manifest last


def test_partial_and_incomplete_directories_are_never_latest(tmp_path: Path) -> None:
    store = CheckpointDir(tmp_path, keep_last=5)
    assert store.latest() is None
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        store.resolve("latest")
    good = save(store, 1, random_data(2_000, 1), [1_000])

    partial = store.begin(2)  # files written, never committed
    write_segments(partial, 2, 2, random_data(2_000, 2), [(0, 0, 2_000)])
    assert store.latest() == good
    with pytest.raises(CheckpointError, match="unfinished"):
        store.resolve(str(partial))

    # a manifest, but a file missing or short: skipped by latest(), refused by resolve()
    for damage in ("missing", "short"):
        fake = tmp_path / "step-0000000003"
        shutil.copytree(good, fake)
        manifest = json.loads((fake / MANIFEST_NAME).read_text())
        manifest["step"] = 3
        manifest["shards"] = [{**s, "step": 3} for s in manifest["shards"]]
        (fake / MANIFEST_NAME).write_text(json.dumps(manifest))
        assert store.latest() == fake  # complete as it stands
        victim = manifest["files"][1]["name"]
        if damage == "missing":
            (fake / victim).unlink()
        else:
            with open(fake / victim, "r+b") as handle:
                handle.truncate(100)
        assert store.latest() == good, damage
        with pytest.raises(CheckpointError, match=victim):
            store.resolve(str(fake))
        shutil.rmtree(fake)


def test_pruning_removes_only_the_owners_checkpoints(tmp_path: Path) -> None:
    """Issue 27 row B: pruning deleted another run's checkpoints in a shared root. A store
    given its run's ids prunes only checkpoints whose manifests name one of them; an
    unreadable manifest is nobody's."""
    data = random_data(640, 0)
    foreign = save(CheckpointDir(tmp_path), 1, data, [64])
    manifest = foreign / MANIFEST_NAME
    manifest.write_text(manifest.read_text().replace('"run_id": "run-test"', '"run_id": "run-other"'))
    broken = save(CheckpointDir(tmp_path), 2, data, [64])
    (broken / MANIFEST_NAME).write_text("{")
    store = CheckpointDir(tmp_path, keep_last=1, owners={"run-test"})
    for step in (3, 4):
        save(store, step, data, [64])
    assert store.complete_steps() == [1, 2, 4]
    store.own("run-other")  # a run resuming run-other's checkpoint prunes them in turn
    save(store, 5, data, [64])
    assert store.complete_steps() == [2, 5]


def test_a_commit_prunes_what_interrupted_prunes_left(tmp_path: Path) -> None:
    """Writers killed between a commit's rename and its prune, run after run, leave more
    than keep_last complete checkpoints; the next commit that finishes brings them back."""
    data = random_data(640, 0)
    for step in (1, 2, 3, 4):  # as four crashed writers with keep_last 2 would leave them
        save(CheckpointDir(tmp_path, keep_last=10), step, data, [64])
    store = CheckpointDir(tmp_path, keep_last=2)
    save(store, 5, data, [64])
    assert store.complete_steps() == [4, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-0000000004", "step-0000000005"]


def test_keep_last_prunes_oldest_and_stale_partials(tmp_path: Path) -> None:
    store = CheckpointDir(tmp_path, keep_last=3)
    data = random_data(640, 0)
    for step in (1, 2):
        save(store, step, data, [64])
    store.begin(3)  # stale partial of an older step: removed by the commit of step 5
    store.begin(7)  # a partial of a later step: left alone
    save(store, 5, data, [128])
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-0000000001",
        "step-0000000002",
        "step-0000000005",
        "step-0000000007.partial",
    ]
    for step in (6, 8, 9):
        save(store, step, data, [320])
    assert store.complete_steps() == [6, 8, 9]
    assert not (tmp_path / "step-0000000007.partial").exists()
    assert store.latest() == tmp_path / "step-0000000009"
    # the checkpoint just committed is kept even when newer ones exist (a resumed run)
    save(store, 4, data, [64])
    assert store.complete_steps() == [4, 8, 9]
    # committing a step again replaces it
    other = random_data(640, 1)
    path = save(store, 8, other, [64, 128])
    assert store.complete_steps() == [4, 8, 9]
    assert torch.equal(read_flat_range(path, store.load(path), 0, 640)["master"], other["master"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-0000000004", "step-0000000008", "step-0000000009"]
    store.begin(10)
    store.abort(10)
    assert not store.partial_dir(10).exists()
