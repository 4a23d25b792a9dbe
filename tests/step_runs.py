"""Helpers for the tests that run ``ShardedStep`` without Ray (tests/test_step.py,
tests/test_hf_families.py, tests/test_weights_nvme.py): W ranks spawned over gloo, each
training a config through the real worker step with the state servers' registry in its
own process (``LocalPort``) and saving its results per strategy; the state that registry
holds; and the bitwise comparison with the single-process reference."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ports import free_port
from reference import ReferenceResult

from cargohold.cluster.sections import config_task, model_spec, port_config
from cargohold.services.core.layout import Layout
from cargohold.services.data import dropout_seed
from cargohold.services.models.build import build_model, parameter_values
from cargohold.services.worker.device_port import LocalPort, SplitPort
from cargohold.services.worker.model_setup import exchange_buffers, sharded_model, step_policy
from cargohold.services.worker.param_groups import resolve_param_groups
from cargohold.services.worker.step import ShardedStep

STATES = {"master": "masters", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
"""Each state the registry holds, by the name :meth:`ReferenceResult.flat` gives it."""


def run_ranks(train_all: Callable[..., None], world: int, folder: str, names: Iterable[str]) -> dict[str, list[dict]]:
    """Spawn ``train_all(rank, world, port, folder)`` on ``world`` ranks; each strategy's
    results, as every rank saved them to ``<folder>/<name>/<rank>.pt``."""
    mp.start_processes(train_all, args=(world, free_port(), folder), nprocs=world, start_method="spawn", join=True)
    return {name: [torch.load(Path(folder) / name / f"{r}.pt") for r in range(world)] for name in names}


@contextmanager
def gloo_group(rank: int, world: int, port: int) -> Iterator[None]:
    """This spawned rank in a gloo process group on loopback, one torch thread (as the
    reference computes)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def train_in_process(rank: int, config, folder: Path) -> None:
    """Shard, register with an in-process registry, train ``config.steps`` steps, save this
    rank's losses, gradient norms, newest weights and the registry's state to
    ``<folder>/<rank>.pt``."""
    device = torch.device("cpu")
    model, units, layout = sharded_model(config_task(config), config.worker, config.state_server.num_servers, device)
    buffers = exchange_buffers(config.worker, config.push_dtype, layout)
    ports, groups = port_config(config), resolve_param_groups(config.optim, layout.params)
    port_: LocalPort | SplitPort = LocalPort(ports, "run", groups)
    if layout.device_segments(rank):  # the worker's own registry holds them, as an actor's does
        port_ = SplitPort(port_, LocalPort(ports, "run", groups))
    step = ShardedStep(
        model, units, layout, rank, port_, buffers, step_policy(config.optim, config.worker), device=device
    )
    with torch.device("meta"):
        shapes = build_model(model_spec(config), config.data)
    assert step.register(lambda names: parameter_values(model_spec(config), shapes, names)) == 0
    data = config_task(config).open_data()
    micros = range(config.data.micro_batches)
    losses, norms = [], []
    for number in range(1, config.steps + 1):
        batches = [data.batch(number, rank, micro) for micro in micros]
        seeds = [dropout_seed(config.seed, number, rank, micro) for micro in micros]
        report = step.run(number, batches, config.optim.lr_at(number, config.steps), dropout_seeds=seeds)
        losses.append(report.loss)
        norms.append(report.global_grad_norm)
    weights = step.newest_weights()
    step.close()
    states = registry_states(port_, layout)
    folder.mkdir(exist_ok=True)
    torch.save({"losses": losses, "norms": norms, "weights": weights, **states}, folder / f"{rank}.pt")


def registry_states(port: LocalPort | SplitPort, layout: Layout, run_id: str = "run") -> dict[str, torch.Tensor]:
    """This rank's range of each fp32 state the port's registries hold (``master``,
    ``exp_avg``, ``exp_avg_sq``; zeros in padding): the servers' and, split off, the
    worker's own for its device segments."""
    states = {key: torch.zeros(layout.worker_size) for key in STATES}
    registries = [port.servers.registry, port.device.registry] if isinstance(port, SplitPort) else [port.registry]
    for state in itertools.chain.from_iterable(registry.segments(run_id) for registry in registries):
        segment = layout.segments[state.spec.segment_id]
        snapshot = state.snapshot()
        for key, flat in states.items():
            flat[segment.local_offset : segment.local_offset + segment.numel] = snapshot[key]
    return states


def registry_masters(port: LocalPort, layout: Layout, run_id: str = "run") -> torch.Tensor:
    """This rank's range of the fp32 masters the port's registry holds (zeros in padding)."""
    return registry_states(port, layout, run_id)["master"]


def assert_matches_reference(name: str, ranks: list[dict], layout: Layout, reference: ReferenceResult) -> None:
    """The ranks' results (:func:`train_in_process`) bitwise the reference's: the losses,
    the registry's masters and AdamW moments, and the workers' newest weights (in their
    compute dtype: bf16 compute holds the masters rounded)."""
    assert ranks[0]["losses"] == reference.losses, (name, ranks[0]["losses"], reference.losses)
    for key, which in STATES.items():
        state = torch.cat([rank[key] for rank in ranks])
        expected = reference.flat(layout, which)
        assert torch.equal(state, expected), f"{name}: {key} max abs diff {(state - expected).abs().max():.3e}"
    weights = torch.cat([rank["weights"] for rank in ranks])
    assert torch.equal(weights, reference.flat(layout).to(weights.dtype)), name
