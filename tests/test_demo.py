"""The demo, as a user runs it: the `cargohold` console script in a subprocess, starting
its own in-process Ray cluster."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
CARGOHOLD = [sys.executable, "-m", "cargohold.cluster.cli"]


def _run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([*CARGOHOLD, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_demo_trains_and_loss_falls() -> None:
    result = _run("train", "--config", "examples/demo.yaml", "--set", "steps=8", "--set", "progress=false")
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"^step \d+ loss ([0-9.]+)", result.stdout, re.M)]
    assert len(losses) == 8
    assert losses[-1] < losses[0] - 0.3, losses
    assert re.search(r"run \S+: 8 steps, loss [0-9.]+ -> [0-9.]+", result.stdout)


def test_unplaceable_run_fails_with_a_clear_message() -> None:
    result = _run(
        "train",
        "--set",
        "steps=1",
        "--set",
        "worker.resources={no_such_accelerator: 1}",
        "--set",
        "cluster.startup_timeout_s=5",
        "--set",
        "model.n_layer=1",
        timeout=300,
    )
    assert result.returncode == 1
    assert "could not place" in result.stderr and "worker.cpus" in result.stderr


def test_bad_config_exits_2_naming_the_key() -> None:
    result = _run("train", "--set", "optim.lrr=1", timeout=120)
    assert result.returncode == 2
    assert "optim.lrr" in result.stderr
