"""examples/own_model.py, a user's model, loss and dataset on ``cargohold.Trainer``: it runs
as a script on a local Ray cluster, its loss falls, it validates, takes checkpoints (the
callback sees each) and exports weights that load into the user's own model."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

# slow: tests/test_trainer.py covers the Python API's training, validation, checkpoints and
# export in the default run.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "own_model.py"


def test_the_script_trains_validates_checkpoints_and_exports(tmp_path: Path) -> None:
    checkpoints, export = tmp_path / "ckpt", tmp_path / "model"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--steps", "20", "--checkpoint-dir", str(checkpoints), "--export", str(export)],
        capture_output=True,
        text=True,
        timeout=170,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    losses = [float(line.split()[3]) for line in lines if line.startswith("step ")]
    assert len(losses) == 20 and losses[-1] < 0.8 * losses[0]
    assert [line.split()[2] for line in lines if line.startswith("eval step")] == ["10", "20"]
    assert [line for line in lines if line.startswith("checkpoint ")] == [
        f"checkpoint {checkpoints / 'step-0000000010'}",
        f"checkpoint {checkpoints / 'step-0000000020'}",
    ]
    spec = importlib.util.spec_from_file_location("own_model", SCRIPT)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    model = script.Net()
    missing, unexpected = model.load_state_dict(load_file(str(export / "model.safetensors")), strict=False)
    assert not missing and not unexpected
    with torch.no_grad():
        held_out = torch.utils.data.default_collate(script.dataset(256, seed=1))
        assert float(script.loss_fn(model, held_out)) < losses[0]
