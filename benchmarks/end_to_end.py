"""Step time of the demo model with cargohold against the same model trained in memory.

    python benchmarks/end_to_end.py                       # examples/demo.yaml, 6 steps, 2 warm-up
    python benchmarks/end_to_end.py --steps 8 --set data.batch_size=4
    python benchmarks/end_to_end.py --variants zero3,zero2

cargohold runs through ``TrainingSession(config).step()`` (Ray in this process, the
config's workers and state servers, RAM tier) once per variant:

* zero3: ``worker.reshard_after_forward=true`` (the default): each block's weights are
  all-gathered for its forward, freed, and gathered again for its backward;
* zero2: ``worker.reshard_after_forward=false``: gathered once, kept from forward to
  backward (one all-gather per block instead of two, every block's full weights resident);
* zero3+ac: zero3 with ``worker.activation_checkpointing=blocks`` (each block's forward
  run again in backward);
* zero2+ac: the same on zero2.

Each step's ``StepReport`` (rank 0) gives the step time and its phases: compute (forward
and backward, FSDP2's all-gathers and reduce-scatters, the copies of reduced gradients
into the exchange buffer and the pushes issued meanwhile), reduce (waiting for the pushes,
and the all-reduce of the gradient norm), update (commit and fetch of every segment, and
the copy of the fetched weights into FSDP2's shards). The peak resident set (VmHWM) of
the largest worker process is read once after the steps (a high-water mark needs no
sampling: an earlier version sampled every process's smaps every 50 ms during the timed
steps, half of one of two cores, and inflated the step times), and the driver's CPU
seconds during the timed steps are printed beside it. The baseline is the same model,
initialisation, data and optimizer settings in this one process: forward/backward on the
global batch (num_workers x batch_size sequences at once), clipping and
``torch.optim.AdamW(fused=True)``, with 1 thread and with every core (on a GPU: all on it),
and with the same activation checkpointing as the variant it is compared with. The first
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
from process_memory import RayProcessWatch

from cargohold.cluster.launcher import TrainingSession
from cargohold.cluster.schema.io import load_config
from cargohold.cluster.schema.train import TrainConfig
from cargohold.cluster.sections import config_task, model_spec
from cargohold.services.core.wire import WIRE_DTYPES
from cargohold.services.models.blocks import apply_activation_checkpointing
from cargohold.services.models.build import build_model

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo.yaml"
PHASES = ("compute", "reduce", "update")
VARIANTS = {
    "zero3": ["worker.reshard_after_forward=true", "worker.activation_checkpointing=off"],
    "zero2": ["worker.reshard_after_forward=false", "worker.activation_checkpointing=off"],
    "zero3+ac": ["worker.reshard_after_forward=true", "worker.activation_checkpointing=blocks"],
    "zero2+ac": ["worker.reshard_after_forward=false", "worker.activation_checkpointing=blocks"],
}


def run_cargohold(config: TrainConfig, warmup: int) -> dict[str, float]:
    """Mean step seconds and phase seconds (rank 0) over the steps after the warm-up, the
    largest worker's peak resident set, and this driver's CPU seconds while the kept steps
    ran (what the benchmark itself took from the cores the run shares). Memory is read once,
    after the steps (VmHWM is a high-water mark): no sampler runs beside the timed steps."""
    reports = []
    watch = RayProcessWatch()
    with TrainingSession(config) as session:
        for number in range(config.steps):
            if number == warmup:
                driver_cpu = time.process_time()
            reports.append(session.step())
        driver_cpu = time.process_time() - driver_cpu
        watch.sample()
    kept = reports[warmup:]
    result = {
        "step": statistics.mean(r.seconds for r in kept),
        "peak": max(t.hwm for t in watch.by_role("worker")),
        "driver_cpu": driver_cpu / len(kept),
    }
    for phase in PHASES:
        result[phase] = statistics.mean(r.phases.get(phase, 0.0) for r in kept)
    return result


def baseline_model(config: TrainConfig, device: torch.device) -> torch.nn.Module:
    """The config's model on ``device`` in fp32, for training in memory, with the workers'
    activation checkpointing (each block's forward run again in backward) where the config
    asks for it: like is compared with like."""
    model = build_model(model_spec(config), config.data).to(device).train()
    if config.worker.activation_checkpointing == "blocks":
        apply_activation_checkpointing([block for _, block in config_task(config).blocks(model)])
    return model


def run_in_memory(config: TrainConfig, warmup: int, threads: int, device: torch.device) -> float:
    """Mean step seconds of plain single-process training on the same global batch, all
    on ``device`` (the optimizer state too: all-on-GPU AdamW where that is a GPU)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = baseline_model(config, device)
        compute = WIRE_DTYPES[config.worker.compute_dtype]
        o = config.optim
        optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=o.lr,
            betas=(o.betas[0], o.betas[1]),
            eps=o.eps,
            weight_decay=o.weight_decay,
            fused=True,
        )
        data = config_task(config).open_data()
        world = config.worker.num_workers
        times = []
        for step in range(1, config.steps + 1):
            started = time.perf_counter()
            batches = [data.batch(step, r) for r in range(world)]
            x = torch.cat([b.inputs for b in batches]).to(device)
            y = torch.cat([b.targets for b in batches]).to(device)
            optimizer.zero_grad(set_to_none=True)
            # fp32 masters, compute in the workers' dtype: the usual mixed-precision loop.
            with torch.autocast(device.type, dtype=compute, enabled=compute != torch.float32):
                _, loss = model(x, y)
            loss.backward()
            if o.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), o.max_grad_norm)
            for group in optimizer.param_groups:
                group["lr"] = o.lr_at(step, config.steps)
            optimizer.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        return statistics.mean(times[warmup:])
    finally:
        torch.set_num_threads(previous)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(DEMO))
    parser.add_argument("--steps", type=int, default=6, help="steps per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the means")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra config override for every run (repeatable)",
    )
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    names = args.variants.split(",")
    if unknown := [n for n in names if n not in VARIANTS]:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    base = [f"steps={args.steps}", "metrics.port=null"]
    variants = {name: load_config(args.config, [*base, *VARIANTS[name], *args.overrides]) for name in names}
    config = load_config(args.config, [*base, *args.overrides])
    # One baseline per activation checkpointing setting of the variants, each variant's
    # ratio against the one that recomputes as it does.
    checkpointing = sorted({cfg.worker.activation_checkpointing for cfg in variants.values()})
    baselines = {
        ac: load_config(args.config, [*base, f"worker.activation_checkpointing={ac}", *args.overrides])
        for ac in checkpointing
    }
    cores = os.cpu_count() or 1
    print(f"load average {Path('/proc/loadavg').read_text().split()[0]}", flush=True)

    # One Ray for every run (sessions then leave it running). address="local": a cluster
    # another process started on this machine (ray start) must not be joined.
    needed = config.worker.num_workers * config.worker.cpus + config.state_server.num_servers * config.state_server.cpus
    owns_ray = not ray.is_initialized()
    if owns_ray:
        ray.init(
            address="local",
            num_cpus=max(1, math.ceil(needed)),
            num_gpus=torch.cuda.device_count(),  # as the launcher's: Ray's NVML detection can see none
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            log_to_driver=False,
        )
    try:
        results = {name: run_cargohold(cfg, args.warmup) for name, cfg in variants.items()}
    finally:
        if owns_ray:
            ray.shutdown()
    device = torch.device("cuda" if config.worker.on_gpus else "cpu")
    thread_counts = [cores] if device.type == "cuda" else sorted({1, cores})
    in_memory = {
        (ac, threads): run_in_memory(baseline, args.warmup, threads, device)
        for ac, baseline in baselines.items()
        for threads in thread_counts
    }

    m, w = config.model, config.worker
    print(
        f"\nmodel: GPT n_layer={m.n_layer} n_embd={m.n_embd} block={m.block_size}; "
        f"{w.num_workers} workers x batch {config.data.batch_size} ({w.torch_threads} thread each, compute "
        f"{w.compute_dtype}, wire {w.grad_wire_dtype}), {config.state_server.num_servers} state server(s) "
        f"({config.state_server.torch_threads} thread); {cores} cores shared by all of them; load average "
        f"{Path('/proc/loadavg').read_text().split()[0]} at the end"
    )
    print(f"mean of steps {args.warmup + 1}..{args.steps}, seconds (rank 0's phases)")
    print(
        f"{'run':40} {'step':>7} "
        + " ".join(f"{p:>7}" for p in PHASES)
        + f" {'update%':>7} {'peak':>9} {'driver CPU':>10}"
    )
    for name, r in results.items():
        print(
            f"{'cargohold ' + name:40} {r['step']:7.3f} "
            + " ".join(f"{r[p]:7.3f}" for p in PHASES)
            + f" {100 * r['update'] / r['step']:6.1f}% {r['peak'] / 2**30:5.2f} GiB {r['driver_cpu']:9.3f}s"
        )
    for (ac, threads), seconds in in_memory.items():
        where = "on the GPU" if device.type == "cuda" else f"{threads} thread(s)"
        print(f"{f'in-memory AdamW, {where}, ac {ac}':40} {seconds:7.3f}")
    for name, r in results.items():
        ac = variants[name].worker.activation_checkpointing
        best = min(seconds for (other, _), seconds in in_memory.items() if other == ac)
        print(f"RATIO cargohold {name} / in-memory (best, activation checkpointing {ac}) = {r['step'] / best:.2f}")
    for name, r in results.items():
        if name != "zero3" and "zero3" in results:
            print(f"RATIO cargohold {name} / cargohold zero3 = {r['step'] / results['zero3']['step']:.2f}")
    print(
        "update% = update phase / step: time rank 0 waited for the servers' updates and fetches after its "
        "own backward. peak = the largest worker's VmHWM, read after the steps. driver CPU = this process's "
        "CPU seconds per timed step (the benchmark's own cost on the shared cores). With every process on "
        "the same few cores these ratios reflect CPU contention, not the offload alone."
    )


if __name__ == "__main__":
    main()
