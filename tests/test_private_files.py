"""A run's folders under a shared scratch folder: another local user can create
``<root>/<run_id>/...`` before the run and plant symbolic links at the names the run
writes (partition temporaries, ``.grad`` files, weight files). The run must refuse such a
folder, never follow a link, and leave the links' targets as they were."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch
from tier_stores import LR, NORM, open_storage, seeded_randn, tier_config, tier_segment_spec

from cargohold.services.core.errors import TierError
from cargohold.services.core.private_files import create_file, open_file, private_folders
from cargohold.services.segments.segment_registry import SegmentRegistry
from cargohold.services.worker.weight_files import WeightFiles

pytestmark = pytest.mark.timeout(60)
VICTIM = b"another user's file\n"
KEY = "state_server.tier.nvme_paths"


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim.txt"
    victim.write_bytes(VICTIM)
    return victim


def _plant_tier_links(folder: Path, victim: Path) -> list[Path]:
    """Links at every name the tier store of ``tier_stores`` writes for segment 0."""
    folder.mkdir(parents=True, exist_ok=True)
    links = []
    for index in range(11):
        for name in (f"shard-000000.part-{index:05d}.bin.tmp", f"shard-000000.part-{index:05d}.grad"):
            (folder / name).symlink_to(victim)
            links.append(folder / name)
    return links


def _train(tmp_path: Path, steps: int = 2) -> None:
    with open_storage(tier_config(tmp_path)) as storage:
        state = SegmentRegistry(storage).register(tier_segment_spec(), seeded_randn(0))
        for update in range(1, steps + 1):
            state.stage_gradient(update, seeded_randn(100 + update))
            state.commit(update, global_norm=NORM, lr=LR)


def test_a_run_folder_others_can_write_is_refused_and_its_links_not_followed(tmp_path: Path) -> None:
    # Before: the folder was adopted and 20 of these 22 links were followed.
    victim = _victim(tmp_path)
    run_folder = tmp_path / "d0" / "run-t"
    _plant_tier_links(run_folder / "server-0", victim)
    run_folder.chmod(0o777)  # as a shared scratch folder's run folder, made by anyone
    with pytest.raises(TierError, match=rf"{KEY}: {run_folder} is writable by other users \(mode 777\)"):
        _train(tmp_path)
    assert victim.read_bytes() == VICTIM


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user takes root")
def test_a_run_folder_of_another_user_is_refused(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    run_folder = tmp_path / "d0" / "run-t"
    links = _plant_tier_links(run_folder / "server-0", victim)
    os.chown(run_folder, 65534, 65534)
    for link in links:
        os.lchown(link, 65534, 65534)
    with pytest.raises(TierError, match=rf"{run_folder} belongs to user 65534, not to this run's user 0"):
        _train(tmp_path)
    assert victim.read_bytes() == VICTIM


def test_a_link_in_place_of_a_run_folder_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (tmp_path / "d0").mkdir()
    (tmp_path / "d0" / "run-t").symlink_to(elsewhere)
    with pytest.raises(TierError, match=r"run-t is a symbolic link"):
        _train(tmp_path)
    assert not any(elsewhere.iterdir())


def test_links_left_in_the_runs_own_folder_are_never_followed(tmp_path: Path) -> None:
    """A private folder of this user's with links in it (an earlier run's, or planted
    before the folder's mode was tightened): a link at a temporary's name is replaced by
    a new file, one at a file's own name is refused naming it; no target is written."""
    victim = _victim(tmp_path)
    folder = tmp_path / "d0" / "run-t" / "server-0"
    _plant_tier_links(folder, victim)
    with pytest.raises(TierError, match=r"shard-000000.part-\d{5}.grad .*is a symbolic link or not a regular file"):
        _train(tmp_path)
    assert victim.read_bytes() == VICTIM


def test_weight_files_refuse_a_shared_run_folder_and_a_planted_link(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    run_folder = tmp_path / "w" / "run-w"
    (run_folder / "worker-0").mkdir(parents=True)
    (run_folder / "worker-0" / "unit-00001.weights").symlink_to(victim)
    run_folder.chmod(0o777)
    with pytest.raises(TierError, match=rf"worker.weights_nvme_path: {run_folder} is writable by other users"):
        WeightFiles(str(tmp_path / "w"), "run-w", 0, largest_bytes=64 << 10, total_bytes=1 << 20)
    run_folder.chmod(0o700)
    files = WeightFiles(str(tmp_path / "w"), "run-w", 0, largest_bytes=64 << 10, total_bytes=1 << 20)
    try:
        with pytest.raises(TierError, match=r"unit-00001.weights is a symbolic link or not a regular file"):
            files.write(1, torch.ones(1000, dtype=torch.bfloat16))
    finally:
        files.close()
    assert victim.read_bytes() == VICTIM


def test_new_folders_are_private_and_private_ones_adopted(tmp_path: Path) -> None:
    made = private_folders(str(tmp_path / "root"), "run", "server-0", key=KEY)
    assert made == str(tmp_path / "root" / "run" / "server-0")
    for folder in (tmp_path / "root" / "run", Path(made)):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    (tmp_path / "root" / "run").chmod(0o755)  # readable by others, writable by none: adopted
    assert private_folders(str(tmp_path / "root"), "run", "server-0", key=KEY) == made
    (tmp_path / "root" / "file").write_bytes(b"")
    with pytest.raises(TierError, match=r"file is not a directory"):
        private_folders(str(tmp_path / "root"), "file", key=KEY)


def test_files_are_opened_only_as_regular_files(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    (tmp_path / "link").symlink_to(victim)
    os.mkfifo(tmp_path / "fifo")
    for name in ("link", "fifo"):
        with pytest.raises(OSError, match=rf"{name} is a symbolic link or not a regular file"):
            create_file(str(tmp_path / name))
        with pytest.raises(OSError, match=rf"{name} is a symbolic link or not a regular file"):
            open_file(str(tmp_path / name))
    assert victim.read_bytes() == VICTIM
    fd = create_file(str(tmp_path / "new"))
    os.write(fd, b"x")
    os.close(fd)
    assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o600
