"""The staged update without a model-sized copy on the server: gradients staged beside
their partitions (RAM for resident ones, ``.grad`` files for disk ones), bitwise equal to
the all-RAM state with clipping triggered and not; a damaged staged gradient refused
naming its file, the update finished by pushing again; RSS flat while the whole range's
gradients wait for the norm; prepared weights bounded by the server's weight buffers."""

from __future__ import annotations

import textwrap
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import pytest
import torch
from system import run_measured
from tier_stores import (
    BUDGET,
    GRADIENT_BYTES,
    LR,
    assert_same_segment,
    open_storage,
    seeded_randn,
    tier_config,
    tier_segment_spec,
)

from cargohold.services.core.errors import CorruptPartitionError, IncompleteUpdateError, UpdateMismatchError
from cargohold.services.segments.segment_registry import SegmentRegistry
from cargohold.services.segments.segment_state import SegmentState
from cargohold.services.segments.weight_buffers import WeightBuffers
from cargohold.services.tiers.residency import Residency

CLIPPED, UNCLIPPED = 2.0, 0.5
"""Global norms above and below the spec's max_grad_norm (1.0)."""


@pytest.mark.parametrize(
    "norms", [(CLIPPED,), (UNCLIPPED,), (CLIPPED, UNCLIPPED)], ids=["clipped", "unclipped", "both"]
)
def test_a_staged_update_through_disk_is_bitwise_the_all_ram_one(tmp_path: Path, norms: tuple[float, ...]) -> None:
    with open_storage(tier_config(tmp_path)) as storage:
        tiered = SegmentRegistry(storage).register(tier_segment_spec(), seeded_randn(0))
        ram = SegmentState(tier_segment_spec(), seeded_randn(0))
        rows = storage.rows()
        on_disk = [r for r in rows if r.actual is Residency.NVME]
        assert on_disk and len(on_disk) < len(rows), "some partitions resident, most on disk"
        for step in range(1, 7):
            norm = norms[step % len(norms)]
            for state in (tiered, ram):
                gradient = seeded_randn(100 + step)
                assert not state.stage_gradient(step, gradient).applied
                gradient.fill_(float("nan"))  # the caller may reuse its buffer at once
            grads = sorted(Path(tmp_path).rglob("*.grad"))
            assert len(grads) == len(on_disk), "a disk partition's gradient waits in a file beside it"
            for state in (tiered, ram):
                outcome = state.commit(step, global_norm=norm, lr=LR, prepare="bfloat16")
                assert outcome.applied and outcome.updates == step
                assert not state.commit(step, global_norm=norm, lr=LR).applied  # a repeat is harmless
            assert torch.equal(tiered.weights(step, "bfloat16"), ram.weights(step, "bfloat16"))
        assert_same_segment(tiered, ram)


def test_a_commit_needs_the_gradient_of_its_update(tmp_path: Path) -> None:
    with open_storage(tier_config(tmp_path)) as storage:
        state = SegmentRegistry(storage).register(tier_segment_spec(), seeded_randn(0))
        with pytest.raises(UpdateMismatchError, match="no gradient staged for update 1"):
            state.commit(1, global_norm=CLIPPED, lr=LR)
        state.stage_gradient(1, seeded_randn(1))
        with pytest.raises(UpdateMismatchError, match="no gradient staged for update 2"):
            state.commit(2, global_norm=CLIPPED, lr=LR)
        with pytest.raises(UpdateMismatchError, match="update 3"):
            state.stage_gradient(3, seeded_randn(3))
        assert state.commit(1, global_norm=CLIPPED, lr=LR).applied


def test_a_damaged_staged_gradient_is_refused_naming_its_file_and_a_repeated_push_finishes(tmp_path: Path) -> None:
    with open_storage(tier_config(tmp_path)) as storage:
        tiered = SegmentRegistry(storage).register(tier_segment_spec(), seeded_randn(0))
        ram = SegmentState(tier_segment_spec(), seeded_randn(0))
        for state in (tiered, ram):
            state.stage_gradient(1, seeded_randn(1))
            state.commit(1, global_norm=CLIPPED, lr=LR)
            state.stage_gradient(2, seeded_randn(2))
        # Step 2 streams the disk partitions in descending order (stream_order): the first
        # one's file is damaged, so the RAM partitions are updated before the failure.
        victim = sorted(Path(tmp_path).rglob("*.grad"))[-1]
        with open(victim, "r+b") as handle:
            handle.seek(100)
            byte = handle.read(1)
            handle.seek(100)
            handle.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(CorruptPartitionError, match=f"{victim}.*staged gradient checksum"):
            tiered.commit(2, global_norm=CLIPPED, lr=LR)
        assert tiered.updates == 1
        with pytest.raises(IncompleteUpdateError):
            tiered.weights(1, "float32")
        tiered.stage_gradient(2, seeded_randn(2))  # the worker pushes again
        assert tiered.commit(2, global_norm=CLIPPED, lr=LR).applied
        ram.commit(2, global_norm=CLIPPED, lr=LR)
        assert_same_segment(tiered, ram)


def test_prepared_weights_are_bounded_by_the_servers_buffers() -> None:
    registry = SegmentRegistry(buffers=WeightBuffers(2))
    states = [registry.register(tier_segment_spec(i), seeded_randn(i)) for i in range(5)]
    references = [SegmentState(tier_segment_spec(i), seeded_randn(i)) for i in range(5)]
    for state, reference in zip(states, references):
        state.apply_gradient(1, seeded_randn(50), global_norm=UNCLIPPED, lr=LR, prepare="bfloat16")
        reference.apply_gradient(1, seeded_randn(50), global_norm=UNCLIPPED, lr=LR)
    assert registry.buffers.taken == 2, "two segments prepared their weights, the others left them in the state"
    for state, reference in zip(states, references):
        weights = state.weights(1, "bfloat16")
        assert torch.equal(weights, reference.master_weights().to(torch.bfloat16))
        state.recycle(weights)
    assert registry.buffers.taken == 0


def test_rss_stays_flat_while_the_whole_ranges_gradients_wait_for_the_norm(tmp_path: Path) -> None:
    """Three segments of 16 MiB fp32 gradient each are staged before any commit, as a
    step with clipping does; held in RAM they would add 48 MiB."""
    script = textwrap.dedent("""
        import json, sys, torch
        torch.set_num_threads(1)
        from cargohold.cluster.schema.server import TierConfig
        from cargohold.services.core.optim import AdamWHyperParams
        from cargohold.services.core.segment_spec import SegmentSpec
        from cargohold.services.segments.segment_registry import SegmentRegistry
        from cargohold.services.tiers.storage import TieredStorage
        from cargohold.services.segments.weight_buffers import WeightBuffers
        from system import proc_status, reset_peak_rss

        root, budget = sys.argv[1], int(sys.argv[2])
        N, SEGMENTS = 4 << 20, 3  # 3 x 48 MiB of state
        def spec(run, i, n):
            return SegmentSpec(run_id=run, segment_id=i, start=i * n, numel=n, fragments=((0, n),),
                               grad_dtype="float32", hyper=AdamWHyperParams(max_grad_norm=1.0))
        def config(path, budget, partition):
            return TierConfig(nvme_paths=[path], ram_budget_bytes=budget, partition_bytes=partition,
                              buffer_count=3, io_threads=2)
        initial = torch.randn(N, generator=torch.Generator().manual_seed(0))
        gradient = torch.randn(N, generator=torch.Generator().manual_seed(1))
        weights = torch.empty(N, dtype=torch.bfloat16)
        warm = SegmentRegistry(TieredStorage(config(root + "/warm", 1 << 20, 64 << 10)))
        warmed = warm.register(spec("warm", 0, 1 << 16), initial[: 1 << 16])
        warmed.stage_gradient(1, gradient[: 1 << 16])
        warmed.commit(1, global_norm=2.0, lr=1e-3, prepare="bfloat16")
        warmed.weights(1, "bfloat16", out=weights[: 1 << 16])
        warm.close()
        registry = SegmentRegistry(TieredStorage(config(root + "/tier", budget, 1 << 20)), WeightBuffers(0))
        states = [registry.register(spec("rss", i, N), initial) for i in range(SEGMENTS)]
        base = reset_peak_rss()
        for step in (1, 2):
            for state in states:
                state.stage_gradient(step, gradient)
            for state in states:
                state.commit(step, global_norm=2.0, lr=1e-3, prepare="bfloat16")
                state.weights(step, "bfloat16", out=weights)
        print(json.dumps({"growth": proc_status("VmHWM") - base, "gradients": 4 * N * SEGMENTS,
                          "nvme": registry.bytes_by_tier()["nvme"], "state": 12 * N * SEGMENTS}))
        registry.close()
    """)
    budget = 8 << 20
    result = run_measured(script, tmp_path, budget, timeout=120)
    assert result["nvme"] > 0.9 * result["state"]
    assert result["growth"] <= budget + (6 << 20), (
        f"RSS grew {result['growth'] / 2**20:.1f} MiB with a {budget / 2**20:.0f} MiB budget while "
        f"{result['gradients'] / 2**20:.0f} MiB of gradients were staged"
    )


def test_a_resident_partitions_staged_gradient_counts_in_the_budget(tmp_path: Path) -> None:
    """The plan keeps budget for the resident partitions' staged gradients: one gradient
    short of staging plus two full partitions with theirs, partition 1 no longer fits
    beside partition 0 (the short last one still does)."""
    for budget, resident in ((BUDGET, [0, 1]), (BUDGET - GRADIENT_BYTES, [0, 10])):
        with open_storage(tier_config(tmp_path / str(budget), ram_budget_bytes=budget)) as storage:
            SegmentRegistry(storage).register(tier_segment_spec(), seeded_randn(0))
            assert [r.key.index for r in storage.rows() if r.actual is Residency.RAM] == resident


def test_concurrent_commits_share_the_staging_buffers_without_deadlock(tmp_path: Path) -> None:
    """Four segments commit at once over three staging buffers, as a server's RPC threads
    do; each stream holds buffers while it waits for more, so a piece that needed a buffer
    of its own (a second pool) deadlocked here."""
    with open_storage(tier_config(tmp_path)) as storage:
        registry = SegmentRegistry(storage)
        tiered = [registry.register(tier_segment_spec(i), seeded_randn(i)) for i in range(4)]
        ram = [SegmentState(tier_segment_spec(i), seeded_randn(i)) for i in range(4)]
        for step in (1, 2, 3):
            for i, (a, b) in enumerate(zip(tiered, ram)):
                a.stage_gradient(step, seeded_randn(10 * step + i))
                b.stage_gradient(step, seeded_randn(10 * step + i))
            pool = ThreadPoolExecutor(max_workers=4)
            commits = [pool.submit(s.commit, step, global_norm=CLIPPED, lr=LR) for s in tiered]
            done, _ = wait(commits, timeout=60)
            pool.shutdown(wait=len(done) == 4)  # a deadlocked pool is left behind, failing below
            assert len(done) == 4, "the commits deadlocked"
            assert all(c.result().applied for c in commits)
            for state in ram:
                state.commit(step, global_norm=CLIPPED, lr=LR)
        for a, b in zip(tiered, ram):
            assert_same_segment(a, b)
