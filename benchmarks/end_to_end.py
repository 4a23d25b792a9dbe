"""Step time of the demo model with cargohold against the same model trained in memory.

    python benchmarks/end_to_end.py                       # examples/demo.yaml, 6 steps, 2 warm-up
    python benchmarks/end_to_end.py --steps 8 --set data.batch_size=4

cargohold runs through ``TrainingSession(config).step()`` (Ray in this process, the
config's workers and state servers, RAM tier), once with ``worker.overlap=true`` and once
with ``worker.overlap=false``; each step's ``StepReport`` (rank 0) gives the step time
and its phases: compute (forward/backward), reduce (reduce-scatter and the norm
all-reduce), push (waiting for the pushes, the server's update and the fetches) and
gather (all-gather of the weights). The baseline is the same model, initialisation, data
and optimizer settings in this one process: forward/backward on the global batch
(num_workers x batch_size sequences at once), clipping and
``torch.optim.AdamW(fused=True)``, with 1 thread and with every core. The first
``--warmup`` steps of each are left out. Nothing is asserted.

On a CPU-only box every worker and the state server share the same cores, so the ratio
measures CPU contention as much as cargohold's overhead.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from pathlib import Path

import ray
import torch

from cargohold.cluster.config import TrainConfig, load_config
from cargohold.cluster.launcher import TrainingSession
from cargohold.services.data import batch_for_step, load_tokens
from cargohold.services.worker import build_model

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo.yaml"
PHASES = ("compute", "reduce", "push", "gather")


def run_cargohold(config: TrainConfig, warmup: int) -> dict[str, float]:
    """Mean step seconds and phase seconds (rank 0) over the steps after the warm-up."""
    reports = []
    with TrainingSession(config) as session:
        for _ in range(config.steps):
            reports.append(session.step())
    kept = reports[warmup:]
    result = {"step": statistics.mean(r.seconds for r in kept)}
    for phase in PHASES:
        result[phase] = statistics.mean(r.phases.get(phase, 0.0) for r in kept)
    return result


def run_in_memory(config: TrainConfig, warmup: int, threads: int) -> float:
    """Mean step seconds of plain single-process training on the same global batch."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = build_model(config).train()
        o = config.optim
        optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                      weight_decay=o.weight_decay, fused=True)
        tokens = load_tokens(config.data.corpus_path, config.data.corpus_bytes, config.data.seed,
                             seq_len=config.model.block_size)
        world = config.worker.num_workers
        times = []
        for step in range(1, config.steps + 1):
            started = time.perf_counter()
            batches = [batch_for_step(tokens, step=step, rank=r, world_size=world, batch_size=config.data.batch_size,
                                      seq_len=config.model.block_size, seed=config.data.seed) for r in range(world)]
            x = torch.cat([b[0] for b in batches])
            y = torch.cat([b[1] for b in batches])
            optimizer.zero_grad(set_to_none=True)
            _, loss = model(x, y)
            loss.backward()
            if o.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), o.max_grad_norm)
            for group in optimizer.param_groups:
                group["lr"] = o.lr_at(step, config.steps)
            optimizer.step()
            times.append(time.perf_counter() - started)
        return statistics.mean(times[warmup:])
    finally:
        torch.set_num_threads(previous)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(DEMO))
    parser.add_argument("--steps", type=int, default=6, help="steps per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the means")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="extra config override for every run (repeatable)")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    base = [f"steps={args.steps}", "progress=false", *args.overrides]
    variants = {
        "overlap on": load_config(args.config, [*base, "worker.overlap=true"]),
        "overlap off": load_config(args.config, [*base, "worker.overlap=false"]),
    }
    config = variants["overlap on"]
    cores = os.cpu_count() or 1

    # One Ray for both runs (sessions then leave it running). address="local": a cluster
    # another process started on this machine (ray start) must not be joined.
    needed = config.worker.num_workers * config.worker.cpus + config.state_server.num_servers * config.state_server.cpus
    owns_ray = not ray.is_initialized()
    if owns_ray:
        ray.init(address="local", num_cpus=max(1, math.ceil(needed)), include_dashboard=False,
                 _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        results = {name: run_cargohold(cfg, args.warmup) for name, cfg in variants.items()}
    finally:
        if owns_ray:
            ray.shutdown()
    in_memory = {threads: run_in_memory(config, args.warmup, threads) for threads in sorted({1, cores})}

    m = config.model
    print(f"\nmodel: GPT n_layer={m.n_layer} n_embd={m.n_embd} block={m.block_size}; "
          f"{config.worker.num_workers} workers x batch {config.data.batch_size} "
          f"({config.worker.torch_threads} thread each), {config.state_server.num_servers} state server(s) "
          f"({config.state_server.torch_threads} thread); {cores} cores shared by all of them")
    print(f"mean of steps {args.warmup + 1}..{args.steps}, seconds (rank 0's phases)")
    print(f"{'run':28} {'step':>7} " + " ".join(f"{p:>7}" for p in PHASES) + f" {'wait%':>6}")
    for name, r in results.items():
        print(f"{'cargohold ' + name:28} {r['step']:7.3f} " + " ".join(f"{r[p]:7.3f}" for p in PHASES)
              + f" {100 * r['push'] / r['step']:5.1f}%")
    for threads, seconds in in_memory.items():
        print(f"{f'in-memory AdamW, {threads} thread(s)':28} {seconds:7.3f}")
    best = min(in_memory.values())
    for name, r in results.items():
        print(f"RATIO cargohold {name} / in-memory (best) = {r['step'] / best:.2f}")
    print("wait% = push phase / step: time rank 0 waited on pushes, the server's update and the "
          "fetches after its own reduce. With every process on the same few cores this ratio "
          "reflects CPU contention, not the offload alone.")


if __name__ == "__main__":
    main()
