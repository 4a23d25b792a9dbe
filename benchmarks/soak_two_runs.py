"""Soak of two runs side by side on one machine (issue 27): overlapping settings, random
SIGKILLs of both runs' workers and state servers, and an intruder that keeps trying to
start in a live run's checkpoint folder. At the end both runs' checkpoints resume bitwise
and nothing is left in /dev/shm, the tier folders or the process table.

    python benchmarks/soak_two_runs.py                        # kills for 30 minutes
    python benchmarks/soak_two_runs.py --minutes 5 --steps 100

Each run is its own process with its own Ray cluster, as two ``cargohold train`` would
be: the tests' tiny GPT, 2 workers and 2 state servers, most state in partition files,
``max_failures`` unbounded (:func:`soak.soak_config`). They overlap where operators
collide: one NVMe tier root for both (``<root>/nvme``, each run under its own run id),
their checkpoint folders side by side in one parent, other seeds. In each run, while the
kill window lasts, one actor of every session is SIGKILLed at a random moment of a random
step (:class:`soak.FaultInjector`). Meanwhile this process starts an intruder run every
``--intrude-every`` seconds with the checkpoint folder of a live run (and the other run's
run id): each must be refused before it starts.

Each run then trains the same config again without faults (its reference) and compares:
the final checkpoint's state (master, exp_avg, exp_avg_sq) and the losses must be bitwise
equal. Left behind, counted after both runs end: bytes in /dev/shm named after a run,
anything under the tier root, partial checkpoints, and processes of either run's session
(each run starts in a session of its own, so its Ray daemons and actors are found by
session id), and intruders that were not refused. Exit status 0 only when all of that holds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ray
import torch
from soak import ARRAYS, FaultInjector, final_state, left_behind, soak_config

from cargohold.cluster.schema.train import TrainConfig
from cargohold.cluster.supervise import TrainResult, train
from cargohold.services.core.errors import ConfigError

RUNS = {"run-soak-a": 11, "run-soak-b": 12}
"""Run id -> seed of the data and the initial weights (and of the kills)."""


def run_config(root: Path, run_id: str, steps: int, every: int, reference: bool = False) -> TrainConfig:
    """One run's config: the shared tier root, a checkpoint folder beside the other run's."""
    checkpoints = root / ("reference" if reference else "checkpoints") / run_id
    config = soak_config(root, checkpoints, steps, every)
    return dataclasses.replace(config, run_id=run_id + ("-ref" if reference else ""), seed=RUNS[run_id])


def child(args: argparse.Namespace) -> int:
    """One run: the soak under kills, then its reference; prints a JSON report line."""
    root, run_id = Path(args.root), args.child
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="ERROR")
    try:
        config = run_config(root, run_id, args.steps, args.every)
        started = time.perf_counter()
        injector = FaultInjector(
            None,
            until=started + args.minutes * 60,
            steps=args.steps,
            quiet_steps=2 * args.every + 2,
            seed=RUNS[run_id],
        )
        injector.install()
        live = root / f"{run_id}.live"  # the parent's intruder aims only at a live run
        live.touch()
        try:
            soaked: TrainResult = train(config)
        finally:
            live.unlink()
            injector.uninstall()
        soak_seconds = time.perf_counter() - started
        started = time.perf_counter()
        reference_config = run_config(root, run_id, args.steps, args.every, reference=True)
        reference: TrainResult = train(reference_config)
        reference_seconds = time.perf_counter() - started
    finally:
        ray.shutdown()
    a = final_state(Path(config.checkpoint.dir or ""), args.steps)
    b = final_state(Path(reference_config.checkpoint.dir or ""), args.steps)
    print(
        json.dumps(
            {
                "run_id": run_id,
                "soak_minutes": round(soak_seconds / 60, 1),
                "reference_minutes": round(reference_seconds / 60, 1),
                "kills": injector.faults.kills,
                "restarts": soaked.restarts,
                "recovery_seconds_mean": round(sum(soaked.recovery_seconds) / max(1, len(soaked.recovery_seconds)), 2),
                "bitwise_equal": {k: bool(torch.equal(a[k], b[k])) for k in ARRAYS},
                "losses_equal": soaked.losses == reference.losses,
            }
        ),
        flush=True,
    )
    return 0


def intrude(root: Path, victim: str, other: str, every: int) -> bool | None:
    """Start a run in ``victim``'s checkpoint folder under ``other``'s run id while the
    victim's soak is live: True when it was refused before starting (what must happen),
    False when it ran though the victim was live before and after, None when the victim's
    soak ended meanwhile (not counted)."""
    live = root / f"{victim}.live"
    if not live.exists():
        return None
    config = dataclasses.replace(run_config(root, victim, 1, every), run_id=other, seed=99)
    try:
        train(config)
    except ConfigError as error:
        return "in use by another live run" in str(error)
    return False if live.exists() else None


def session_processes(sids: set[int]) -> list[str]:
    """Processes still in one of the runs' sessions."""
    left = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getsid(int(entry.name)) in sids:
                left.append(f"{entry.name} {(entry / 'comm').read_text().strip()}")
        except OSError:
            continue  # gone meanwhile
    return left


def parent(args: argparse.Namespace) -> int:
    root = Path(tempfile.mkdtemp(prefix="cargohold-soak2-"))
    children: dict[str, subprocess.Popen] = {}
    try:
        for run_id in RUNS:
            children[run_id] = subprocess.Popen(
                [sys.executable, __file__, "--child", run_id, "--root", str(root)]
                + ["--minutes", str(args.minutes), "--steps", str(args.steps), "--every", str(args.every)],
                stdout=subprocess.PIPE,
                text=True,
                start_new_session=True,  # its Ray daemons and actors share its session id
            )
        sids = {child.pid for child in children.values()}
        intrusions = refused = 0
        deadline = time.monotonic() + args.minutes * 60
        victims = list(RUNS)
        while time.monotonic() < deadline and all(c.poll() is None for c in children.values()):
            time.sleep(args.intrude_every)
            victim, other = victims[intrusions % 2], victims[(intrusions + 1) % 2]
            outcome = intrude(root, victim, other, args.every)
            if outcome is not None:
                intrusions += 1
                refused += outcome
        reports = {}
        for run_id, process in children.items():
            out, _ = process.communicate()
            lines = [line for line in out.splitlines() if line.startswith("{")]
            reports[run_id] = (
                json.loads(lines[-1]) if process.returncode == 0 and lines else {"exit": process.returncode}
            )
        time.sleep(5)  # Ray's daemons end a moment after their driver
        leaks = left_behind(root, root / "checkpoints", set(RUNS) | {r + "-ref" for r in RUNS})
        partial_elsewhere = [str(p) for p in root.rglob("*.partial")]
        processes = session_processes(sids)
        report = {
            "minutes": args.minutes,
            "steps": args.steps,
            "runs": reports,
            "intrusions": intrusions,
            "intrusions_refused": refused,
            "bytes_left_behind": leaks,
            "partial_checkpoints": partial_elsewhere,
            "processes_left": processes,
        }
        print(json.dumps(report, indent=2))
        ok = (
            all(r.get("losses_equal") and all(r.get("bitwise_equal", {0: False}).values()) for r in reports.values())
            and intrusions == refused
            and not any(leaks.values())
            and not partial_elsewhere
            and not processes
        )
        print("soak of two runs:", "PASSED" if ok else "FAILED")
        return 0 if ok else 1
    finally:
        for process in children.values():
            if process.poll() is None:
                os.killpg(process.pid, 9)
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="how long faults are injected")
    parser.add_argument("--steps", type=int, default=600, help="steps of each run (and of its reference)")
    parser.add_argument("--every", type=int, default=4, help="checkpoint every N steps")
    parser.add_argument("--intrude-every", type=float, default=30.0, help="seconds between intruder runs")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.exit(child(args) if args.child else parent(args))


if __name__ == "__main__":
    main()
