"""examples/ray_train.py: a Ray Train TorchTrainer (ScalingConfig, RunConfig) with two
workers whose loop uses OffloadedAdamW over their process group, checkpoints reported
through ray.train.report, gives the same weights as the same TorchTrainer with
torch.optim.AdamW(fused=True), bit for bit; and its reported optimizer state dict names
the servers' checkpoint."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.timeout(600), pytest.mark.integration]

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "ray_train.py"


def _script():
    spec = importlib.util.spec_from_file_location("ray_train_example", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # 45 s; the same optimizer under torchrun and the HF Trainer stays in the default run
def test_ray_train_with_offloaded_adamw_equals_torch_adamw_bitwise(ray_local, tmp_path: Path) -> None:
    script = _script()
    storage = tmp_path / "results"
    for name, extra in (("offloaded", []), ("reference", ["--reference"])):
        argv = ["--storage", str(storage), "--name", name, "--steps", "20", "--out", str(tmp_path / f"{name}.pt")]
        assert script.main(argv + extra) == 0
    offloaded, reference = torch.load(tmp_path / "offloaded.pt"), torch.load(tmp_path / "reference.pt")
    assert offloaded.keys() == reference.keys()
    for key, value in reference.items():
        assert torch.equal(offloaded[key], value), f"{key}: max diff {(offloaded[key] - value).abs().max():.3e}"
    servers_checkpoints = sorted(p.name for p in (storage / "offloaded" / "optimizer").iterdir())
    assert servers_checkpoints == ["step-0000000010", "step-0000000020"]
