"""Your own model, loss and data on cargohold's whole machinery with ``cargohold.Trainer``:
FSDP2 workers and state servers as Ray actors (a local cluster started in-process),
checkpoints, validation and the progress line, as ``cargohold train`` has them. A small
residual MLP learns a noisy function from a map-style dataset; on CPU it runs in seconds.

    python examples/own_model.py                                # 2 workers, 2 state servers
    python examples/own_model.py --steps 40 --checkpoint-dir runs/own/checkpoints --export runs/own/model
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import cargohold
from cargohold.cluster.schema.io import from_dict
from cargohold.cluster.schema.train import TrainConfig


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(self.fc(self.norm(x)))


class Net(nn.Module):
    """Its blocks in an ``nn.ModuleList``: each becomes one FSDP2 unit."""

    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(batch["x"]), batch["y"])


def dataset(count: int, seed: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(count, 8, generator=generator)
    y = torch.sin(x.sum(dim=1)) + 0.05 * torch.randn(count, generator=generator)
    return [{"x": a, "y": b.reshape(1)} for a, b in zip(x, y)]


def config(args: argparse.Namespace) -> TrainConfig:
    return from_dict(
        TrainConfig,
        {
            "steps": args.steps,
            "data": {"batch_size": 16},
            "optim": {"lr": 3e-3, "weight_decay": 0.01, "no_decay": "biases_and_norms", "warmup_steps": 2},
            "worker": {"num_workers": 2, "cpus": 1},
            "state_server": {"num_servers": 2, "cpus": 1},
            "checkpoint": {"dir": args.checkpoint_dir, "every_steps": 10 if args.checkpoint_dir else 0},
            "export_dir": args.export,
        },
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--checkpoint-dir", help="take a checkpoint every 10 steps here")
    parser.add_argument("--export", help="write the trained weights here (model.safetensors)")
    args = parser.parse_args()
    trainer = cargohold.Trainer(
        Net,
        loss_fn,
        dataset(2048, seed=0),
        config(args),
        eval_data=dataset(256, seed=1),
        eval_every_steps=10,
        on_checkpoint=lambda path: print(f"checkpoint {path}", flush=True),
        progress=False,  # one line per step, between the checkpoint lines, even in a terminal
    )
    result = trainer.fit()
    print(f"loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}, eval loss {result.evals[-1].loss:.4f}")


if __name__ == "__main__":
    main()
