"""``capacity.py --trace-step``: one worker's step without Ray or a state server, phase by
phase, with the worker's own code (FSDP2 over gloo, ``ShardedStep``) and a port that drops
pushes; VmHWM and RSS after each phase."""

from __future__ import annotations

import os

import torch
from capacity import BLOCK, cargohold_overrides, params_of
from process_memory import peak_rss, read_text

from cargohold.services.core.layout import Segment
from cargohold.services.core.update_call import CommitTerms


class NullPort:
    """A StatePort with no state server: pushes are dropped, fetches leave the buffer."""

    def register(self, segment: Segment, initial: torch.Tensor) -> int:
        return 0

    def update(
        self,
        segment: Segment,
        update: int,
        *,
        gradient: torch.Tensor | None,
        terms: CommitTerms | None,
        out: torch.Tensor | None = None,
    ) -> bool:
        return True

    def fetch(self, segment: Segment, update: int, out: torch.Tensor) -> None:
        pass


def trace_rank(rank: int, world: int, port: int, n_layer: int, width: int, wire: str, steps: int) -> None:
    """One rank of ``--trace-step`` (a spawned process): the worker's own code path, FSDP2
    over gloo and ``ShardedStep``, with a :class:`NullPort`; VmHWM and VmRSS after each
    phase, the peak reset in between (``/proc/self/clear_refs``)."""
    import torch.distributed as dist

    from cargohold.cluster.schema.io import load_config
    from cargohold.cluster.sections import config_task, model_spec
    from cargohold.services.data import batch_for_step, load_tokens
    from cargohold.services.data.batches import Batch
    from cargohold.services.models.build import build_model, parameter_values
    from cargohold.services.worker.model_setup import exchange_buffers, sharded_model, step_policy
    from cargohold.services.worker.step import ShardedStep

    torch.set_num_threads(1)
    lines = []

    def mark(phase: str) -> None:
        status = read_text("/proc/self/status")
        peak, rss = peak_rss(status) / 2**30, peak_rss(status, "VmRSS") / 2**30
        lines.append(f"  {phase:28} peak {peak:5.2f} GiB, RSS {rss:5.2f}")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    mark("start")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    config = load_config(None, cargohold_overrides(n_layer, width, world, "bfloat16", wire))
    cpu = torch.device("cpu")
    model, units, layout = sharded_model(config_task(config), config.worker, config.state_server.num_servers, cpu)
    mark("sharded_model")
    buffers = exchange_buffers(config.worker, config.push_dtype, layout)
    step = ShardedStep(
        model, units, layout, rank, NullPort(), buffers, step_policy(config.optim, config.worker), device=cpu
    )
    mark("exchange buffers, ShardedStep")
    with torch.device("meta"):
        shapes = build_model(model_spec(config), config.data)
    step.register(lambda names: parameter_values(model_spec(config), shapes, names))
    mark("register")
    tokens = load_tokens(None, config.data.corpus_bytes, 0, seq_len=BLOCK)
    for number in range(1, steps + 1):
        x, y = batch_for_step(tokens, step=number, rank=rank, world_size=world, batch_size=1, seq_len=BLOCK, seed=0)
        step.run(number, [Batch(x, y)], 1e-4)
        mark(f"step {number}")
    step.close()
    dist.destroy_process_group()
    if rank == 0:
        weights = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
        print(
            f"rank 0 of {world}, {params_of(n_layer, width) / 1e6:.1f}M parameters, wire {wire}: FSDP2 shards "
            f"{weights / 2**30:.2f} GiB, exchange buffers {buffers.nbytes / 2**30:.2f} GiB (the weights halves never "
            f"touched: the null port fetches nothing); {os.environ.get('MALLOC_MMAP_THRESHOLD_', 'default')} mmap "
            "threshold",
            flush=True,
        )
        print("\n".join(lines), flush=True)


def trace_step(n_layer: int, width: int, workers: int, wire: str, steps: int) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.start_processes(
        trace_rank, args=(workers, port, n_layer, width, wire, steps), nprocs=workers, start_method="spawn", join=True
    )
