"""A lost worker: the live recovery (the workers replaced from the state servers' live
state) against the restart from the newest checkpoint, in the same run.

    python benchmarks/recovery.py                         # examples/demo.yaml, RAM tier
    python benchmarks/recovery.py --nvme /mnt/nvme/bench  # the state on an NVMe tier
    python benchmarks/recovery.py --set model.n_layer=12 --set model.n_embd=768

Each path trains the same config (``--steps`` steps, a checkpoint every ``--every``)
with worker 1 SIGKILLed just before step ``--kill-at``; the checkpoint path is the one the
launcher takes where the live state cannot carry the run (forced here by refusing the
live one). Both end where an uninterrupted run ends (tests/test_live_recovery.py,
tests/test_recovery.py prove it bitwise); this measures what the loss costs:

* **lost**: seconds from the kill until step ``--kill-at`` is done, less the median
  step's seconds: what the failure cost beyond the step it interrupted (detecting it,
  stopping and starting processes, restoring or settling state, and the steps computed
  again);
* **steps recomputed**: completed steps computed again (``TrainResult.steps_recomputed``);
* **checkpoint read**: the bytes of the checkpoint the restart restored (the live path
  reads none).

Printed: each path's figures and the ratio checkpoint / live of the seconds lost. No
sampling runs while either path trains. Each path starts Ray in this process as
`cargohold train` does.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import ray

from cargohold.cluster import supervise
from cargohold.cluster.launcher import TrainingSession
from cargohold.cluster.schema.io import load_config
from cargohold.cluster.supervise import TrainResult, train
from cargohold.services.core.errors import UnsettledError

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo.yaml"


@dataclass(frozen=True, slots=True)
class Recovery:
    path: str
    lost_s: float
    step_s: float
    steps_recomputed: int
    checkpoint_read_bytes: int
    run_s: float


def _kill_worker_before(step: int, killed_at: list[float]) -> None:
    """Make the session SIGKILL worker 1 once, just before data step ``step``."""
    original = TrainingSession.step

    def step_with_fault(session: TrainingSession):
        if not killed_at and session.step_count == step - 1:
            pid = ray.get(session.workers[1].__ray_call__.remote(lambda actor: os.getpid()))
            killed_at.append(time.perf_counter())
            os.kill(pid, signal.SIGKILL)
        return original(session)

    TrainingSession.step = step_with_fault  # type: ignore[method-assign]


def _checkpoint_bytes(root: Path) -> dict[str, int]:
    """Each step folder's bytes under ``root``."""
    return {
        folder.name: sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        for folder in root.iterdir()
        if folder.is_dir() and folder.name.startswith("step-")
    }


def measure(args: argparse.Namespace, path: str) -> Recovery:
    """One run of the config with worker 1 killed before ``--kill-at``, recovering by ``path``."""
    original_step, original_replace = TrainingSession.step, supervise.replace_workers
    killed_at: list[float] = []
    done_at: dict[int, float] = {}
    restored: list[int] = []  # the bytes of the checkpoint the restart restores
    with tempfile.TemporaryDirectory(prefix="cargohold-recovery-") as root:
        overrides = [
            f"steps={args.steps}",
            f"checkpoint.dir={root}",
            f"checkpoint.every_steps={args.every}",
            "checkpoint.max_failures=1",
            *args.overrides,
        ]
        if args.nvme:
            overrides.append(f"state_server.tier.nvme_paths=[{args.nvme}]")
        config = load_config(args.config, overrides)
        _kill_worker_before(args.kill_at, killed_at)
        if path == "checkpoint":

            def refuse(session: TrainingSession) -> int:
                sizes = _checkpoint_bytes(Path(root))  # now: the run's later checkpoints prune it
                restored.append(sizes[max(sizes)])
                raise UnsettledError("benchmarks/recovery.py: the checkpoint path")

            supervise.replace_workers = refuse  # type: ignore[assignment]
        try:
            started = time.perf_counter()
            result: TrainResult = train(config, lambda report: done_at.setdefault(report.step, time.perf_counter()))
            run_s = time.perf_counter() - started
        finally:
            TrainingSession.step, supervise.replace_workers = original_step, original_replace  # type: ignore[method-assign]
    if result.restarts != 1 or not killed_at:
        raise SystemExit(f"{path}: expected one recovery, got {result.restarts}")
    step_s = statistics.median(s for s in result.step_seconds if s == s)  # nan: a step without a report
    after = min(t for step, t in done_at.items() if step >= args.kill_at)
    return Recovery(
        path=path,
        lost_s=after - killed_at[0] - step_s,
        step_s=step_s,
        steps_recomputed=result.steps_recomputed,
        checkpoint_read_bytes=restored[0] if restored else 0,
        run_s=run_s,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(DEMO))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--every", type=int, default=4, help="checkpoint every N steps")
    parser.add_argument("--kill-at", type=int, default=7, help="SIGKILL worker 1 just before this step")
    parser.add_argument("--nvme", default=None, help="a folder for the state servers' NVMe tier")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    if not 1 < args.kill_at <= args.steps:
        parser.error("--kill-at must be a step after the first")
    results = [measure(args, path) for path in ("live", "checkpoint")]  # each starts Ray as `cargohold train` does
    print(f"{'path':<11} {'lost s':>8} {'step s':>7} {'recomputed':>10} {'ckpt read MiB':>13} {'run s':>7}")
    for r in results:
        print(
            f"{r.path:<11} {r.lost_s:8.2f} {r.step_s:7.2f} {r.steps_recomputed:10d} "
            f"{r.checkpoint_read_bytes / 2**20:13.1f} {r.run_s:7.1f}"
        )
    live, restart = results
    print(f"checkpoint / live, seconds lost: {restart.lost_s / live.lost_s:.2f}x")


if __name__ == "__main__":
    main()
