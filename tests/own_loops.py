"""A user's own training loop, the same code stepped by cargohold's OffloadedAdamW and by
``torch.optim.AdamW(fused=True)``: a tiny MLP, two param groups (decay with the base lr,
no decay with a third of it), a LambdaLR warm-up then decay, two micro-batches per step
and the user's own ``clip_grad_norm_``. Used by the ``test_offloaded_adamw*`` modules."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from cargohold import OffloadedAdamW, StateServers, start_state_servers
from cargohold.cluster.schema.server import StateServerConfig

LR = 3e-3
MICRO_BATCHES = 2
STEPS = 6


class TinyMLP(nn.Module):
    """1,468 parameters: fc1.weight (1,001) is cut by the boundary of two servers."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = nn.Linear(13, 77)
        self.fc2 = nn.Linear(77, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def param_groups(model: nn.Module) -> list[dict]:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": LR / 3}]


def schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: min(1.0, (k + 1) / 3) / (1 + 0.2 * k))


def micro_batch(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + index)
    return torch.randn(4, 13, generator=gen), torch.randn(4, 5, generator=gen)


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    steps: range,
) -> None:
    """The user's loop: accumulate, clip, step, zero, schedule."""
    for step in steps:
        for index in range(MICRO_BATCHES):
            x, y = micro_batch(step, index)
            (nn.functional.mse_loss(model(x), y) / MICRO_BATCHES).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()


def reference(steps: int = STEPS) -> TinyMLP:
    """The loop with ``torch.optim.AdamW(fused=True)``."""
    model = TinyMLP()
    optimizer = torch.optim.AdamW(param_groups(model), lr=LR, fused=True)
    train(model, optimizer, schedule(optimizer), range(steps))
    return model


@contextmanager
def local_servers(num_servers: int) -> Iterator[StateServers]:
    """Real state servers (gRPC on 127.0.0.1) in this process."""
    with start_state_servers(StateServerConfig(num_servers=num_servers), in_process=True) as servers:
        yield servers


def offloaded(model: nn.Module, servers: StateServers, checkpoint_dir: Path | None = None) -> OffloadedAdamW:
    return OffloadedAdamW(param_groups(model), lr=LR, model=model, servers=servers, checkpoint_dir=checkpoint_dir)


def assert_same_bits(actual: nn.Module, expected: nn.Module) -> None:
    for (name, a), b in zip(actual.named_parameters(), expected.parameters(), strict=True):
        differ = (a.detach().view(torch.int32) != b.detach().view(torch.int32)).sum().item()
        assert differ == 0, f"{name}: {differ} of {a.numel()} elements differ"
