"""A user's own model, loss and data for the Trainer's tests: a small residual MLP (its
blocks in an ``nn.ModuleList``), a regression loss, and the same items as a map-style
dataset, an iterable dataset and a batch function. Tests ship this module to the Ray
workers by value (as Ray does for a script's ``__main__``)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import IterableDataset

WIDTH, INPUTS, OUTPUTS, ITEMS = 32, 12, 3, 96


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(self.fc(self.norm(x)))


class Regressor(nn.Module):
    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(INPUTS, WIDTH)
        self.layers = nn.ModuleList(Block() for _ in range(depth))
        self.out = nn.Linear(WIDTH, OUTPUTS)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, OUTPUTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(h) * self.scale


def regression_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(batch["x"]), batch["y"])


def items(count: int = ITEMS, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    xs = torch.randn(count, INPUTS, generator=generator)
    ys = torch.sin(xs[:, :OUTPUTS] * 2) + 0.1 * torch.randn(count, OUTPUTS, generator=generator)
    return [{"x": x, "y": y} for x, y in zip(xs, ys)]


class Stream(IterableDataset):
    """The items of :func:`items`, in order, each time it is iterated."""

    def __init__(self, count: int = ITEMS) -> None:
        self.count = count

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return iter(items(self.count))


def batch_function(step: int, rank: int, micro: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(step * 1000 + rank * 10 + micro)
    x = torch.randn(4, INPUTS, generator=generator)
    return {"x": x, "y": torch.cos(x[:, :OUTPUTS])}
