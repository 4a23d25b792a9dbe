"""Issue 40, the configuration's edges found from outside: each bad input is refused
before the run starts (a ConfigError: exit status 2 from ``cargohold``, naming the input)
and loses nothing already saved.

Row 5: a folder inside (or around) a folder a live run has claimed. Real claims: the
live run's is held by a child process. Row 6: a host budget larger than the machine.
Row 10: input nested too deeply to parse, a pickle-only model folder. Row 11: a bad
``worker.weights_nvme_path``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from plans import nvme_tier
from reference import tiny_config
from system import mounted_tmpfs

from cargohold.cluster import cli
from cargohold.cluster.claims import claimed_folders
from cargohold.cluster.launcher import TrainingSession
from cargohold.cluster.schema.run import CheckpointConfig
from cargohold.cluster.schema.train import TrainConfig
from cargohold.services.core.errors import ConfigError

pytestmark = pytest.mark.timeout(120)

HOLD = """
import sys
from pathlib import Path
from cargohold.cluster.claims import FolderClaim
claim = FolderClaim(Path(sys.argv[1]), "checkpoint.dir")
print("held", flush=True)
sys.stdin.read()
claim.release()
"""


@pytest.fixture
def live_run(tmp_path: Path) -> Iterator[Path]:
    """A live run's ``checkpoint.dir`` with one checkpoint in it, claimed by another
    process until the test ends."""
    folder = tmp_path / "live" / "checkpoints"
    step = folder / "step-0000000002"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text("{}")
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(folder)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "held\n"
        yield folder
    finally:
        child.communicate("", timeout=60)


def _config(checkpoints: Path | None = None, export: Path | None = None) -> TrainConfig:
    return TrainConfig(
        export_dir=str(export) if export else None,
        checkpoint=CheckpointConfig(dir=str(checkpoints) if checkpoints else None),
    )


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_a_folder_inside_or_around_a_live_runs_claimed_folder_is_refused(live_run: Path, tmp_path: Path) -> None:
    """Row 5: an export (or checkpoints) inside a live run's newest step folder was
    accepted, and that run's pruning later deleted it; a folder holding a live run's was
    accepted too. Both are refused naming both folders, creating and deleting nothing;
    a folder beside it is fine, and once the live run ends the nested one is too."""
    before = _files(live_run.parent)
    inside = live_run / "step-0000000002" / "export"
    for config, key in ((_config(export=inside), "export_dir"), (_config(checkpoints=inside), "checkpoint.dir")):
        with pytest.raises(ConfigError) as refused, claimed_folders(config):
            pass
        message = str(refused.value)
        assert message.startswith(f"{key} {str(inside)!r} lies inside {str(live_run)!r}"), message
        assert "another live run" in message
    around = tmp_path / "live"
    with pytest.raises(ConfigError) as refused, claimed_folders(_config(checkpoints=around)):
        pass
    message = str(refused.value)
    assert message.startswith(f"checkpoint.dir {str(around)!r} contains {str(live_run)!r}"), message
    assert "another live run" in message
    with pytest.raises(ConfigError, match="is in use by another live run"), claimed_folders(_config(export=live_run)):
        pass
    assert _files(live_run.parent) == before
    with claimed_folders(_config(checkpoints=tmp_path / "beside", export=tmp_path / "export")):
        pass


def test_a_claim_ends_with_its_run(tmp_path: Path) -> None:
    """What the live run held is free again once it ends: the nested claim is taken."""
    folder = tmp_path / "checkpoints"
    subprocess.run([sys.executable, "-c", HOLD, str(folder)], input="", text=True, check=True, capture_output=True)
    with claimed_folders(_config(checkpoints=folder / "inner", export=tmp_path / "export")):
        assert (folder / "inner").is_dir()
    assert not (folder / "inner").exists()


# --- row 6: a host budget larger than the machine -----------------------------------------

HUGE = 10**30


def test_a_host_budget_beyond_this_machines_memory_is_refused_before_ray(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Row 6: ``cluster.host_memory_bytes=10**30`` was accepted and became a RAM tier of
    ~10**30 bytes. A run that starts its Ray on this machine is refused before Ray starts
    naming the key, the value and the machine's memory; ``cargohold plan`` says it does
    not fit the nodes it is told of."""
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    config = tiny_config(cluster__host_memory_bytes=HUGE)
    with pytest.raises(ConfigError) as refused:
        TrainingSession(config)
    message = str(refused.value)
    assert f"cluster.host_memory_bytes={HUGE}" in message and f"this machine has: {memory}" in message, message
    assert not ray.is_initialized()
    assert cli.main(["train", "--set", f"cluster.host_memory_bytes={HUGE}", "--set", "steps=1"]) == 2
    assert f"cluster.host_memory_bytes={HUGE}" in capsys.readouterr().err
    assert not ray.is_initialized()
    assert cli.main(["plan", "--set", f"cluster.host_memory_bytes={HUGE}", "--host-memory", "16GiB"]) == 3
    out = capsys.readouterr().out
    assert "DOES NOT FIT  host budget (cluster.host_memory_bytes) against the nodes' RAM" in out, out
    # A budget the machine holds is the run's to split, as before.
    assert TrainingSession(tiny_config(cluster__host_memory_bytes=memory // 2)).config.cluster.host_memory_bytes


# --- row 10: input nested past any parser's depth, a pickle-only model folder -------------

DEEP = 10**5


def _nested(depth: int = DEEP) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("command", ["train", "plan"])
def test_deeply_nested_config_input_exits_2_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """Row 10: a config file, a ``--set`` value or a ``plan --cluster`` file nested 10**5
    deep gave a RecursionError traceback (exit 1). Each exits 2 naming the input."""
    config_file = tmp_path / "run.yaml"
    config_file.write_text(f"steps: {_nested()}\n")
    assert cli.main([command, "--config", str(config_file)]) == 2
    err = capsys.readouterr().err
    assert f"config file {config_file} is nested too deeply" in err, err
    assert cli.main([command, "--set", f"optim.lr={_nested()}"]) == 2
    err = capsys.readouterr().err
    assert "override 'optim.lr=[[[[" in err and "is nested too deeply" in err, err
    assert len(err) < 1000  # the value is not echoed whole
    if command == "plan":
        cluster_file = tmp_path / "cluster.yaml"
        cluster_file.write_text(f"nodes: {_nested()}\n")
        assert cli.main(["plan", "--cluster", str(cluster_file)]) == 2
        err = capsys.readouterr().err
        assert f"cluster file {cluster_file} is nested too deeply" in err, err
    assert not ray.is_initialized()


PICKLE_RUNS = "ran-the-pickle"


class _Planted:
    """What a pickle-only model file holds: code run when the file is unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def _tiny_gpt2(folder: Path) -> Path:
    transformers = pytest.importorskip("transformers")
    transformers.GPT2Config(
        vocab_size=300, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
    ).save_pretrained(folder)
    return folder


def test_a_pickle_only_model_folder_exits_2_before_ray(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Row 10: an hf checkpoint folder holding only ``pytorch_model.bin`` gave an
    UnpicklingError traceback where the model was built with its weights, and was refused
    only once Ray had started. It is refused before anything reads it (exit 2, the folder
    and the file named), and nothing in it runs."""
    import pickle

    from cargohold.cluster.schema.model import HFModelConfig
    from cargohold.services.models.hf import build_hf_model

    folder = _tiny_gpt2(tmp_path / "pickled")
    marker = tmp_path / PICKLE_RUNS
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(_Planted(marker)))
    with pytest.raises(ConfigError) as refused:
        build_hf_model(HFModelConfig(checkpoint_dir=str(folder)))
    assert f"hf.checkpoint_dir={str(folder)!r}" in str(refused.value) and "pytorch_model.bin" in str(refused.value)
    for command in ("plan", "train"):
        assert cli.main([command, "--set", f"hf.checkpoint_dir={folder}", "--set", "steps=1"]) == 2
        err = capsys.readouterr().err
        assert str(folder) in err and "pytorch_model.bin" in err and "safetensors" in err, err
    assert not ray.is_initialized()
    assert not marker.exists()


def test_a_model_config_nested_too_deeply_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Row 10: a model folder's config.json nested 10**5 deep gave a RecursionError
    traceback; it exits 2 naming the file."""
    folder = _tiny_gpt2(tmp_path / "deep")
    (folder / "config.json").write_text('{"model_type": "gpt2", "x": ' + _nested() + "}")
    assert cli.main(["plan", "--set", f"hf.config_path={folder}"]) == 2
    err = capsys.readouterr().err
    assert f"{folder / 'config.json'} is nested too deeply" in err, err


# --- row 11: worker.weights_nvme_path checked before Ray --------------------------------------


def _weights_cases(tmp_path: Path) -> Iterator[tuple[dict[str, object], str]]:
    """(config overrides, what the refusal says) for each bad ``worker.weights_nvme_path``."""
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    yield {"worker__weights_nvme_path": str(a_file)}, f"worker.weights_nvme_path {str(a_file)!r} cannot be a folder"
    yield {"worker__weights_nvme_path": "/proc/self"}, "worker.weights_nvme_path: cannot write and read /proc/self"
    shared = str(tmp_path / "shared")
    yield (
        {"worker__weights_nvme_path": shared, "checkpoint__dir": shared},
        f"checkpoint.dir {shared!r} and worker.weights_nvme_path {shared!r} overlap",
    )
    tier = nvme_tier(tmp_path)
    yield (
        {"worker__weights_nvme_path": tier["nvme_paths"][1], "state_server__tier": tier},
        f"state_server.tier.nvme_paths[1] {tier['nvme_paths'][1]!r} and worker.weights_nvme_path",
    )
    yield (
        {"worker__weights_nvme_path": str(tmp_path / "export" / "weights"), "export_dir": str(tmp_path / "export")},
        "export_dir",
    )


def test_a_bad_weights_nvme_path_is_refused_before_ray(tmp_path: Path) -> None:
    """Row 11: ``worker.weights_nvme_path`` that is a file, ``/proc/self``, or one of the
    run's other folders (or inside one) was accepted and failed only when the workers
    started (after Ray, exit 1). Each is refused before Ray, naming the key."""
    for overrides, said in _weights_cases(tmp_path):
        with pytest.raises(ConfigError) as refused:
            TrainingSession(tiny_config(**overrides))
        assert said in str(refused.value), (overrides, str(refused.value))
        assert "worker.weights_nvme_path" in str(refused.value)
    assert not ray.is_initialized()


def test_a_read_only_weights_nvme_path_exits_2_before_ray(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Row 11 from the command line: a folder on a read-only filesystem exits 2."""
    with mounted_tmpfs(tmp_path / "ro", "1m", read_only=True) as read_only:
        assert cli.main(["train", "--set", f"worker.weights_nvme_path={read_only}", "--set", "steps=1"]) == 2
    err = capsys.readouterr().err
    assert f"worker.weights_nvme_path: cannot write and read {read_only}: Read-only file system" in err, err
    assert not ray.is_initialized()


# --- last: the module's Ray cluster stays up until its end ---------------------------------


def test_a_host_budget_beyond_a_joined_clusters_memory_is_refused(ray_local) -> None:
    """Row 6 on a Ray cluster the run joins: the budget is compared with the memory its
    nodes have, as Ray reports it, before any actor starts."""
    session = TrainingSession(tiny_config(cluster__host_memory_bytes=HUGE))
    with pytest.raises(ConfigError, match=r"cluster.host_memory_bytes=10{30} .* more than the Ray cluster"):
        session.start()
    assert not ray.util.list_named_actors()
