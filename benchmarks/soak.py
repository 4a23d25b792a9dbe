"""Soak: a long run under random SIGKILLs of workers and state servers and disk-full
episodes in the checkpoint folder, which must end bitwise equal to an uninterrupted run
of the same steps, with nothing left behind.

    python benchmarks/soak.py                         # kills for 30 minutes, then the reference
    python benchmarks/soak.py --minutes 2 --steps 60  # a quick look

The run: the tests' tiny GPT, 2 workers and 2 state servers with an NVMe tier (most of
the state in partition files), a checkpoint every ``--every`` steps into a real tmpfs
sized for a few checkpoints (``checkpoint.on_save_error: continue``, ``max_failures``
unbounded). While the kill window (``--minutes``) lasts, after a random 2 to 8 steps of
each group of actors (a session, or its workers after a live recovery) one actor (a worker
or a state server, at random) is SIGKILLed at a random moment of a step, or, for a
worker with probability ``--notice-share``, sent the preemption notice (SIGTERM) instead;
now and then a ballast file fills the checkpoint disk for a few steps. Then the run
finishes its steps undisturbed. A lost worker is replaced from the state servers' live
state (its survivors kept), a lost state server restarts the run from the checkpoint.

The baseline, in the same run: the same config trained without faults into another
folder. Reported: kills and notices, restarts (live and from a checkpoint), steps
recomputed, recovery seconds, failed saves, and the bytes left
behind (memfd regions in /dev/shm, tier folders, partial checkpoints: all must be 0).
Exit status 0 only when the final states (master, exp_avg, exp_avg_sq) and the losses
are bitwise equal and nothing is left.

Needs `mount` (root or CAP_SYS_ADMIN) for the tmpfs; without it the disk-full episodes
are skipped, and the report says so.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray
import torch

from cargohold.cluster.launcher import TrainingSession
from cargohold.cluster.schema.io import from_dict
from cargohold.cluster.schema.train import TrainConfig
from cargohold.cluster.supervise import TrainResult, train
from cargohold.services.checkpoint.directory import CheckpointDir
from cargohold.services.checkpoint.reader import read_flat_range

ARRAYS = ("master", "exp_avg", "exp_avg_sq")


def soak_config(root: Path, checkpoints: Path, steps: int, every: int) -> TrainConfig:
    """The tests' tiny model (see tests/reference.py), two servers, most state on disk."""
    return from_dict(
        TrainConfig,
        {
            "steps": steps,
            "seed": 7,
            "model": {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 32},
            "data": {"batch_size": 4, "corpus_bytes": 100_000},
            "optim": {"lr": 0.01, "weight_decay": 0.1, "max_grad_norm": 1.0, "warmup_steps": 3, "schedule": "cosine"},
            "worker": {"num_workers": 2, "cpus": 0.5},
            "state_server": {
                "num_servers": 2,
                "cpus": 0.5,
                "tier": {
                    "nvme_paths": [str(root / "nvme")],
                    "ram_budget_bytes": 320 << 10,
                    "partition_bytes": 64 << 10,
                    "buffer_count": 3,
                },
            },
            "checkpoint": {
                "dir": str(checkpoints),
                "every_steps": every,
                "keep_last": 2,
                "max_failures": 1_000_000,
                "on_save_error": "continue",
            },
            "metrics": {"port": None},
        },
    )


@dataclass
class Faults:
    """What the fault injector did."""

    kills: dict[str, int] = field(default_factory=lambda: {"worker": 0, "state-server": 0})
    notices: int = 0
    disk_full_episodes: int = 0
    disk_full_steps: int = 0


class FaultInjector:
    """Wraps ``TrainingSession.step``: counts a session's steps, SIGKILLs one of its
    actors at a random moment of a random later step, and fills the checkpoint disk now
    and then. Stops injecting once ``until`` (a perf_counter time) has passed or fewer
    than ``quiet_steps`` steps remain."""

    def __init__(
        self, ballast: Path | None, until: float, steps: int, quiet_steps: int, seed: int, notice_share: float
    ) -> None:
        self.random = random.Random(seed)
        self.notice_share = notice_share
        self.ballast = ballast
        self.until = until
        self.last_fault_step = steps - quiet_steps
        self.faults = Faults()
        self._actors: tuple[object, ...] = ()
        self._steps_in_session = 0
        self._kill_after = 0
        self._full_until_step = -1
        self._last_step_seconds = 0.5
        self._original = TrainingSession.step

    def install(self) -> None:
        injector = self

        def step(session: TrainingSession):  # type: ignore[no-untyped-def]
            return injector.step(session)

        TrainingSession.step = step  # type: ignore[method-assign]

    def uninstall(self) -> None:
        TrainingSession.step = self._original  # type: ignore[method-assign]
        self._fill(False)

    def _active(self, session: TrainingSession) -> bool:
        return time.perf_counter() < self.until and session.step_count < self.last_fault_step

    def step(self, session: TrainingSession):  # type: ignore[no-untyped-def]
        actors = (session, *session.workers)  # new after a restart, or a live recovery
        if actors != self._actors:
            self._actors, self._steps_in_session = actors, 0
            self._kill_after = self.random.randint(2, 8)
        self._steps_in_session += 1
        self._disk(session)
        timer = None
        if self._active(session) and self._steps_in_session > self._kill_after:
            kind, actor = self.random.choice(
                [("worker", a) for a in session.workers] + [("state-server", a) for a in session.servers]
            )
            pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=60)
            delay = self.random.uniform(0.0, self._last_step_seconds)
            notice = kind == "worker" and self.random.random() < self.notice_share
            timer = threading.Timer(delay, self._fault, (kind, pid, notice))
            timer.start()
            self._kill_after = 10**9  # one fault per group of actors
        started = time.perf_counter()
        try:
            report = self._original(session)
        finally:
            if timer is not None:
                timer.join()
        self._last_step_seconds = time.perf_counter() - started
        return report

    def _fault(self, kind: str, pid: int, notice: bool) -> None:
        """SIGKILL the actor's process, or send it the preemption notice (SIGTERM)."""
        try:
            os.kill(pid, signal.SIGTERM if notice else signal.SIGKILL)
        except ProcessLookupError:
            return
        if notice:
            self.faults.notices += 1
        else:
            self.faults.kills[kind] += 1

    def _disk(self, session: TrainingSession) -> None:
        if self.ballast is None:
            return
        if self._full_until_step >= 0 and session.step_count >= self._full_until_step:
            self._fill(False)
        if self._full_until_step < 0 and self._active(session) and self.random.random() < 0.05:
            self._full_until_step = session.step_count + self.random.randint(2, 6)
            self.faults.disk_full_episodes += 1
            self._fill(True)
        if self._full_until_step >= 0:
            self.faults.disk_full_steps += 1

    def _fill(self, full: bool) -> None:
        if self.ballast is None:
            return
        if not full:
            self.ballast.unlink(missing_ok=True)
            self._full_until_step = -1
            return
        free = shutil.disk_usage(self.ballast.parent).free
        with open(self.ballast, "wb") as handle:
            try:
                os.posix_fallocate(handle.fileno(), 0, max(free - 4096, 4096))
            except OSError:
                pass  # full either way


def final_state(checkpoints: Path, steps: int) -> dict[str, torch.Tensor]:
    store = CheckpointDir(checkpoints)
    latest = store.latest()
    if latest is None:
        raise SystemExit(f"no checkpoint in {checkpoints}")
    manifest = store.load(latest)
    if manifest.step != steps:
        raise SystemExit(f"the latest checkpoint in {checkpoints} is of step {manifest.step}, not {steps}")
    return read_flat_range(latest, manifest, 0, manifest.total)


def left_behind(root: Path, checkpoints: Path, run_ids: set[str]) -> dict[str, int]:
    """Bytes the runs left: memfd regions or files named after them in /dev/shm, anything
    under the tier root, partial checkpoint folders."""

    def size(path: Path) -> int:
        if path.is_file() or path.is_symlink():
            return path.lstat().st_size
        return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file()) + 1  # an empty folder counts

    shm = [p for p in Path("/dev/shm").iterdir() if any(r in p.name for r in run_ids)]
    tiers = list((root / "nvme").iterdir()) if (root / "nvme").exists() else []
    partial = list(checkpoints.glob("*.partial")) + list(checkpoints.glob("*.tmp"))
    return {
        "dev_shm": sum(size(p) for p in shm),
        "tier_folders": sum(size(p) for p in tiers),
        "partial_checkpoints": sum(size(p) for p in partial),
    }


def mount_tmpfs(mount: Path, size_bytes: int) -> bool:
    mount.mkdir(parents=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(mount)], capture_output=True, timeout=30
    )
    return done.returncode == 0


def checkpoint_bytes() -> int:
    """One checkpoint's size, measured by a 1-step run of the same model into a scratch folder."""
    with tempfile.TemporaryDirectory() as scratch:
        train(soak_config(Path(scratch), Path(scratch) / "checkpoints", steps=1, every=1))
        return sum(p.stat().st_size for p in (Path(scratch) / "checkpoints").rglob("*") if p.is_file())


def run(args: argparse.Namespace) -> int:
    root = Path(tempfile.mkdtemp(prefix="cargohold-soak-"))
    mount = root / "checkpoints"
    reference_dir = root / "reference"
    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR")
    mounted = False
    try:
        config = soak_config(root, mount, args.steps, args.every)
        per_checkpoint = checkpoint_bytes()
        mounted = mount_tmpfs(mount, 3 * per_checkpoint + (1 << 20))
        if not mounted:
            mount.mkdir(exist_ok=True)
        print(f"checkpoint {per_checkpoint / 2**20:.2f} MiB; disk-full episodes {'on' if mounted else 'off'}")

        started = time.perf_counter()
        injector = FaultInjector(
            mount / "ballast" if mounted else None,
            until=started + args.minutes * 60,
            steps=args.steps,
            quiet_steps=2 * args.every + 2,
            seed=args.seed,
            notice_share=args.notice_share,
        )
        injector.install()
        try:
            soaked: TrainResult = train(config)
        finally:
            injector.uninstall()
        soak_seconds = time.perf_counter() - started

        started = time.perf_counter()
        reference: TrainResult = train(soak_config(root, reference_dir, args.steps, args.every))
        reference_seconds = time.perf_counter() - started

        a, b = final_state(mount, args.steps), final_state(reference_dir, args.steps)
        equal = {k: bool(torch.equal(a[k], b[k])) for k in ARRAYS}
        losses_equal = soaked.losses == reference.losses
        leaks = left_behind(root, mount, {soaked.run_id, reference.run_id})
        faults = injector.faults
        report = {
            "steps": args.steps,
            "soak_minutes": round(soak_seconds / 60, 1),
            "reference_minutes": round(reference_seconds / 60, 1),
            "kills": faults.kills,
            "notices": faults.notices,
            "restarts": soaked.restarts,
            "live_recoveries": soaked.live_recoveries,
            "preemptions": soaked.preemptions,
            "steps_recomputed": soaked.steps_recomputed,
            "recovery_seconds": {
                "count": len(soaked.recovery_seconds),
                "mean": round(sum(soaked.recovery_seconds) / max(1, len(soaked.recovery_seconds)), 2),
                "max": round(max(soaked.recovery_seconds, default=0.0), 2),
            },
            "disk_full_episodes": faults.disk_full_episodes,
            "disk_full_steps": faults.disk_full_steps,
            "checkpoints_kept": len(soaked.checkpoints),
            "bitwise_equal": equal,
            "losses_equal": losses_equal,
            "bytes_left_behind": leaks,
        }
        print(json.dumps(report, indent=2))
        ok = all(equal.values()) and losses_equal and not any(leaks.values())
        print("soak:", "PASSED" if ok else "FAILED")
        return 0 if ok else 1
    finally:
        ray.shutdown()
        if mounted:
            subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=30)
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="how long faults are injected")
    parser.add_argument("--steps", type=int, default=600, help="steps of the run (and of the reference)")
    parser.add_argument("--every", type=int, default=4, help="checkpoint every N steps")
    parser.add_argument("--seed", type=int, default=0, help="seeds which actor dies when")
    parser.add_argument(
        "--notice-share", type=float, default=0.25, help="of the faults aimed at a worker, the share sent SIGTERM"
    )
    sys.exit(run(parser.parse_args()))


if __name__ == "__main__":
    main()
