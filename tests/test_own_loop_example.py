"""examples/own_loop.py, a plain script with its own loop and OffloadedAdamW: it runs as a
script, its loss falls, and a run saved part-way and resumed prints what an uninterrupted
one prints."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "own_loop.py"


def losses(output: str) -> list[float]:
    return [float(line.split()[3]) for line in output.splitlines() if line.startswith("step ")]


def test_the_script_runs_and_learns(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--steps", "12", "--checkpoint-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    seen = losses(done.stdout)
    assert len(seen) == 12 and seen[-1] < 0.9 * seen[0]


def test_a_saved_run_resumes_as_if_uninterrupted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("own_loop", SCRIPT)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    saved, checkpoints = str(tmp_path / "run.pt"), str(tmp_path / "checkpoints")
    assert script.main(["--steps", "4", "--save", saved, "--checkpoint-dir", checkpoints]) == 0
    assert script.main(["--steps", "8", "--resume", saved, "--checkpoint-dir", checkpoints]) == 0
    resumed = capsys.readouterr().out
    assert script.main(["--steps", "8", "--servers", "2", "--checkpoint-dir", checkpoints]) == 0
    straight = capsys.readouterr().out
    assert [line for line in resumed.splitlines() if line.startswith("step ")] == straight.splitlines()[-8:]
    assert f"optimizer state in {checkpoints}/step-0000000004" in resumed
