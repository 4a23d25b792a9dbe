"""Ray Train with ``cargohold.OffloadedAdamW``: a ``TorchTrainer`` with ``ScalingConfig``
and ``RunConfig`` runs the loop on W workers (DDP over gloo on CPU); rank 0 starts the
state servers, every rank pushes and fetches 1/W of AdamW's state, and checkpoints go
through ``ray.train.report`` (the model's weights and the optimizer's small state dict,
which names the servers' own checkpoint under ``<storage>/<name>/optimizer``).

    python examples/ray_train.py --storage /tmp/ray-results
    python examples/ray_train.py --storage /tmp/ray-results --reference   # torch's AdamW(fused)

The two report the same weights, bit for bit (``--out`` saves the last checkpoint's).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from torch import nn

import cargohold

STATE = "state.pt"
"""The file of a reported checkpoint: model weights, optimizer state dict, step."""


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s inputs and targets at ``step``: a pure function of the two."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(32, 16, generator=gen)
    return x, torch.sin(x @ torch.linspace(-1, 1, 16 * 4).view(16, 4))


def train_loop(config: dict[str, Any]) -> None:
    """What each Ray Train worker runs."""
    rank = ray.train.get_context().get_world_rank()
    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4)))
    params = list(model.module.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    started = None
    optimizer: torch.optim.Optimizer
    if config["reference"]:
        optimizer = torch.optim.AdamW(groups, lr=1e-2, fused=True)
    else:
        started = cargohold.start_state_servers(in_process=True) if rank == 0 else None
        optimizer = cargohold.OffloadedAdamW(
            groups,
            lr=1e-2,
            model=model.module,
            servers=cargohold.share_state_servers(started),
            checkpoint_dir=config["optimizer_dir"],
            process_group=dist.group.WORLD,
        )
    steps = config["steps"]
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    for step in range(1, steps + 1):
        x, target = batch(step, rank)
        loss = nn.functional.mse_loss(model(x), target)
        loss.backward()  # DDP: every rank gets the mean gradient
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        if step % config["report_every"] and step != steps:
            continue
        saved = optimizer.state_dict()  # every rank: rank 0 has the servers write theirs
        with tempfile.TemporaryDirectory() as folder:
            checkpoint = None
            if rank == 0:
                state = {"model": model.module.state_dict(), "optimizer": saved, "step": step}
                torch.save(state, Path(folder) / STATE)
                checkpoint = ray.train.Checkpoint.from_directory(folder)
            ray.train.report({"loss": loss.item(), "step": step}, checkpoint=checkpoint)
    if isinstance(optimizer, cargohold.OffloadedAdamW):
        optimizer.close()
    dist.barrier()  # every rank is done with the servers before rank 0 stops them
    if started is not None:
        started.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--storage", required=True, help="RunConfig.storage_path (an absolute folder)")
    parser.add_argument("--name", default="offloaded-adamw", help="RunConfig.name")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--reference", action="store_true", help="torch.optim.AdamW(fused=True) instead")
    parser.add_argument("--out", help="save the last reported checkpoint's weights here")
    args = parser.parse_args(argv)
    storage = Path(args.storage).absolute()
    trainer = ray.train.torch.TorchTrainer(
        train_loop,
        train_loop_config={
            "steps": args.steps,
            "report_every": 10,
            "reference": args.reference,
            "optimizer_dir": str(storage / args.name / "optimizer"),
        },
        scaling_config=ray.train.ScalingConfig(num_workers=args.workers, use_gpu=False),
        run_config=ray.train.RunConfig(name=args.name, storage_path=str(storage)),
    )
    result = trainer.fit()
    assert result.checkpoint is not None  # the last step always reports one
    with result.checkpoint.as_directory() as folder:
        state = torch.load(Path(folder) / STATE, weights_only=False)
    print(f"step {state['step']} loss {result.metrics['loss']:.4f}", flush=True)
    if args.out:
        torch.save(state["model"], args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
