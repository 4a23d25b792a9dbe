"""Your own loop on several ranks, launched by ``torchrun``: DDP averages the gradients,
``cargohold.OffloadedAdamW`` keeps AdamW's state on state servers that rank 0 starts, and
each rank pushes and fetches its share of it (the others' weights arrive by broadcast).
A small MLP learns a fixed random function on CPU (gloo), each rank on its own batches.

    torchrun --standalone --nproc_per_node=2 examples/torchrun_loop.py
    torchrun --standalone --nproc_per_node=2 examples/torchrun_loop.py --reference
    torchrun --standalone --nproc_per_node=2 examples/torchrun_loop.py --out weights.pt

``--reference`` runs the same loop with ``torch.optim.AdamW(fused=True)``: its weights
are the same, bit for bit (``--out`` has rank 0 save them).
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import cargohold
from cargohold.cluster.schema.server import StateServerConfig


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s inputs and targets at ``step``: a pure function of the two."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(32, 16, generator=gen)
    return x, torch.sin(x @ torch.linspace(-1, 1, 16 * 4).view(16, 4))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--servers", type=int, default=2, help="state servers, started by rank 0")
    parser.add_argument("--reference", action="store_true", help="torch.optim.AdamW(fused=True) instead")
    parser.add_argument("--out", help="rank 0 saves the final weights here")
    args = parser.parse_args(argv)

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4)))
    params = list(model.module.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    started = None
    optimizer: torch.optim.Optimizer
    if args.reference:
        optimizer = torch.optim.AdamW(groups, lr=1e-2, fused=True)
    else:
        if rank == 0:
            started = cargohold.start_state_servers(StateServerConfig(num_servers=args.servers), in_process=True)
        servers = cargohold.share_state_servers(started)
        optimizer = cargohold.OffloadedAdamW(
            groups, lr=1e-2, model=model.module, servers=servers, process_group=dist.group.WORLD
        )
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    for step in range(args.steps):
        x, target = batch(step, rank)
        loss = nn.functional.mse_loss(model(x), target)
        loss.backward()  # DDP: every rank gets the mean gradient
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        if rank == 0:
            print(f"step {step + 1} loss {loss.item():.4f}", flush=True)
    if rank == 0 and args.out:
        torch.save(model.module.state_dict(), args.out)
    if isinstance(optimizer, cargohold.OffloadedAdamW):
        optimizer.close()
    dist.barrier()  # every rank is done with the servers before rank 0 stops them
    if started is not None:
        started.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
