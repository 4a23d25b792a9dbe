"""The correctness contract on a GPU: a CUDA worker (FSDP2 over NCCL) with its state
servers on the same node, through the page-locked shared-memory path and over the
network path, equals plain torch.optim.AdamW(fused=True) on the CPU masters, bitwise,
with forward and backward on the same GPU. Runs where CUDA is (make gpu-check)."""

from __future__ import annotations

import pytest
import torch
from reference import reference_train, tiny_config
from test_training_contract import _assert_matches_reference, _run

pytestmark = [pytest.mark.gpu, pytest.mark.integration]
NVME = "<a folder of the test's own>"

CASES = {
    "fp32-shared-memory": dict(state_server__num_servers=2),
    "fp32-network": dict(state_server__num_servers=2, worker__shared_memory="off"),
    "bf16-shared-memory-offload-params": dict(worker__compute_dtype="bfloat16", worker__offload_params=True),
    "bf16-delayed-update": dict(worker__compute_dtype="bfloat16", worker__delayed_update=True),
    # fp16 with a scale the first steps overflow at (issue 25): GradScaler's skips and growth.
    "fp16-dynamic-loss-scale": dict(
        worker__compute_dtype="float16",
        worker__grad_wire_dtype="float16",
        optim__loss_scale__init_scale=2.0**18,
        optim__loss_scale__growth_interval=2,
    ),
    # Weights on NVMe: FSDP2 pins the chunks (fixed-size storages), the window frees and
    # reads them between gathers (issue 23).
    "bf16-weights-on-nvme": dict(
        worker__compute_dtype="bfloat16", worker__weights_nvme_path=NVME, worker__weight_window=2
    ),
}


@pytest.mark.parametrize("overrides", CASES.values(), ids=CASES.keys())
def test_a_cuda_worker_matches_torch_adamw_bitwise(ray_local, tmp_path, overrides: dict) -> None:
    overrides = {k: str(tmp_path) if v == NVME else v for k, v in overrides.items()}
    # One GPU, one worker: NCCL refuses two ranks on one device.
    config = tiny_config(steps=8, worker__num_workers=1, worker__gpus=1, **overrides)
    layout, losses, weights, server = _run(config)
    torch.cuda.synchronize()
    _assert_matches_reference(
        config, layout, losses, weights, server, reference_train(config, config.steps, device="cuda")
    )


def test_half_the_optimizer_on_the_gpu_stays_within_rounding_of_torch_adamw(ray_local) -> None:
    """Half of each unit's state on the GPU (``worker.optimizer_on_device_fraction``),
    updated there by torch's fused CUDA AdamW kernel: it rounds otherwise than the CPU
    kernel the reference steps with (on CPU workers the same run is bitwise,
    tests/test_device_fraction.py), so this holds it to a stated tolerance: losses within
    1e-5 relative, master weights and moments within 1e-5 absolute after 8 steps."""
    config = tiny_config(
        steps=8,
        worker__num_workers=1,
        worker__gpus=1,
        state_server__num_servers=2,
        worker__optimizer_on_device_fraction=0.5,
    )
    layout, losses, _, server = _run(config)
    torch.cuda.synchronize()
    reference = reference_train(config, config.steps, device="cuda")
    assert losses == pytest.approx(reference.losses, rel=1e-5)
    for key, which in (("master", "masters"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
        difference = (server[key] - reference.flat(layout, which)).abs().max().item()
        assert difference < 1e-5, f"{key} differs by {difference:.3e}"
