"""examples/hf_trainer.py: transformers.Trainer(optimizers=(OffloadedAdamW, scheduler)) on
a tiny Llama gives the same weights and losses as the same Trainer with
torch.optim.AdamW(fused=True), bit for bit, and its loss falls."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.timeout(300)

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "hf_trainer.py"


def _run(tmp_path: Path, *args: str) -> tuple[list[str], dict[str, torch.Tensor]]:
    out = tmp_path / f"weights{len(list(tmp_path.glob('weights*')))}.pt"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--steps", "10", "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return [line for line in done.stdout.splitlines() if line.startswith("step ")], torch.load(out)


def test_trainer_with_offloaded_adamw_equals_torch_adamw_bitwise(tmp_path: Path) -> None:
    offloaded_log, offloaded = _run(tmp_path)
    reference_log, reference = _run(tmp_path, "--reference")
    assert offloaded.keys() == reference.keys()
    for name, value in reference.items():
        assert torch.equal(offloaded[name], value), f"{name}: max diff {(offloaded[name] - value).abs().max():.3e}"
    assert offloaded_log == reference_log and len(offloaded_log) == 10
    losses = [float(line.split()[3]) for line in offloaded_log]
    assert losses[-1] < 0.8 * losses[0]
