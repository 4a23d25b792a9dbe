"""Your own training loop with ``cargohold.OffloadedAdamW``: a small MLP learns a fixed
random function, with two param groups (weight decay on the matrices only), a cosine
schedule, gradient accumulation and clipping. On CPU it runs in seconds.

    python examples/own_loop.py                              # state servers in this process
    python examples/own_loop.py --ray --servers 2            # ... as Ray actors
    python examples/own_loop.py --steps 20 --save run.pt     # a checkpoint after step 20,
    python examples/own_loop.py --steps 40 --resume run.pt   # then on to step 40
    torchrun --nproc_per_node=1 examples/own_loop.py         # one process: the loop is yours

The AdamW state lives on the state servers. ``--save`` has them write a checkpoint under
``--checkpoint-dir`` and writes a small file that points at it.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn

import cargohold
from cargohold.cluster.schema.server import StateServerConfig

MICRO_BATCHES = 2
PLANNED_STEPS = 100
"""The schedule's length: a run stopped early and resumed follows the same schedule."""


def batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of one micro-batch: a pure function of the step, so a resumed
    run sees what an uninterrupted one would."""
    gen = torch.Generator().manual_seed(step * MICRO_BATCHES + micro)
    x = torch.randn(32, 16, generator=gen)
    target = torch.sin(x @ torch.linspace(-1, 1, 16 * 4).view(16, 4))
    return x, target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--servers", type=int, default=1, help="state servers")
    parser.add_argument("--ray", action="store_true", help="start the state servers as Ray actors")
    parser.add_argument("--save", metavar="FILE", help="save model, optimizer and schedule at the end")
    parser.add_argument("--resume", metavar="FILE", help="continue from a --save file")
    parser.add_argument("--checkpoint-dir", default="runs/own_loop", help="where the servers write checkpoints")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))
    groups = [
        {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]
    config = StateServerConfig(num_servers=args.servers)
    with cargohold.start_state_servers(config, in_process=not args.ray) as servers:
        optimizer = cargohold.OffloadedAdamW(
            groups, lr=1e-2, model=model, servers=servers, checkpoint_dir=args.checkpoint_dir
        )
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=PLANNED_STEPS)
        first = 0
        if args.resume:
            saved = torch.load(args.resume, weights_only=False)
            optimizer.load_state_dict(saved["optimizer"])  # also sets the parameters
            scheduler.load_state_dict(saved["scheduler"])
            first = saved["step"]
        for step in range(first, args.steps):
            for micro in range(MICRO_BATCHES):
                x, target = batch(step, micro)
                loss = nn.functional.mse_loss(model(x), target)
                (loss / MICRO_BATCHES).backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            print(f"step {step + 1} loss {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.2e}", flush=True)
        if args.save:
            state = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "step": args.steps}
            torch.save(state, args.save)
            print(f"saved {args.save} (optimizer state in {state['optimizer']['checkpoint']})")
        optimizer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
