"""The checkpoint format on real files: round trips under any cut, restoring onto other
worker and server counts, the manifest-last rule, crash consistency under SIGKILL,
corruption, a full disk, and the model check. The checkpoints are written as state
servers write them (:class:`ShardCheckpointer`, here all in RAM) and committed as the
launcher commits them (``checkpoints.py``); the manifest's own checks are in
``test_checkpoint_manifest.py``.

The crash tests kill writer processes. Starting Python with torch costs seconds, so one
helper process (the "zygote") imports everything once and forks a writer per trial; the
writers run the helpers of this very file, loaded by path.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import resource
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from checkpoints import (
    RUN,
    SHAPES,
    flat_manifest,
    group_layout,
    random_data,
    restore,
    save,
    save_layout,
    write_segments,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cargohold.cluster.config import TierConfig
from cargohold.services.checkpoint import MANIFEST_NAME, CheckpointDir, Manifest, read_flat_range
from cargohold.services.errors import CheckpointError, CorruptCheckpointError
from cargohold.services.layout import scatter_params
from cargohold.services.reshard import segment_runs
from cargohold.services.segment_state import SegmentRegistry
from cargohold.services.tiers.fileformat import ARRAYS, HEADER_BYTES, FileLayout
from cargohold.services.tiers.partitions import elements_per_partition
from cargohold.services.tiers.storage import TieredStorage

pytestmark = pytest.mark.timeout(120)

# ------------------------------------------------------------------------------ helpers
# Used by the tests and, loaded by path, by the forked writer processes.

WRITER_TOTAL = 3 * 2**18
"""Elements of the crash writer's buffer: 3 arrays x 3 MiB, so a save takes a while."""
WRITER_KEEP = 2


def writer_cuts(step: int, total: int = WRITER_TOTAL) -> list[int]:
    """Where the writer cuts its buffer into 3 files at ``step`` (varies with the step)."""
    return sorted(64 * u for u in random.Random(step).sample(range(1, total // 64), 2))


def save_writer_step(store: CheckpointDir, step: int) -> Path:
    """What the crash writer saves at ``step``: content a pure function of the step."""
    return save(store, step, random_data(WRITER_TOTAL, step), writer_cuts(step))


def writer_loop(root: str, timings: str) -> None:
    """Save steps after the latest one, forever (until killed); append each save's
    duration to ``timings`` so the test can aim its kills."""
    store = CheckpointDir(Path(root), keep_last=WRITER_KEEP)
    latest = store.latest()
    step = store.load(latest).step + 1 if latest is not None else 1
    while True:
        began = time.monotonic()
        save_writer_step(store, step)
        fd = os.open(timings, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.write(fd, f"{time.monotonic() - began:.6f}\n".encode())  # one small write: whole or nothing
        os.close(fd)
        step += 1


def save_steps(root: str, count: str) -> None:
    store = CheckpointDir(Path(root), keep_last=WRITER_KEEP)
    for step in range(1, int(count) + 1):
        save_writer_step(store, step)


def save_under_size_limit(root: str, limit: str, result: str) -> None:
    """Save step 2 of the writer with files limited to ``limit`` bytes; report the error."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(limit), hard))
    try:
        save_writer_step(CheckpointDir(Path(root), keep_last=WRITER_KEEP), 2)
        outcome = "saved"
    except CheckpointError as error:
        outcome = str(error)
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
    Path(result).write_text(outcome)


def verify_writer_checkpoint(path: Path) -> int:
    """Assert the checkpoint at ``path`` is complete and holds what the writer saves for
    its step; returns the step."""
    manifest = CheckpointDir(path.parent).load(path)
    assert path.name == f"step-{manifest.step:010d}"
    assert manifest.updates == manifest.step - 1
    assert [s.start for s in manifest.shards][1:] == writer_cuts(manifest.step)
    got = read_flat_range(path, manifest, 0, WRITER_TOTAL)
    expected = random_data(WRITER_TOTAL, manifest.step)
    for name in ARRAYS:
        assert torch.equal(got[name], expected[name]), f"{path}: {name} differs from step {manifest.step}'s"
    return manifest.step


# ------------------------------------------------------------------------------- zygote

ZYGOTE = r"""
import importlib.util, os, sys, traceback
import torch
torch.set_num_threads(1)  # no thread pools before fork
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[1])))  # its helpers, beside it
spec = importlib.util.spec_from_file_location("checkpoint_test_helpers", sys.argv[1])
helpers = importlib.util.module_from_spec(spec)
spec.loader.exec_module(helpers)
print("ready", flush=True)
for line in sys.stdin:
    command, *args = line.split()
    if command == "spawn":
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                getattr(helpers, args[0])(*args[1:])
            except BaseException:
                traceback.print_exc()
                code = 3
            sys.stderr.flush()
            os._exit(code)
        print(pid, flush=True)
    elif command == "wait":
        _, status = os.waitpid(int(args[0]), 0)
        print(os.waitstatus_to_exitcode(status), flush=True)
"""


class Zygote:
    """A Python process with torch and this file loaded, forking helper calls on demand."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self._log_file = open(log, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", ZYGOTE, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log_file,
            text=True,
        )
        self._reply("ready")

    def _reply(self, expected: str | None = None) -> str:
        line = self.proc.stdout.readline().strip()
        if not line or (expected is not None and line != expected):
            pytest.fail(f"zygote answered {line!r}; its log:\n{self.log.read_text()}")
        return line

    def _ask(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def spawn(self, function: str, *args: str) -> int:
        return int(self._ask(" ".join(["spawn", function, *args])))

    def wait(self, pid: int) -> int:
        """Reap a child; its exit code, or -signal if a signal ended it."""
        return int(self._ask(f"wait {pid}"))

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        self._log_file.close()


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory):
    helper = Zygote(tmp_path_factory.mktemp("zygote") / "zygote.log")
    yield helper
    helper.close()


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
    assert [(s.start, s.stop) for s in manifest.shards] == [(0, 1_000), (1_000, 6_400), (6_400, 10_000)]
    middle = manifest.shards[1].file
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
    saved = group_layout(*saved_at)
    path = save_layout(
        CheckpointDir(tmp_path / "ckpt"), 40, saved, {key: scatter_params(saved, state[key]) for key in ARRAYS}
    )
    target = group_layout(*restored_at)
    expected = {key: scatter_params(target, state[key]) for key in ARRAYS}
    got = {key: torch.full((target.total,), float("nan")) for key in ARRAYS}
    for server in range(target.num_servers):
        registry = SegmentRegistry(TieredStorage(_small_partitions(tmp_path / f"nvme{server}") if tier else None))
        try:
            restore(path, target, server, registry)
            for shard in registry.shards(RUN):
                assert shard.updates == 40
                for key, values in shard.snapshot().items():
                    got[key][shard.spec.start : shard.spec.start + shard.spec.numel] = values
        finally:
            registry.close()
    for key in ARRAYS:
        assert torch.equal(got[key], expected[key]), key


def test_a_server_reads_only_the_files_its_segments_need(tmp_path: Path) -> None:
    """The other files of the checkpoint may be gone: a server restoring its segments
    never opens them."""
    state = _model_state(seed=6)
    saved, target = group_layout(2, 4), group_layout(4, 4)
    path = save_layout(CheckpointDir(tmp_path), 1, saved, {key: scatter_params(saved, state[key]) for key in ARRAYS})
    manifest = CheckpointDir(tmp_path).load(path)

    def needed_by(server: int) -> set[str]:
        return {
            shard.file
            for seg in target.segments_of_server(server)
            for _, flat, length in segment_runs(saved, target, seg)
            for shard in manifest.shards
            if shard.start < flat + length and flat < shard.stop
        }

    needed = needed_by(0)
    assert 0 < len(needed) < len(manifest.files)
    for record in manifest.files:
        if record.name not in needed:
            (path / record.name).unlink()
    registry = SegmentRegistry(TieredStorage(None))
    restore(path, target, 0, registry)
    expected = scatter_params(target, state["exp_avg_sq"])
    for shard in registry.shards(RUN):
        spec = shard.spec
        assert torch.equal(shard.snapshot()["exp_avg_sq"], expected[spec.start : spec.start + spec.numel])
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


# ------------------------------------------------------------------- crash consistency


def _crash_trials(zygote: Zygote, root: Path, trials: int, seed: int) -> None:
    started = time.monotonic()
    pid = zygote.spawn("save_steps", str(root.with_name("calibration")), "2")
    assert zygote.wait(pid) == 0, zygote.log.read_text()
    floor = (time.monotonic() - started) / 2
    timings = root.with_name("timings.txt")
    store = CheckpointDir(root)
    partial_seen = progress = 0
    for trial in range(trials):
        # aim at ~3 saves, so kills land in every phase; the duration of a save is the
        # median of the writers' recent ones (the machine's load changes), never below a
        # floor that grows while kills keep coming too early for any save to finish
        recent = [float(x) for x in timings.read_text().split()[-9:]] if timings.exists() else []
        per_save = max(floor, statistics.median(recent)) if recent else floor
        delay = random.Random(seed + trial).uniform(0.0, 3.0 * per_save)
        before = store.complete_steps()
        pid = zygote.spawn("writer_loop", str(root), str(timings))
        try:
            time.sleep(delay)
        finally:
            os.kill(pid, signal.SIGKILL)
            code = zygote.wait(pid)
        assert code == -signal.SIGKILL, f"writer ended by itself ({code}):\n{zygote.log.read_text()}"
        names = sorted(os.listdir(root)) if root.exists() else []
        state = f"trial {trial}, killed after {delay:.3f}s (a save ~{per_save:.3f}s), left {names}"
        partial_seen += any(name.endswith(".partial") for name in names)
        steps = store.complete_steps()
        progress += steps != before
        if steps == before and delay > 2.0 * per_save:
            floor = 1.5 * per_save
        latest = store.latest()
        if latest is None:
            assert steps == [], f"{state}: complete directories {steps} but latest() is None"
            continue
        assert not latest.name.endswith(".partial"), state
        # every directory under a complete name is complete and holds exactly its step's data
        try:
            assert [verify_writer_checkpoint(store.final_dir(s)) for s in steps] == steps
        except (AssertionError, CheckpointError) as error:
            pytest.fail(f"{state}: {error}")
        assert latest == store.final_dir(steps[-1]) and len(steps) <= WRITER_KEEP + 1, state
    # the kills landed mid-save at least once, and the writer got somewhere
    assert partial_seen > 0 and progress > 0, (partial_seen, progress, per_save, floor)


def test_sigkill_during_saves_never_exposes_a_partial_checkpoint(zygote: Zygote, tmp_path: Path) -> None:
    _crash_trials(zygote, tmp_path / "ckpt", trials=20, seed=1_000)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkill_during_saves_many_trials(zygote: Zygote, tmp_path: Path) -> None:
    _crash_trials(zygote, tmp_path / "ckpt", trials=200, seed=50_000)


# ---------------------------------------------------------------------------- corruption


@pytest.mark.parametrize("where", ["magic", "header run id", "header checksum", "data start", "data end", "padding"])
def test_a_flipped_byte_is_caught_naming_the_file(tmp_path: Path, where: str) -> None:
    store = CheckpointDir(tmp_path)
    path = save(store, 4, random_data(4_000, 4), [1_000])
    manifest = store.load(path)
    shard = manifest.shards[1]
    victim = path / shard.file
    raw = bytearray(victim.read_bytes())
    layout = FileLayout(shard.stop - shard.start)
    offset = {
        "magic": 0,
        "header run id": raw.index(b"run-test"),
        "header checksum": raw.index(struct.pack("<I", manifest.files[1].crc32c), 0, HEADER_BYTES),
        "data start": HEADER_BYTES,
        "data end": layout.offset(2) + layout.array_bytes - 1,
        "padding": layout.file_bytes - 1,
    }[where]
    assert manifest.files[1].name == shard.file
    assert layout.file_bytes == len(raw) > layout.offset(2) + layout.array_bytes  # the last region has padding
    raw[offset] ^= 0x10
    victim.write_bytes(raw)
    with pytest.raises(CorruptCheckpointError, match=str(victim)):
        read_flat_range(path, manifest, 0, 4_000)
    read_flat_range(path, manifest, 0, 1_000)  # the other file is fine


def test_a_truncated_file_is_caught_and_skipped_by_latest(tmp_path: Path) -> None:
    store = CheckpointDir(tmp_path)
    older = save(store, 1, random_data(3_000, 1), [1_500])
    newer = save(store, 2, random_data(3_000, 2), [1_500])
    manifest = store.load(newer)
    victim = newer / manifest.shards[0].file
    for size in (victim.stat().st_size - 1, 50):
        with open(victim, "r+b") as handle:
            handle.truncate(size)
        with pytest.raises(CorruptCheckpointError, match=str(victim)):
            read_flat_range(newer, manifest, 0, 3_000)
        assert store.latest() == older


# ----------------------------------------------------------------------------- disk full


def _mount_tmpfs(mountpoint: Path, size: str) -> None:
    mountpoint.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mountpoint)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if result.returncode != 0:
        pytest.skip(
            f"cannot mount a {size} tmpfs here ({result.stderr.strip() or result.returncode}); "
            "test_a_file_size_limit_fails_the_save covers a failed write instead"
        )


def _fill(directory: Path) -> Path:
    """Write a file until the filesystem is full."""
    filler = directory / "filler"
    block = b"\xa5" * 4096
    with open(filler, "wb", buffering=0) as handle:
        try:
            while True:
                handle.write(block)
        except OSError as error:
            assert error.errno == errno.ENOSPC
    return filler


def test_disk_full_fails_the_save_and_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    mountpoint = tmp_path / "small"
    _mount_tmpfs(mountpoint, "2m")
    try:
        store = CheckpointDir(mountpoint / "ckpt", keep_last=3)
        first_data = random_data(32_768, 1)  # 384 KiB
        first = save(store, 1, first_data, [16_384])
        full = os.strerror(errno.ENOSPC)

        # a payload that does not fit: the failing file is named and removed
        with pytest.raises(CheckpointError, match=rf"failed: {full} \(\S+/server0-shard000001-part00000\.tier\)"):
            save(store, 2, random_data(196_608, 2), [98_304])  # 2 x 1.1 MiB
        assert sorted(p.name for p in store.partial_dir(2).iterdir()) == ["server0-shard000000-part00000.tier"]
        store.abort(2)

        # payload written, then the manifest does not fit: the commit fails, nothing is left
        directory = store.begin(3)
        records = write_segments(directory, 3, 3, random_data(1_024, 3), [(0, 0, 1_024)])
        filler = _fill(mountpoint)
        manifest = flat_manifest(3, 3, 1_024, records)
        with pytest.raises(CheckpointError, match=rf"{MANIFEST_NAME} failed: {full}"):
            store.commit(3, manifest)
        assert not directory.exists()

        for _ in range(2):
            assert store.latest() == first
            got = read_flat_range(first, store.load(first), 0, 32_768)
            assert all(torch.equal(got[n], first_data[n]) for n in ARRAYS)
            filler.unlink(missing_ok=True)
        assert store.latest() == first
        assert save(store, 3, random_data(1_024, 3), []) == store.latest()  # space again: saves work
    finally:
        subprocess.run(["umount", str(mountpoint)], capture_output=True, timeout=30)


def test_a_file_size_limit_fails_the_save(zygote: Zygote, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    store = CheckpointDir(root, keep_last=WRITER_KEEP)
    first = save_writer_step(store, 1)
    result = tmp_path / "result.txt"
    pid = zygote.spawn("save_under_size_limit", str(root), str(1 << 20), str(result))
    assert zygote.wait(pid) == 0, zygote.log.read_text()
    message = result.read_text()
    named = re.search(rf"failed: {os.strerror(errno.EFBIG)} \((\S+)\)", message)
    assert named, message
    assert Path(named.group(1)).parent == store.partial_dir(2)
    assert not Path(named.group(1)).exists()
    assert not any(p.name.endswith(".tmp") for p in store.partial_dir(2).iterdir())
    assert store.latest() == first
    assert verify_writer_checkpoint(first) == 1


def test_an_unwritable_place_names_the_file_and_reason(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir"
    with pytest.raises(
        CheckpointError,
        match=rf"into {missing} failed: {os.strerror(errno.ENOENT)} "
        rf"\({missing}/server0-shard000000-part00000\.tier\)",
    ):
        write_segments(missing, 1, 1, random_data(64, 0), [(0, 0, 64)])
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(CheckpointError, match="file/step-0000000001.partial"):
        CheckpointDir(blocker).begin(1)
