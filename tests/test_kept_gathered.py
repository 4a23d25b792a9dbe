"""``tuning.worker.kept_gathered_units``: with ZeRO-3 resharding, the last units stay gathered
from their forward to their backward (FSDP2 skips their backward all-gather); the others
are freed after their forward and gathered again. The training contract (bitwise equal to
AdamW) covers every count in tests/test_training_contract.py and tests/test_weights_nvme.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ports import free_port
from reference import tiny_config

from cargohold.cluster.sections import config_task
from cargohold.services.worker.model_setup import sharded_model
from cargohold.services.worker.sharding import backward_gathered_units

LAYERS = 4


def test_the_last_units_are_kept_and_the_root_never_regathered() -> None:
    units = 1 + LAYERS  # the root and four blocks
    assert list(backward_gathered_units(units, True, 0)) == [1, 2, 3, 4]
    assert list(backward_gathered_units(units, True, 1)) == [1, 2, 3]
    assert list(backward_gathered_units(units, True, 3)) == [1]
    assert list(backward_gathered_units(units, True, 9)) == []
    assert list(backward_gathered_units(units, False, 0)) == []


def _states(rank: int, port: int, out: Path) -> None:
    """Each unit's FSDP2 state after a forward and after the backward, per kept count."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        states = {}
        for kept in (0, 1, 2):
            config = tiny_config(model__n_layer=LAYERS, worker__kept_gathered_units=kept)
            model, units, _ = sharded_model(
                config_task(config), config.worker, config.state_server.num_servers, torch.device("cpu")
            )
            for parameter in model.parameters():
                torch.nn.init.normal_(parameter.to_local(), std=0.02)
            x = torch.randint(0, 256, (2, 16))
            loss = model(x, x)[1]
            fsdp_param_groups = [u.module._get_fsdp_state()._fsdp_param_group for u in units]
            after_forward = [g.is_unsharded for g in fsdp_param_groups]
            loss.backward()
            after_backward = [g.is_unsharded for g in fsdp_param_groups]
            states[kept] = after_forward, after_backward
            del model, units, fsdp_param_groups, loss
        torch.save(states, out / f"rank{rank}.pt")
        dist.barrier()  # neither rank tears gloo down while the other still uses it
    finally:
        dist.destroy_process_group()


@pytest.mark.integration
def test_fsdp2_keeps_the_last_units_gathered_until_their_backward(tmp_path: Path) -> None:
    mp.start_processes(_states, args=(free_port(), tmp_path), nprocs=2, start_method="spawn", join=True)
    for rank in range(2):
        states = torch.load(tmp_path / f"rank{rank}.pt")
        # After forward: the root and the kept blocks gathered, the others freed.
        assert states[0][0] == [True, False, False, False, False]
        assert states[1][0] == [True, False, False, False, True]
        assert states[2][0] == [True, False, False, True, True]
        for kept in (0, 1, 2):  # after backward every unit is freed
            assert states[kept][1] == [False] * (1 + LAYERS), kept
