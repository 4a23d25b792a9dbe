"""Effect of the one-step delayed parameter update (DPU) on convergence and step time.

    python benchmarks/delayed_update.py --steps 50

Trains the demo model (examples/demo.yaml) twice with the same seed and data: once
normally, once with worker.delayed_update=true, and prints both loss curves, the mean
loss of the last 10 steps and the mean step time (first 2 steps excluded), with the
ratios DPU / baseline.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from cargohold.cluster.config import load_config
from cargohold.cluster.launcher import TrainingSession

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo.yaml"


def run(steps: int, delayed: bool, extra: list[str]) -> tuple[list[float], list[float]]:
    config = load_config(DEMO, [f"steps={steps}", "progress=false", f"worker.delayed_update={str(delayed).lower()}",
                                *extra])
    with TrainingSession(config) as session:
        reports = [session.step() for _ in range(steps)]
    return [r.loss for r in reports], [r.seconds for r in reports]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    base_loss, base_time = run(args.steps, False, args.overrides)
    dpu_loss, dpu_time = run(args.steps, True, args.overrides)
    print(f"{'step':>5} {'baseline':>9} {'DPU':>9}")
    for step, (a, b) in enumerate(zip(base_loss, dpu_loss), start=1):
        print(f"{step:>5} {a:>9.4f} {b:>9.4f}")
    tail = min(10, args.steps)
    base_tail, dpu_tail = statistics.mean(base_loss[-tail:]), statistics.mean(dpu_loss[-tail:])
    base_step, dpu_step = statistics.mean(base_time[2:] or base_time), statistics.mean(dpu_time[2:] or dpu_time)
    print(f"mean loss of the last {tail} steps: baseline {base_tail:.4f}, DPU {dpu_tail:.4f}, "
          f"ratio DPU/baseline {dpu_tail / base_tail:.3f}")
    print(f"mean step seconds: baseline {base_step:.3f}, DPU {dpu_step:.3f}, ratio DPU/baseline {dpu_step / base_step:.3f}")


if __name__ == "__main__":
    main()
