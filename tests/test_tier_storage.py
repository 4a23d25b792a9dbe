"""The tier store with real files: bitwise equality with the all-RAM store while most
partitions live on disk, the prefetch/write-behind pipeline and its metrics, detection of
corrupted and torn partition files, O_DIRECT fallback, disk-full handling at start-up and
at run time, and the RAM budget measured as RSS.

Filesystems that refuse O_DIRECT (ramfs) or are small enough to fill (a 2 MiB tmpfs) are
mounted inside a private user and mount namespace (``unshare -Urm``) of a subprocess, so
nothing is mounted on the machine; those tests skip where namespaces are not allowed.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import grpc
import pytest
import torch
from system import run_measured

from cargohold.cluster.config import StateServerConfig, TierConfig
from cargohold.services.errors import (
    CorruptPartitionError,
    IncompleteStepError,
    TierError,
    TierSpaceError,
)
from cargohold.services.metrics import StateServerMetrics
from cargohold.services.optim import AdamWHyperParams
from cargohold.services.segment_state import SegmentRegistry, SegmentSpec, SegmentState
from cargohold.services.state_server import StateServer
from cargohold.services.tiers.fileformat import FileLayout
from cargohold.services.tiers.nvme import check_free_space
from cargohold.services.tiers.residency import Residency
from cargohold.services.tiers.source import tensor_source
from cargohold.services.tiers.storage import TieredStorage
from cargohold.services.transport.grpc_client import RemoteError, StateServerClient
from cargohold.services.transport.grpc_server import GrpcStateServer

pytestmark = pytest.mark.timeout(60)

HYPER = AdamWHyperParams(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, max_grad_norm=1.0)
PARTITION_BYTES = 16 << 10  # 1344 elements a partition
PER_PARTITION = 1344
NUMEL = 10 * PER_PARTITION + 320  # 11 partitions, the last one short
FRAGMENTS = ((0, 5000), (5056, 6000), (11072, 2688))  # cut at multiples of 64; padding between
BUFFER_BYTES = FileLayout(PER_PARTITION).file_bytes
BUFFERS = 3
BUDGET = BUFFERS * BUFFER_BYTES + 2 * BUFFER_BYTES  # staging plus two resident partitions
LR = 1e-2
NORM = 2.0  # > max_grad_norm: clipping is active


def _spec(segment_id: int = 0, run_id: str = "run-t") -> SegmentSpec:
    return SegmentSpec(
        run_id=run_id,
        segment_id=segment_id,
        start=0,
        numel=NUMEL,
        fragments=FRAGMENTS,
        grad_dtype="float32",
        hyper=HYPER,
    )


def _randn(seed: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed))


def _config(tmp_path: Path, **changes: object) -> TierConfig:
    fields: dict[str, object] = dict(
        nvme_paths=[str(tmp_path / "d0"), str(tmp_path / "d1")],
        ram_budget_bytes=BUDGET,
        partition_bytes=PARTITION_BYTES,
        buffer_count=BUFFERS,
        io_threads=2,
    )
    fields.update(changes)
    return TierConfig(**fields)  # type: ignore[arg-type]


def _assert_same(tiered: SegmentState, ram: SegmentState) -> None:
    a, b = tiered.snapshot(), ram.snapshot()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs"


class Recorder:
    """A TierObserver that keeps what it is told."""

    def __init__(self) -> None:
        self.io: dict[str, list[int]] = {"read": [], "write": []}
        self.hits = self.misses = 0
        self.wait = 0.0
        self.depths: list[int] = []
        self.plans: list[dict[str, int]] = []

    def record_tier_io(self, op: str, nbytes: int, seconds: float) -> None:
        self.io[op].append(nbytes)

    def set_tier_queue_depth(self, depth: int) -> None:
        self.depths.append(depth)

    def record_prefetch(self, hit: bool) -> None:
        self.hits += hit
        self.misses += not hit

    def add_tier_io_wait(self, seconds: float) -> None:
        self.wait += seconds

    def set_tier_plan(self, partitions: dict[str, int], predicted_io_seconds: float) -> None:
        self.plans.append(partitions)


@contextmanager
def _storage(config: TierConfig, observer: Recorder | None = None) -> Iterator[TieredStorage]:
    storage = TieredStorage(config, observer=observer)
    try:
        yield storage
    finally:
        storage.close()


def _cold_disk_file(storage: TieredStorage) -> str:
    """A disk partition in the middle of the shard: not among the last ones written, so
    no staging buffer still holds it and the next step must read its file."""
    disk = [r for r in storage.rows() if r.actual is Residency.NVME]
    return disk[len(disk) // 2].path


# --- bitwise and pipelined -----------------------------------------------------------------


def test_most_partitions_on_disk_is_bitwise_equal_to_ram(tmp_path: Path) -> None:
    recorder = Recorder()
    with _storage(_config(tmp_path), recorder) as storage:
        tiered = SegmentRegistry(storage).register(_spec(), _randn(0))
        ram = SegmentState(_spec(), _randn(0))
        rows = storage.rows()
        assert len(rows) == 11 and [r.actual for r in rows].count(Residency.RAM) == 2
        assert {Path(r.path).parent.parent.parent.name for r in rows if r.path} == {"d0", "d1"}
        assert all(f"run-t{os.sep}server-0{os.sep}shard-000000.part-" in r.path for r in rows if r.path)
        for step in range(1, 7):
            for state in (tiered, ram):
                assert state.apply_gradient(step, _randn(100 + step), global_norm=NORM, lr=LR).applied
            dtype = "bfloat16" if step % 2 else "float32"
            assert torch.equal(tiered.weights(step, dtype), ram.weights(step, dtype))
        _assert_same(tiered, ram)
        summary = storage.summary()
        assert summary.ram_used_bytes <= BUDGET and summary.staging_bytes == BUFFERS * BUFFER_BYTES
        assert storage.state_bytes()[Residency.NVME] == 12 * (NUMEL - 2 * PER_PARTITION)

    disk_updates = 9 * 6
    # Every disk partition's update counts as a prefetch hit or miss. How many hit depends
    # on when buffers come back from writes (I/O timing on a shared machine), so the
    # ratio is measured by benchmarks/nvme_tier.py, not asserted here.
    assert recorder.hits + recorder.misses == disk_updates
    assert len(recorder.io["write"]) == 9 * 7  # creation, then every step
    # Warm buffers spare reads: fewer full reads than disk partition updates.
    full_reads = [n for n in recorder.io["read"] if n > BUFFER_BYTES // 2]
    assert len(full_reads) < disk_updates
    assert max(recorder.depths) >= 1 and recorder.depths[-1] == 0
    assert recorder.plans[-1] == {"ram": 2, "nvme": 9}
    assert not list(tmp_path.rglob("*.bin")), "close() removes the partition files"


def test_weights_an_update_prepared_are_fetched_without_reading_the_tiers(tmp_path: Path) -> None:
    """Preparing is asked for explicitly: with ``prepare`` the update writes the weights
    on its way through the partitions and the fetch reads no file; without it (or in
    another dtype) the fetch reads the state back from the disk partitions."""
    recorder = Recorder()
    with _storage(_config(tmp_path), recorder) as storage:
        tiered = SegmentRegistry(storage).register(_spec(), _randn(0))
        ram = SegmentState(_spec(), _randn(0))
        for step, prepare, fetched, reads_file in (
            (1, "bfloat16", "bfloat16", False),
            (2, None, "bfloat16", True),
            (3, "float32", "bfloat16", True),
            (4, "float32", "float32", False),
        ):
            assert tiered.apply_gradient(step, _randn(step), global_norm=NORM, lr=LR, prepare=prepare).applied
            ram.apply_gradient(step, _randn(step), global_norm=NORM, lr=LR)
            reads = len(recorder.io["read"])
            assert torch.equal(tiered.weights(step, fetched), ram.weights(step, fetched))
            assert (len(recorder.io["read"]) > reads) == reads_file, f"update {step}"


def test_a_second_shard_is_planned_in_and_partitions_move_after_updates(tmp_path: Path) -> None:
    with _storage(_config(tmp_path)) as storage:
        registry = SegmentRegistry(storage)
        a = registry.register(_spec(0), _randn(0))
        assert [r.index for r in [x.key for x in storage.rows()]][:2] == [0, 1]
        b = registry.register(_spec(1), _randn(1))
        rows = {(r.key.segment_id, r.key.index): r for r in storage.rows()}
        # The plan gives each shard its head partition; RAM is still full of shard 0's.
        assert rows[(0, 1)].planned is Residency.NVME and rows[(0, 1)].actual is Residency.RAM
        assert rows[(1, 0)].planned is Residency.RAM and rows[(1, 0)].actual is Residency.NVME
        refs = [SegmentState(_spec(0), _randn(0)), SegmentState(_spec(1), _randn(1))]
        for step in (1, 2):
            for state in (a, b, *refs):
                state.apply_gradient(step, _randn(step), global_norm=NORM, lr=LR)
        rows = storage.rows()
        assert all(r.planned is r.actual for r in rows)
        assert [r.key.index for r in rows if r.actual is Residency.RAM] == [0, 0]
        _assert_same(a, refs[0])
        _assert_same(b, refs[1])
        assert storage.summary().ram_used_bytes <= BUDGET


def test_without_a_budget_each_shard_is_one_ram_partition() -> None:
    registry = SegmentRegistry()
    registry.register(_spec(), _randn(0))
    (row,) = registry.storage.rows()
    assert (row.numel, row.actual, row.path) == (NUMEL, Residency.RAM, "")
    assert registry.bytes_by_tier() == {"ram": 12 * NUMEL}


@pytest.mark.parametrize("direct_io", ["off", "auto"])
def test_direct_io_setting(tmp_path: Path, direct_io: str) -> None:
    with _storage(_config(tmp_path, direct_io=direct_io)) as storage:
        state = SegmentRegistry(storage).register(_spec(), _randn(0))
        ram = SegmentState(_spec(), _randn(0))
        for step in (1, 2):
            state.apply_gradient(step, _randn(step), global_norm=NORM, lr=LR)
            ram.apply_gradient(step, _randn(step), global_norm=NORM, lr=LR)
        _assert_same(state, ram)
        if direct_io == "off":
            assert storage.summary().direct_io == (False, False)


# --- integrity ---------------------------------------------------------------------------------


def test_a_corrupted_byte_fails_the_next_step_naming_the_file_and_loses_nothing(tmp_path: Path) -> None:
    with _storage(_config(tmp_path)) as storage:
        state = SegmentRegistry(storage).register(_spec(), _randn(0))
        ram = SegmentState(_spec(), _randn(0))
        for s in (state, ram):
            s.apply_gradient(1, _randn(1), global_norm=NORM, lr=LR)
        victim = _cold_disk_file(storage)
        offset = FileLayout(PER_PARTITION).offset(2) + 1001  # a byte of exp_avg_sq
        with open(victim, "r+b") as f:
            f.seek(offset)
            original = f.read(1)
            f.seek(offset)
            f.write(bytes([original[0] ^ 0x10]))

        with pytest.raises(CorruptPartitionError) as caught:
            state.apply_gradient(2, _randn(2), global_norm=NORM, lr=LR)
        assert caught.value.path == victim
        assert victim in str(caught.value) and "exp_avg_sq checksum mismatch" in str(caught.value)
        assert state.updates == 1
        with pytest.raises(IncompleteStepError, match="repeat the push of step 2"):
            state.weights(1, "float32")

        with open(victim, "r+b") as f:  # repaired (as from a backup): the retry finishes step 2
            f.seek(offset)
            f.write(original)
        assert state.apply_gradient(2, _randn(2), global_norm=NORM, lr=LR).applied
        ram.apply_gradient(2, _randn(2), global_norm=NORM, lr=LR)
        assert torch.equal(state.weights(2, "float32"), ram.weights(2, "float32"))
        _assert_same(state, ram)


@pytest.mark.parametrize("damage", ["truncate", "header", "other-partition", "missing"])
def test_torn_or_wrong_files_are_refused_on_read(tmp_path: Path, damage: str) -> None:
    with _storage(_config(tmp_path)) as storage:
        state = SegmentRegistry(storage).register(_spec(), _randn(0))
        state.apply_gradient(1, _randn(1), global_norm=NORM, lr=LR)
        victim = _cold_disk_file(storage)
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


# --- start-up checks ------------------------------------------------------------------------


def test_free_space_check_names_path_and_setting() -> None:
    check_free_space("/nvme", 100, 100, "shard 1")
    with pytest.raises(TierSpaceError) as caught:
        check_free_space("/nvme", 101, 100, "shard 1 of run 'r'")
    message = str(caught.value)
    assert "/nvme has 100 bytes free" in message and "needs 101 bytes" in message
    assert "state_server.tier.nvme_paths" in message and "state_server.tier.ram_budget_bytes" in message


def test_state_larger_than_the_free_space_is_refused_at_registration(tmp_path: Path) -> None:
    staging = TierConfig(partition_bytes=1 << 30, buffer_count=2).staging_bytes()
    config = _config(tmp_path, partition_bytes=1 << 30, buffer_count=2, ram_budget_bytes=staging)
    with _storage(config) as storage:
        numel = shutil.disk_usage(tmp_path).free // 12 * 2 // 64 * 64  # twice what the disk holds
        # Nothing fits in RAM, and the size check runs before a tensor is touched: no
        # need for the initial weights of a state that size.
        with pytest.raises(TierSpaceError, match="bytes free") as caught:
            storage.add_shard("run-t", 0, numel, (), tensor_source(torch.empty(0)))
        assert "shard 0 of run 'run-t'" in str(caught.value)
        assert storage.rows() == [] and not list(tmp_path.rglob("*.bin"))


def test_an_unusable_path_fails_the_state_server_at_start_up(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    config = StateServerConfig(
        bind_host="127.0.0.1", tier=TierConfig(nvme_paths=[str(blocker / "nvme")], ram_budget_bytes=1 << 30)
    )
    with pytest.raises(TierError, match=f"cannot create {blocker / 'nvme'}"):
        StateServer(config, run_id="run-t", server_index=0, metrics_enabled=False)


def test_two_live_servers_cannot_share_a_tier_folder(tmp_path: Path) -> None:
    """Two runs given one run id (or two servers one index) would overwrite each other's
    partition files and delete them at the end: the second is refused, the first keeps
    its files, and once it is gone the folder can be used again."""
    with _storage(_config(tmp_path)) as first:
        SegmentRegistry(first).register(_spec(), _randn(0))
        files = sorted(tmp_path.rglob("*.bin"))
        with _storage(_config(tmp_path)) as second, pytest.raises(TierError, match="in use by another state server"):
            SegmentRegistry(second).register(_spec(), _randn(1))
        assert sorted(tmp_path.rglob("*.bin")) == files  # the refused one touched nothing
    with _storage(_config(tmp_path)) as again:
        SegmentRegistry(again).register(_spec(), _randn(2))
    assert not list(tmp_path.rglob("*.bin")) and not list(tmp_path.rglob(".lock"))


def test_run_ids_that_cannot_name_a_directory_are_refused(tmp_path: Path) -> None:
    with _storage(_config(tmp_path)) as storage, pytest.raises(TierError, match="cannot name a directory"):
        SegmentRegistry(storage).register(_spec(run_id="../escape"), _randn(0))


# --- the gRPC face --------------------------------------------------------------------------


@pytest.mark.integration
def test_grpc_reports_the_plan_and_maps_corruption_to_data_loss(tmp_path: Path) -> None:
    with ExitStack() as stack:
        metrics = StateServerMetrics("tier")
        storage = stack.enter_context(_storage(_config(tmp_path), metrics))
        server = GrpcStateServer(SegmentRegistry(storage), metrics, run_id="run-t", host="127.0.0.1")
        server.start()
        stack.callback(server.stop, 0.5)
        client = stack.enter_context(StateServerClient(server.address, chunk_bytes=1 << 16, timeout_s=10))
        client.wait_ready(timeout_s=10)
        client.register(_spec(), _randn(0))
        client.push("run-t", 0, 1, _randn(1), global_norm=NORM, lr=LR)
        stats = client.stats()
        assert stats.tier is not None and stats.tier.enabled and stats.tier.buffer_count == BUFFERS
        assert stats.tier.paths == tuple(str(tmp_path / d) for d in ("d0", "d1"))
        assert len(stats.partitions) == 11
        assert sorted(r.order for r in stats.partitions) == list(range(11))
        assert stats.resident_bytes_by_tier == {"ram": 12 * 2 * PER_PARTITION, "nvme": 12 * (NUMEL - 2 * PER_PARTITION)}

        victim = _cold_disk_file(storage)
        with open(victim, "r+b") as f:
            f.seek(5000)
            byte = f.read(1)
            f.seek(5000)
            f.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(RemoteError) as caught:
            client.push("run-t", 0, 2, _randn(2), global_norm=NORM, lr=LR)
        assert caught.value.code == grpc.StatusCode.DATA_LOSS and victim in caught.value.details
        with pytest.raises(RemoteError) as incomplete:
            client.fetch("run-t", 0, 1, "float32", NUMEL)
        assert incomplete.value.code == grpc.StatusCode.FAILED_PRECONDITION


# --- in a private mount namespace: ramfs (no O_DIRECT) and a tmpfs that fills up -------------


_PRELUDE = textwrap.dedent(f"""
    import json, os, sys, torch
    from cargohold.cluster.config import TierConfig
    from cargohold.services.errors import IncompleteStepError, TierError, TierSpaceError
    from cargohold.services.optim import AdamWHyperParams
    from cargohold.services.segment_state import SegmentRegistry, SegmentSpec, SegmentState
    from cargohold.services.tiers.storage import TieredStorage
    HYPER = AdamWHyperParams(max_grad_norm=1.0, weight_decay=0.1)
    N = {NUMEL}
    SPEC = SegmentSpec(run_id="ns", segment_id=0, start=0, numel=N, fragments={FRAGMENTS!r},
                     grad_dtype="float32", hyper=HYPER)
    def randn(seed):
        return torch.randn(N, generator=torch.Generator().manual_seed(seed))
    def config(path, **changes):
        fields = dict(nvme_paths=[path], ram_budget_bytes={BUDGET}, partition_bytes={PARTITION_BYTES},
                      buffer_count={BUFFERS}, io_threads=2)
        fields.update(changes)
        return TierConfig(**fields)
    def same(a, b):
        sa, sb = a.snapshot(), b.snapshot()
        return all(torch.equal(sa[k], sb[k]) for k in sa)
""")


def _in_namespace(tmp_path: Path, mounts: list[tuple[str, str]], body: str) -> dict:
    """Run ``body`` (after the prelude) in a subprocess with ``mounts`` (fstype, options)
    at tmp_path/m0, m1, ...; returns the JSON the script prints last."""
    if (
        shutil.which("unshare") is None
        or subprocess.run(["unshare", "-Urm", "true"], capture_output=True, timeout=10).returncode != 0
    ):
        pytest.skip("user and mount namespaces are not available here")
    commands = []
    for index, (fstype, options) in enumerate(mounts):
        target = tmp_path / f"m{index}"
        target.mkdir()
        commands.append(f"mount -t {fstype} -o {options} {fstype} {shlex.quote(str(target))}")
    script = _PRELUDE + textwrap.dedent(body)
    commands.append(f"exec {shlex.quote(sys.executable)} -c {shlex.quote(script)} {shlex.quote(str(tmp_path))}")
    done = subprocess.run(
        ["unshare", "-Urm", "sh", "-c", " && ".join(commands)], capture_output=True, text=True, timeout=50
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_o_direct_refused_by_the_filesystem_falls_back_to_buffered_io(tmp_path: Path) -> None:
    result = _in_namespace(
        tmp_path,
        [("ramfs", "mode=0700")],
        """
        root = sys.argv[1] + "/m0/tier"
        try:
            TieredStorage(config(root, direct_io="on"))
            refused = ""
        except TierError as error:
            refused = str(error)
        storage = TieredStorage(config(root))
        state = SegmentRegistry(storage).register(SPEC, randn(0))
        ram = SegmentState(SPEC, randn(0))
        for step in (1, 2, 3):
            state.apply_gradient(step, randn(step), global_norm=2.0, lr=1e-2)
            ram.apply_gradient(step, randn(step), global_norm=2.0, lr=1e-2)
        print(json.dumps({"refused": refused, "direct": storage.summary().direct_io, "same": same(state, ram)}))
        storage.close()
    """,
    )
    assert "refuses O_DIRECT" in result["refused"] and "state_server.tier.direct_io" in result["refused"]
    assert result["direct"] == [False] and result["same"]


def test_disk_full_at_start_up_and_at_run_time(tmp_path: Path) -> None:
    result = _in_namespace(
        tmp_path,
        [("tmpfs", "size=256k"), ("tmpfs", "size=2m")],
        """
        small, roomy = sys.argv[1] + "/m0", sys.argv[1] + "/m1"
        # Start-up: 9 partition files (252 KiB) plus room for 3 writes (84 KiB) exceed 256 KiB.
        try:
            SegmentRegistry(TieredStorage(config(small))).register(SPEC, randn(0))
            startup = ""
        except TierSpaceError as error:
            startup = str(error)
        storage = TieredStorage(config(roomy))
        state = SegmentRegistry(storage).register(SPEC, randn(0))
        ram = SegmentState(SPEC, randn(0))
        for s in (state, ram):
            s.apply_gradient(1, randn(1), global_norm=2.0, lr=1e-2)
        filler = roomy + "/filler"
        with open(filler, "wb") as f:  # another program fills the disk
            try:
                while True:
                    f.write(bytes(1 << 16))
                    f.flush()
            except OSError:
                pass
        try:
            state.apply_gradient(2, randn(2), global_norm=2.0, lr=1e-2)
            runtime = ""
        except TierSpaceError as error:
            runtime = str(error)
        step_after_failure = state.updates
        try:
            state.weights(1, "float32")
            incomplete = False
        except IncompleteStepError:
            incomplete = True
        os.unlink(filler)
        state.apply_gradient(2, randn(2), global_norm=2.0, lr=1e-2)  # the retry finishes the step
        ram.apply_gradient(2, randn(2), global_norm=2.0, lr=1e-2)
        print(json.dumps({"startup": startup, "runtime": runtime, "step": step_after_failure,
                          "incomplete": incomplete, "same": same(state, ram),
                          "temporaries": [f for f in os.listdir(roomy + "/ns/server-0") if f.endswith(".tmp")]}))
        storage.close()
    """,
    )
    assert "bytes free" in result["startup"] and "m0" in result["startup"]
    assert "No space left on device" in result["runtime"] and "the last good file is kept" in result["runtime"]
    assert result["step"] == 1 and result["incomplete"] and result["same"]
    assert result["temporaries"] == []


# --- the budget, as the kernel counts it ----------------------------------------------------

RSS_OVERHEAD = 6 << 20
"""Memory beyond the budget a tiered update may use: per-partition temporaries (the fp32
copy of a partition's gradient, 1 MiB checksum pieces on each I/O thread) and allocator
slack. Measured 3 MiB with a 1 MiB partition."""


def test_rss_growth_stays_within_the_budget_while_the_state_is_six_times_larger(tmp_path: Path) -> None:
    script = textwrap.dedent("""
        import json, sys, torch
        torch.set_num_threads(1)
        from cargohold.cluster.config import TierConfig
        from cargohold.services.optim import AdamWHyperParams
        from cargohold.services.segment_state import SegmentRegistry, SegmentSpec
        from cargohold.services.tiers.storage import TieredStorage
        from system import proc_status, reset_peak_rss

        root, budget = sys.argv[1], int(sys.argv[2])
        def spec(run, n):
            return SegmentSpec(run_id=run, segment_id=0, start=0, numel=n, fragments=((0, n),),
                             grad_dtype="float32", hyper=AdamWHyperParams())
        def config(path, budget, partition):
            return TierConfig(nvme_paths=[path], ram_budget_bytes=budget, partition_bytes=partition,
                              buffer_count=3, io_threads=2)
        N = 4 << 20  # 48 MiB of state
        initial = torch.randn(N, generator=torch.Generator().manual_seed(0))
        gradient = torch.randn(N, generator=torch.Generator().manual_seed(1))
        # Warm up the kernel and the I/O paths on a small shard before measuring.
        warm = SegmentRegistry(TieredStorage(config(root + "/warm", 1 << 20, 64 << 10)))
        warmed = warm.register(spec("warm", 1 << 16), initial[: 1 << 16])
        warmed.apply_gradient(1, gradient[: 1 << 16], global_norm=1.0, lr=1e-3)
        warm.close()
        base = reset_peak_rss()
        registry = SegmentRegistry(TieredStorage(config(root + "/tier", budget, 1 << 20)))
        state = registry.register(spec("rss", N), initial)
        for step in (1, 2, 3):
            state.apply_gradient(step, gradient, global_norm=1.0, lr=1e-3)
        print(json.dumps({"growth": proc_status("VmHWM") - base, "state": 12 * N,
                          "nvme": registry.bytes_by_tier()["nvme"]}))
        registry.close()
    """)
    budget = 8 << 20
    result = run_measured(script, tmp_path, budget, timeout=50)
    assert result["state"] >= 6 * budget and result["nvme"] > result["state"] * 0.9
    assert result["growth"] <= budget + RSS_OVERHEAD, (
        f"RSS grew {result['growth'] / 2**20:.1f} MiB with a {budget / 2**20:.0f} MiB budget"
    )
