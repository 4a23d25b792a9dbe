"""Effect of the one-step delayed parameter update (DPU) on convergence and step time.

    python benchmarks/delayed_update.py --steps 50

Trains the demo model (examples/demo.yaml) with the same seed and data: once normally,
once with worker.delayed_update=true from the first step, and once more for each
``--after N`` with tuning.worker.delayed_update_after_steps=N (N normal steps first). Prints the
loss curves, the mean loss of the last 10 steps and the mean step time (first 2 steps
excluded), with the ratios to the baseline.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from cargohold.cluster.launcher import TrainingSession
from cargohold.cluster.schema.io import load_config

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo.yaml"


def run(steps: int, delayed: bool, after: int, extra: list[str]) -> tuple[list[float], list[float]]:
    config = load_config(
        DEMO,
        [
            f"steps={steps}",
            f"worker.delayed_update={str(delayed).lower()}",
            f"tuning.worker.delayed_update_after_steps={after}",
            *extra,
        ],
    )
    with TrainingSession(config) as session:
        reports = [session.step() for _ in range(steps)]
    return [r.loss for r in reports], [r.seconds for r in reports]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument(
        "--after",
        type=int,
        action="append",
        default=[],
        metavar="N",
        help="also run DPU after N normal steps (repeatable)",
    )
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    runs = {"baseline": run(args.steps, False, 0, args.overrides), "DPU": run(args.steps, True, 0, args.overrides)}
    for after in args.after:
        runs[f"DPU>{after}"] = run(args.steps, True, after, args.overrides)
    print(f"{'step':>5} " + " ".join(f"{name:>9}" for name in runs))
    for step, losses in enumerate(zip(*(loss for loss, _ in runs.values())), start=1):
        print(f"{step:>5} " + " ".join(f"{loss:>9.4f}" for loss in losses))
    tail = min(10, args.steps)
    base_loss, base_time = runs["baseline"]
    base_tail, base_step = statistics.mean(base_loss[-tail:]), statistics.mean(base_time[2:] or base_time)
    for name, (loss, seconds) in runs.items():
        mean_loss, mean_step = statistics.mean(loss[-tail:]), statistics.mean(seconds[2:] or seconds)
        print(
            f"{name:>9}: mean loss of the last {tail} steps {mean_loss:.4f} (ratio to baseline "
            f"{mean_loss / base_tail:.3f}), mean step seconds {mean_step:.3f} (ratio {mean_step / base_step:.3f})"
        )


if __name__ == "__main__":
    main()
