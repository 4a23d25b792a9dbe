"""Step time with a share of the optimizer on the workers' own devices
(``worker.optimizer_on_device_fraction``) against the same run with all of it on the
state servers.

    python benchmarks/device_fraction.py                          # examples/demo.yaml, 0 / 0.25 / 0.5
    python benchmarks/device_fraction.py --config examples/gpu-check.yaml --steps 5 --fractions 0,0.5

One ``TrainingSession`` per fraction (benchmarks/end_to_end.py's ``run_cargohold``: mean
step and phases of rank 0 after the warm-up, the largest worker's peak resident set read
once after the steps, and the driver's CPU seconds during them). It prints ``RATIO
fraction f / fraction 0`` per fraction. On a GPU the device segments are updated by the
fused CUDA kernel while the state servers update the rest on the host's cores; on a CPU-only
box the workers' update shares the cores with their forward and backward and with the
servers, so the ratio there measures where the same CPU work runs. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import ray
import torch
from end_to_end import DEMO, PHASES, run_cargohold

from cargohold.cluster.schema.io import load_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(DEMO))
    parser.add_argument("--steps", type=int, default=6, help="steps per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the means")
    parser.add_argument("--fractions", default="0,0.25,0.5", help="comma-separated; the first is the baseline")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    fractions = [float(f) for f in args.fractions.split(",")]
    base = [f"steps={args.steps}", "metrics.port=null", *args.overrides]
    configs = {f: load_config(args.config, [*base, f"worker.optimizer_on_device_fraction={f}"]) for f in fractions}
    first = configs[fractions[0]]
    print(f"load average {Path('/proc/loadavg').read_text().split()[0]}", flush=True)
    needed = first.worker.num_workers * first.worker.cpus + first.state_server.num_servers * first.state_server.cpus
    ray.init(
        address="local",
        num_cpus=max(1, math.ceil(needed)),
        num_gpus=torch.cuda.device_count(),
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
    )
    try:
        results = {}
        for fraction, config in configs.items():
            results[fraction] = result = run_cargohold(config, args.warmup)
            phases = ", ".join(f"{p} {result[p]:.3f}" for p in PHASES)
            print(
                f"fraction {fraction:g}: step {result['step']:.3f} s ({phases}), worker peak "
                f"{result['peak'] / 2**20:.0f} MiB, driver CPU {result['driver_cpu']:.3f} s/step",
                flush=True,
            )
    finally:
        ray.shutdown()
    baseline = results[fractions[0]]["step"]
    for fraction in fractions[1:]:
        print(f"RATIO fraction {fraction:g} / fraction {fractions[0]:g}: {results[fraction]['step'] / baseline:.3f}")


if __name__ == "__main__":
    main()
