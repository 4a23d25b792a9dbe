"""examples/torchrun_loop.py under a real ``torchrun`` with two gloo ranks: each rank
pushes and fetches its share of OffloadedAdamW's segments on state servers rank 0
started, and the final weights equal the same loop's with torch.optim.AdamW(fused=True),
bit for bit; its loss falls."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.timeout(300), pytest.mark.integration]

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "torchrun_loop.py"


def _torchrun(tmp_path: Path, *args: str) -> tuple[str, dict[str, torch.Tensor]]:
    out = tmp_path / f"weights{len(list(tmp_path.glob('weights*')))}.pt"
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(SCRIPT)]
        + ["--steps", "12", "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout, torch.load(out)


def test_two_ranks_equal_torch_adamw_bitwise(tmp_path: Path) -> None:
    offloaded_out, offloaded = _torchrun(tmp_path)
    reference_out, reference = _torchrun(tmp_path, "--reference")
    assert offloaded.keys() == reference.keys()
    for name, value in reference.items():
        assert torch.equal(offloaded[name], value), f"{name}: max diff {(offloaded[name] - value).abs().max():.3e}"
    assert offloaded_out == reference_out
    losses = [float(line.split()[3]) for line in offloaded_out.splitlines() if line.startswith("step ")]
    assert len(losses) == 12 and losses[-1] < 0.9 * losses[0]
