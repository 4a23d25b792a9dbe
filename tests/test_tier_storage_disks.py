"""The tier's folders and filesystems: free-space checks at start-up, unusable paths,
folders shared by two live servers, run ids that cannot name a directory, O_DIRECT
fallback, and disk-full handling at start-up and at run time.

Filesystems that refuse O_DIRECT (ramfs) or are small enough to fill (a 2 MiB tmpfs) are
mounted inside a private user and mount namespace (``unshare -Urm``) of a subprocess, so
nothing is mounted on the machine; those tests skip where namespaces are not allowed.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from tier_stores import (
    BUDGET,
    BUFFERS,
    FRAGMENTS,
    NUMEL,
    PARTITION_BYTES,
    open_storage,
    seeded_randn,
    tier_config,
    tier_segment_spec,
)

from cargohold.cluster.schema.server import StateServerConfig, TierConfig
from cargohold.services.core.errors import TierError, TierSpaceError
from cargohold.services.segments.segment_registry import SegmentRegistry
from cargohold.services.server.state_server import StateServer
from cargohold.services.tiers.folders import remove_tier_folders
from cargohold.services.tiers.nvme import check_free_space
from cargohold.services.tiers.source import tensor_source

pytestmark = pytest.mark.timeout(60)


# --- start-up checks ------------------------------------------------------------------------


def test_free_space_check_names_path_and_setting() -> None:
    check_free_space("/nvme", 100, 100, "segment 1")
    with pytest.raises(TierSpaceError) as caught:
        check_free_space("/nvme", 101, 100, "segment 1 of run 'r'")
    message = str(caught.value)
    assert "/nvme has 100 bytes free" in message and "needs 101 bytes" in message
    assert "state_server.tier.nvme_paths" in message and "state_server.tier.ram_budget_bytes" in message


def test_state_larger_than_the_free_space_is_refused_at_registration(tmp_path: Path) -> None:
    staging = TierConfig(partition_bytes=1 << 30, buffer_count=2).staging_bytes()
    config = tier_config(tmp_path, partition_bytes=1 << 30, buffer_count=2, ram_budget_bytes=staging)
    with open_storage(config) as storage:
        numel = shutil.disk_usage(tmp_path).free // 12 * 2 // 64 * 64  # twice what the disk holds
        # Nothing fits in RAM, and the size check runs before a tensor is touched: no
        # need for the initial weights of a state that size.
        with pytest.raises(TierSpaceError, match="bytes free") as caught:
            storage.add_segment("run-t", 0, numel, (), tensor_source(torch.empty(0)))
        assert "segment 0 of run 'run-t'" in str(caught.value)
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
    with open_storage(tier_config(tmp_path)) as first:
        SegmentRegistry(first).register(tier_segment_spec(), seeded_randn(0))
        files = sorted(tmp_path.rglob("*.bin"))
        with (
            open_storage(tier_config(tmp_path)) as second,
            pytest.raises(TierError, match="in use by another live process"),
        ):
            SegmentRegistry(second).register(tier_segment_spec(), seeded_randn(1))
        assert sorted(tmp_path.rglob("*.bin")) == files  # the refused one touched nothing
    with open_storage(tier_config(tmp_path)) as again:
        SegmentRegistry(again).register(tier_segment_spec(), seeded_randn(2))
    assert not list(tmp_path.rglob("*.bin")) and not list(tmp_path.rglob(".lock"))


def test_the_sweep_leaves_a_folder_a_live_server_holds(tmp_path: Path) -> None:
    """Issue 27 row A: a second run with the live run's run id and tier path is refused,
    and its teardown sweep (the launcher's, for servers it could not stop) used to delete
    the live run's folder, which then died with DATA_LOSS. The sweep takes the folder's
    lock first: a live holder keeps its files; a dead one's folder is removed."""
    config = tier_config(tmp_path)
    with open_storage(config) as live:
        SegmentRegistry(live).register(tier_segment_spec(), seeded_randn(0))
        files = sorted(tmp_path.rglob("*.bin"))
        assert files
        remove_tier_folders(config.nvme_paths, "run-t", "server-0", grace_s=0.3)
        assert sorted(tmp_path.rglob("*.bin")) == files
        folder = files[0].parent
        kept = shutil.copytree(folder, tmp_path.parent / f"{tmp_path.name}-kept")
    shutil.copytree(kept, folder)  # as a killed server leaves its folder: nobody holds the lock
    shutil.rmtree(kept)
    remove_tier_folders(config.nvme_paths, "run-t", "server-0", grace_s=0.3)
    assert not folder.exists() and not folder.parent.exists()


def test_run_ids_that_cannot_name_a_directory_are_refused(tmp_path: Path) -> None:
    with open_storage(tier_config(tmp_path)) as storage, pytest.raises(TierError, match="cannot name a directory"):
        SegmentRegistry(storage).register(tier_segment_spec(run_id="../escape"), seeded_randn(0))


# --- in a private mount namespace: ramfs (no O_DIRECT) and a tmpfs that fills up -------------


_PRELUDE = textwrap.dedent(f"""
    import json, os, sys, torch
    from cargohold.cluster.schema.server import TierConfig
    from cargohold.services.core.errors import IncompleteUpdateError, TierError, TierSpaceError
    from cargohold.services.core.optim import AdamWHyperParams
    from cargohold.services.core.segment_spec import SegmentSpec
    from cargohold.services.segments.segment_state import SegmentState
    from cargohold.services.segments.segment_registry import SegmentRegistry
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
    assert "refuses O_DIRECT" in result["refused"] and "tuning.state_server.tier.direct_io" in result["refused"]
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
        except IncompleteUpdateError:
            incomplete = True
        os.unlink(filler)
        # the retry finishes the step, and writes all the weights where its caller asks,
        # those of the partitions the failed attempt updated too
        out = torch.full((N,), float("nan"))
        state.apply_gradient(2, randn(2), global_norm=2.0, lr=1e-2, prepare="float32", weights_out=out)
        ram.apply_gradient(2, randn(2), global_norm=2.0, lr=1e-2)
        print(json.dumps({"startup": startup, "runtime": runtime, "step": step_after_failure,
                          "incomplete": incomplete, "same": same(state, ram),
                          "written": torch.equal(out, ram.weights(2, "float32")),
                          "temporaries": [f for f in os.listdir(roomy + "/ns/server-0") if f.endswith(".tmp")]}))
        storage.close()
    """,
    )
    assert "bytes free" in result["startup"] and "m0" in result["startup"]
    assert "No space left on device" in result["runtime"] and "the last good file is kept" in result["runtime"]
    assert result["step"] == 1 and result["incomplete"] and result["same"] and result["written"]
    assert result["temporaries"] == []
