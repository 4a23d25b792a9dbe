"""OffloadedAdamW over a process group (two gloo ranks, torch.multiprocessing): each rank
pushes and fetches about half of the state; a checkpoint saved by the two ranks and
loaded into fresh servers, by two ranks or by one process, continues the run bit for bit
as if uninterrupted. (examples/torchrun_loop.py, under torchrun, is checked against
torch.optim.AdamW(fused=True) in test_torchrun_example.py.)"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ports import free_port
from torch import nn

import cargohold
from cargohold.cluster.schema.server import StateServerConfig
from cargohold.groups import group_layout
from cargohold.ranks import Shares

pytestmark = [pytest.mark.timeout(240), pytest.mark.integration]

STEPS = 6


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 96), nn.GELU(), nn.Linear(96, 4))


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    """The same mean gradient on every rank (one batch, as DDP would average to)."""
    for step in steps:
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        nn.functional.mse_loss(model(x), torch.sin(x[:, :4])).backward()
        optimizer.step()
        optimizer.zero_grad()


def _optimizer(model: nn.Module, servers, group, folder: str) -> cargohold.OffloadedAdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return cargohold.OffloadedAdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=1e-2,
        model=model,
        servers=servers,
        checkpoint_dir=folder,
        process_group=group,
    )


def _rank(rank: int, world: int, port: int, folder: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for phase, steps in (("first", range(3)), ("resumed", range(3, STEPS))):
            started = (
                cargohold.start_state_servers(StateServerConfig(num_servers=2), in_process=True) if rank == 0 else None
            )
            model = _model()
            optimizer = _optimizer(model, cargohold.share_state_servers(started), dist.group.WORLD, folder)
            if phase == "resumed":
                optimizer.load_state_dict(torch.load(Path(folder) / "saved.pt", weights_only=False))
            _train(model, optimizer, steps)
            if phase == "first":
                saved = optimizer.state_dict()
                if rank == 0:
                    torch.save(saved, Path(folder) / "saved.pt")
            elif rank == 0:
                torch.save(model.state_dict(), Path(folder) / "resumed.pt")
            optimizer.close()
            dist.barrier()
            if started is not None:
                started.close()
    finally:
        dist.destroy_process_group()


def test_each_rank_handles_about_half_of_the_state() -> None:
    model = _model()
    layout = group_layout([[(n, tuple(p.shape)) for n, p in model.named_parameters()]], num_servers=2, ranks=2)
    shares = [sum(s.numel for s in layout.segments if Shares(ranks=2, rank=r).rank_of(s) == r) for r in range(2)]
    assert abs(shares[0] - shares[1]) <= 2 * 64 and sum(shares) == layout.total
    assert {Shares(ranks=2, rank=0).server(s) for s in layout.segments} == {0, 1}


def test_a_checkpoint_of_two_ranks_resumes_bitwise_on_two_ranks_and_in_one_process() -> None:
    with tempfile.TemporaryDirectory(prefix="cargohold-ranks-") as folder:
        mp.start_processes(_rank, args=(2, free_port(), folder), nprocs=2, start_method="spawn", join=True)
        resumed = torch.load(Path(folder) / "resumed.pt")
        with cargohold.start_state_servers(StateServerConfig(num_servers=1), in_process=True) as servers:
            model = _model()
            optimizer = _optimizer(model, servers, None, folder)
            optimizer.load_state_dict(torch.load(Path(folder) / "saved.pt", weights_only=False))
            _train(model, optimizer, range(3, STEPS))
            optimizer.close()
    straight = _model()
    reference = torch.optim.AdamW(
        [
            {"params": [p for p in straight.parameters() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in straight.parameters() if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=1e-2,
        fused=True,
    )
    _train(straight, reference, range(STEPS))
    for name, value in straight.state_dict().items():
        assert torch.equal(resumed[name], value), f"{name} after a resume on two ranks"
        assert torch.equal(model.state_dict()[name], value), f"{name} after a resume in one process"
