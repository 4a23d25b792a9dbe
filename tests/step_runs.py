"""Helpers for the tests that run ``ShardedStep`` without Ray (tests/test_step.py,
tests/test_weights_nvme.py): W ranks spawned over gloo, each saving its results per
strategy, and the masters an in-process registry holds."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.multiprocessing as mp
from ports import free_port

from cargohold.services.core.layout import Layout
from cargohold.services.worker.state_port import LocalPort


def run_ranks(train_all: Callable[..., None], world: int, folder: str, names: Iterable[str]) -> dict[str, list[dict]]:
    """Spawn ``train_all(rank, world, port, folder)`` on ``world`` ranks; each strategy's
    results, as every rank saved them to ``<folder>/<name>/<rank>.pt``."""
    mp.start_processes(train_all, args=(world, free_port(), folder), nprocs=world, start_method="spawn", join=True)
    return {name: [torch.load(Path(folder) / name / f"{r}.pt") for r in range(world)] for name in names}


def registry_masters(port: LocalPort, layout: Layout, run_id: str = "run") -> torch.Tensor:
    """This rank's range of the fp32 masters the port's registry holds (zeros in padding)."""
    masters = torch.zeros(layout.worker_size)
    for state in port.registry.segments(run_id):
        segment = layout.segments[state.spec.segment_id]
        masters[segment.local_offset : segment.local_offset + segment.numel] = state.snapshot()["master"]
    return masters
