"""Integrity of the tier's partition files: a corrupted byte fails the next step naming the
file and loses nothing, torn or wrong files are refused on read, and over gRPC the plan
is reported and corruption maps to DATA_LOSS."""

from __future__ import annotations

import os
import shutil
from contextlib import ExitStack
from pathlib import Path

import grpc
import pytest
import torch
from tier_stores import (
    BUFFERS,
    LR,
    NORM,
    NUMEL,
    PER_PARTITION,
    assert_same_segment,
    cold_disk_file,
    open_storage,
    seeded_randn,
    tier_config,
    tier_segment_spec,
)

from cargohold.services.core.errors import CorruptPartitionError, IncompleteUpdateError
from cargohold.services.metrics.server import StateServerMetrics
from cargohold.services.segments.segment_registry import SegmentRegistry
from cargohold.services.segments.segment_state import SegmentState
from cargohold.services.server.grpc_server import GrpcStateServer
from cargohold.services.tiers.fileformat import FileLayout
from cargohold.services.transport.grpc_client import RemoteError, StateServerClient

pytestmark = pytest.mark.timeout(60)


# --- integrity ---------------------------------------------------------------------------------


def test_a_corrupted_byte_fails_the_next_step_naming_the_file_and_loses_nothing(tmp_path: Path) -> None:
    with open_storage(tier_config(tmp_path)) as storage:
        state = SegmentRegistry(storage).register(tier_segment_spec(), seeded_randn(0))
        ram = SegmentState(tier_segment_spec(), seeded_randn(0))
        for s in (state, ram):
            s.apply_gradient(1, seeded_randn(1), global_norm=NORM, lr=LR)
        victim = cold_disk_file(storage)
        offset = FileLayout(PER_PARTITION).offset(2) + 1001  # a byte of exp_avg_sq
        with open(victim, "r+b") as f:
            f.seek(offset)
            original = f.read(1)
            f.seek(offset)
            f.write(bytes([original[0] ^ 0x10]))

        with pytest.raises(CorruptPartitionError) as caught:
            state.apply_gradient(2, seeded_randn(2), global_norm=NORM, lr=LR)
        assert caught.value.path == victim
        assert victim in str(caught.value) and "exp_avg_sq checksum mismatch" in str(caught.value)
        assert state.updates == 1
        with pytest.raises(IncompleteUpdateError, match="repeat the push of update 2"):
            state.weights(1, "float32")

        with open(victim, "r+b") as f:  # repaired (as from a backup): the retry finishes step 2
            f.seek(offset)
            f.write(original)
        assert state.apply_gradient(2, seeded_randn(2), global_norm=NORM, lr=LR).applied
        ram.apply_gradient(2, seeded_randn(2), global_norm=NORM, lr=LR)
        assert torch.equal(state.weights(2, "float32"), ram.weights(2, "float32"))
        assert_same_segment(state, ram)


@pytest.mark.parametrize("damage", ["truncate", "header", "other-partition", "missing"])
def test_torn_or_wrong_files_are_refused_on_read(tmp_path: Path, damage: str) -> None:
    with open_storage(tier_config(tmp_path)) as storage:
        state = SegmentRegistry(storage).register(tier_segment_spec(), seeded_randn(0))
        state.apply_gradient(1, seeded_randn(1), global_norm=NORM, lr=LR)
        victim = cold_disk_file(storage)
        if damage == "truncate":  # a torn write: the tail never reached the disk
            os.truncate(victim, FileLayout(PER_PARTITION).file_bytes - 4096)
            reason = "a torn write"
        elif damage == "header":
            with open(victim, "r+b") as f:
                f.seek(60)
                byte = f.read(1)
                f.seek(60)
                f.write(bytes([byte[0] ^ 1]))
            reason = "header checksum mismatch"
        elif damage == "other-partition":
            other = next(r.path for r in storage.rows() if r.path and r.path != victim and r.key.index > 1)
            shutil.copyfile(other, victim)
            reason = "the file holds partition"
        else:
            os.unlink(victim)
            reason = "missing"
        with pytest.raises(CorruptPartitionError, match=reason) as caught:
            state.weights(1, "float32")
        assert caught.value.path == victim and victim in str(caught.value)


# --- the gRPC face --------------------------------------------------------------------------


@pytest.mark.integration
def test_grpc_reports_the_plan_and_maps_corruption_to_data_loss(tmp_path: Path) -> None:
    with ExitStack() as stack:
        metrics = StateServerMetrics("tier")
        storage = stack.enter_context(open_storage(tier_config(tmp_path), metrics))
        server = GrpcStateServer(SegmentRegistry(storage), metrics, run_id="run-t", host="127.0.0.1")
        server.start()
        stack.callback(server.stop, 0.5)
        client = stack.enter_context(StateServerClient(server.address, chunk_bytes=1 << 16, timeout_s=10))
        client.wait_ready(timeout_s=10)
        client.register(tier_segment_spec(), seeded_randn(0))
        client.push("run-t", 0, 1, seeded_randn(1), global_norm=NORM, lr=LR)
        stats = client.stats()
        assert stats.tier is not None and stats.tier.enabled and stats.tier.buffer_count == BUFFERS
        assert stats.tier.paths == tuple(str(tmp_path / d) for d in ("d0", "d1"))
        assert len(stats.partitions) == 11
        assert sorted(r.order for r in stats.partitions) == list(range(11))
        assert stats.resident_bytes_by_tier == {"ram": 12 * 2 * PER_PARTITION, "nvme": 12 * (NUMEL - 2 * PER_PARTITION)}

        victim = cold_disk_file(storage)
        with open(victim, "r+b") as f:
            f.seek(5000)
            byte = f.read(1)
            f.seek(5000)
            f.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(RemoteError) as caught:
            client.push("run-t", 0, 2, seeded_randn(2), global_norm=NORM, lr=LR)
        assert caught.value.code == grpc.StatusCode.DATA_LOSS and victim in caught.value.details
        with pytest.raises(RemoteError) as incomplete:
            client.fetch("run-t", 0, 1, "float32", NUMEL)
        assert incomplete.value.code == grpc.StatusCode.FAILED_PRECONDITION
