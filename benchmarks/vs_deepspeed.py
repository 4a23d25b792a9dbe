"""cargohold against DeepSpeed ZeRO-Offload and ZeRO-Infinity on the same machine: the same
model, initial values, data, batch, thread budget and optimizer settings, one run after the
other in one invocation, so the ratios compare like with like on whatever the box is doing.

    pip install -e '.[bench]'        # DeepSpeed 0.19.8: never in the default or test install
    python benchmarks/vs_deepspeed.py                        # zero2, zero3, nvme; examples/demo.yaml
    python benchmarks/vs_deepspeed.py --variants zero3 --steps 10
    python benchmarks/vs_deepspeed.py --set model.n_layer=12 --set model.n_embd=768

Variants, cargohold / DeepSpeed:

* zero2: ``worker.reshard_after_forward=false`` (each unit gathered once a step), the
  optimizer state in the state servers' RAM / ZeRO-2 with ``offload_optimizer: cpu``;
* zero3: ``worker.reshard_after_forward=true`` (gathered for forward and again for
  backward) / ZeRO-3 with ``offload_optimizer`` and ``offload_param`` on the CPU;
* nvme: zero3 with the optimizer state on the NVMe tier under a RAM budget of a quarter of
  it (``state_server.tier``, partitions of 8 MiB: ``--partition-mib``) / ZeRO-3
  (ZeRO-Infinity) with ``offload_optimizer: nvme`` (libaio, ``aio`` settings below) and
  ``offload_param: cpu``; both write under ``--root``.

Both sides build the model with ``build_model`` (cargohold's GPT or the config's
Hugging Face model, the same initial values), train on ``open_source``'s batches
(rank r's rows of each step on both: what cargohold's workers read), with AdamW (betas, eps, weight decay, the
scheduled lr of each step), clipping at ``optim.max_grad_norm``, fp32 or the config's compute
dtype (DeepSpeed's bf16 mode), ``worker.num_workers`` ranks over gloo with
``worker.torch_threads`` threads each (DeepSpeed's CPU Adam with as many OpenMP threads).
cargohold's state servers run beside its workers on the same cores: a CPU box shares them,
and so does DeepSpeed's CPU Adam, which runs in its ranks. Where the workers compute on
CUDA (``worker.gpus`` above 0), DeepSpeed's ranks do
too: one GPU each (``DS_ACCELERATOR=cuda``, NCCL), their offload buffers pinned.

Timed: the steps after ``--warmup``; a step is ``TrainingSession.step()`` for cargohold and
forward + ``engine.backward`` + ``engine.step`` on each DeepSpeed rank (its slowest rank's
mean). Per process: the C allocator it runs (``/proc/<pid>/maps``), CPU seconds per timed
step, user and system (``/proc/<pid>/stat`` read at the window's edges: nothing samples
during it), the bytes it read from and wrote to disk per timed step (``/proc/<pid>/io``,
the same way), and peak RSS (VmHWM, read once after the steps). The driver's own CPU
seconds are printed too, and the whole box over the same window (``/proc/stat``): its
cores' busy share, the CPU seconds the hypervisor stole and those of processes other than
the measured ones (Ray's own among them on cargohold's side), per timed step: a run whose
stolen or other seconds stand out was disturbed from outside and says so. Each variant prints
``RATIO cargohold <v> / deepspeed <v>``. Nothing is asserted.

``--repeat N`` runs every variant's pair N times, alternating (cargohold, DeepSpeed,
cargohold, ...), and gives each variant's median ratio with every run's: on a small shared
box one pair's ratio moves by about +-0.1 from run to run.

``--profile`` (a separate run: the sampler takes CPU from what it watches) records
cargohold's worker 0 and DeepSpeed's rank 0 with py-spy (``pip install py-spy``) over the
timed steps (threads that run, not those that wait), and prints where each spends them: the
functions with the most samples under them and the most of their own, per timed step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from timing import CLOCK_TICKS, cpu_seconds

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo.yaml"
VARIANTS = ("zero2", "zero3", "nvme")
CARGOHOLD_SETTINGS = {
    "zero2": ["worker.reshard_after_forward=false"],
    "zero3": ["worker.reshard_after_forward=true"],
    "nvme": ["worker.reshard_after_forward=true"],
}
PROFILE_RATE = 100
"""py-spy samples per second with ``--profile``."""


def disk_bytes(pid: int) -> tuple[int, int]:
    """Bytes a process has had read from and written to storage so far (``/proc/<pid>/io``:
    what reached the block layer, not page-cache hits), every thread's; 0 once it is gone."""
    try:
        fields = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    except OSError:
        return 0, 0
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def box_seconds() -> tuple[float, float, float]:
    """The whole machine's CPU seconds so far, all cores added up (``/proc/stat``): busy
    (user, nice, system, interrupts), stolen by the hypervisor, and in all."""
    fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq) / CLOCK_TICKS, steal / CLOCK_TICKS, sum(fields) / CLOCK_TICKS


def box_since(before: tuple[float, float, float]) -> list[float]:
    """The whole machine's busy, stolen and total CPU seconds since ``before``."""
    return [after - then for after, then in zip(box_seconds(), before)]


def box_per_step(window: list[float], steps: int, processes: float) -> dict:
    """What the whole machine did per timed step over ``window`` (:func:`box_since`): its
    cores' busy share, CPU seconds stolen by the hypervisor and those of processes other
    than the measured ones (``processes``: their CPU seconds per step). A run with either
    well above zero was disturbed by something outside it."""
    busy, steal, total = window
    return {
        "busy": busy / max(total, 1e-9),
        "steal": steal / steps,
        "others": max(0.0, busy / steps - processes),
    }


def describe_box(box: dict) -> str:
    return (
        f"box {100 * box['busy']:.0f}% busy, {box['steal']:.2f} CPU-s stolen, "
        f"{box['others']:.2f} CPU-s of other processes"
    )


def peak_rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def load(config_path: str, overrides: list[str]):
    from cargohold.cluster.schema.io import load_config

    return load_config(config_path, overrides)


# --- profiles (py-spy) ----------------------------------------------------------------------
def start_profile(pid: int, path: Path) -> subprocess.Popen:
    """py-spy recording ``pid``'s running threads (idle ones left out) into ``path`` until
    stopped; native code shows as the Python call that entered it."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    command = [py_spy, "record", "--pid", str(pid), "--rate", str(PROFILE_RATE), "--format", "raw"]
    return subprocess.Popen([*command, "--output", str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop_profile(recorder: subprocess.Popen) -> None:
    recorder.send_signal(2)  # SIGINT: py-spy writes what it recorded and exits
    recorder.wait(timeout=60)


def frame_name(frame: str) -> str:
    """``function (file.py:line)`` -> ``function (file.py)``: lines of one function merge."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rsplit(':', 1)[0].rsplit('/', 1)[-1].rstrip(')')})" if where else name


def summarise_profile(path: Path, steps: int, top: int = 12) -> str:
    """The functions with the most samples under them (inclusive) and of their own (self),
    as seconds per timed step, from py-spy's raw (collapsed stacks) output."""
    inclusive: dict[str, int] = {}
    own: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines() if path.exists() else []:
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [frame_name(f) for f in stack.split(";")]
        for name in set(frames[1:]):  # the first frame names the thread
            inclusive[name] = inclusive.get(name, 0) + n
        own[frames[-1]] = own.get(frames[-1], 0) + n
    per_step = 1.0 / PROFILE_RATE / steps

    def rows(counts: dict[str, int]) -> list[str]:
        ranked = sorted(counts.items(), key=lambda item: -item[1])[:top]
        return [f"    {n * per_step:7.3f} s  {100 * n / max(total, 1):5.1f}%  {name[:110]}" for name, n in ranked]

    return "\n".join(
        [
            f"  {total * per_step:.3f} s of samples per timed step (threads added up)",
            "  most samples under them:",
            *rows(inclusive),
            "  most samples of their own:",
            *rows(own),
        ]
    )


# --- cargohold ------------------------------------------------------------------------------
def nvme_tier_settings(config, root: Path, partition_mib: float) -> list[str]:
    """The state on the NVMe tier under ``root`` in partitions of ``partition_mib``, a RAM
    budget of a quarter of it (at least the staging buffers and one resident partition)."""
    import torch

    from cargohold.cluster.schema.server import TierConfig
    from cargohold.cluster.sections import model_spec
    from cargohold.services.models.build import build_model

    with torch.device("meta"):
        parameters = sum(p.numel() for p in build_model(model_spec(config), config.data).parameters())
    partition = int(partition_mib * (1 << 20)) // 4096 * 4096
    staging = TierConfig(partition_bytes=partition, buffer_count=3).staging_bytes()
    per_server = 12 * parameters // config.state_server.num_servers
    budget = max(per_server // 4, staging + partition)
    return [
        f"state_server.tier.nvme_paths=[{root / 'cargohold-nvme'}]",
        f"state_server.tier.ram_budget_bytes={budget}",
        f"tuning.state_server.tier.partition_bytes={partition}",
        "tuning.state_server.tier.buffer_count=3",
    ]


def run_cargohold(config, warmup: int, profile: Path | None = None, profiled: str = "worker 0") -> dict:
    """Mean step seconds after ``warmup``; each worker's and server's CPU seconds and disk
    bytes per timed step and peak RSS; the driver's CPU seconds per timed step. ``profile``: record the
    process named ``profiled`` ("worker 0", "server 0", ...) with py-spy into it."""
    import ray

    from cargohold.cluster.launcher import TrainingSession
    from cargohold.services.worker.host_allocator import loaded_allocator

    needed = config.worker.num_workers * config.worker.cpus + config.state_server.num_servers * config.state_server.cpus
    ray.init(
        address="local",
        num_cpus=max(1, math.ceil(needed)),
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
    )
    try:
        with TrainingSession(config) as session:
            pids = {
                f"worker {rank}": ray.get(actor.__ray_call__.remote(lambda _: os.getpid()))
                for rank, actor in enumerate(session.workers)
            }
            pids |= {
                f"server {index}": ray.get(actor.__ray_call__.remote(lambda _: os.getpid()))
                for index, actor in enumerate(session.servers)
            }
            allocators = {name: loaded_allocator(Path(f"/proc/{pid}/maps")) for name, pid in pids.items()}
            seconds, losses, phases = [], [], []
            recorder = None
            for number in range(config.steps):
                if number == warmup:
                    if profile is not None:
                        recorder = start_profile(pids[profiled], profile)
                        time.sleep(1.0)  # py-spy attaches
                    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
                    disk_before = {name: disk_bytes(pid) for name, pid in pids.items()}
                    driver = time.process_time()
                    box = box_seconds()
                report = session.step()
                seconds.append(report.seconds)
                losses.append(report.loss)
                phases.append(report.phases)
            if recorder is not None:
                stop_profile(recorder)
            kept = config.steps - warmup
            cpu = {
                name: tuple((after - then) / kept for after, then in zip(cpu_seconds(pid), before[name]))
                for name, pid in pids.items()
            }
            disk = {
                name: tuple((after - then) / kept for after, then in zip(disk_bytes(pid), disk_before[name]))
                for name, pid in pids.items()
            }
            driver = (time.process_time() - driver) / kept
            box_step = box_per_step(box_since(box), kept, sum(map(sum, cpu.values())) + driver)
            peaks = {name: peak_rss(pid) for name, pid in pids.items()}
    finally:
        ray.shutdown()
    return {
        "step": statistics.mean(seconds[warmup:]),
        "phases": {name: statistics.mean(p.get(name, 0.0) for p in phases[warmup:]) for name in phases[-1]},
        "cpu": cpu,
        "disk": disk,
        "peak": peaks,
        "allocator": allocators,
        "driver_cpu": driver,
        "box": box_step,
        "losses": losses,
    }


# --- DeepSpeed, in a child process: ranks spawned over gloo (NCCL on GPUs) -----------------
def on_gpu(config) -> bool:
    """Whether the workers compute on CUDA, as cargohold's decide (``worker.gpus`` above 0)."""
    return config.worker.on_gpus


def zero_setting(item: str) -> tuple[str, object]:
    """``KEY=VALUE`` of ``--deepspeed-zero``, the value JSON; ValueError naming what is wrong."""
    key, equals, value = item.partition("=")
    if not key or not equals:
        raise ValueError(f"--deepspeed-zero {item!r}: expected KEY=VALUE")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError as error:
        raise ValueError(f"--deepspeed-zero {item!r}: the value is not JSON ({error})") from None


def deepspeed_config(config, variant: str, root: Path, zero_settings: list[str]) -> dict:
    """DeepSpeed's settings for ``variant``; ``zero_settings`` (``KEY=VALUE``, the value
    JSON) go into its ``zero_optimization`` last, e.g. ``stage3_max_reuse_distance=0``."""
    o, w = config.optim, config.worker
    pin = on_gpu(config)
    zero: dict = {"overlap_comm": False, "contiguous_gradients": True}
    if variant == "zero2":
        zero |= {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": pin}}
    elif variant == "zero3":
        zero |= {
            "stage": 3,
            "offload_optimizer": {"device": "cpu", "pin_memory": pin},
            "offload_param": {"device": "cpu", "pin_memory": pin},
        }
    else:
        zero |= {
            "stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": str(root / "deepspeed-nvme"), "pin_memory": pin},
            "offload_param": {"device": "cpu", "pin_memory": pin},
        }
    settings = {
        "train_batch_size": w.num_workers * config.data.batch_size,
        "train_micro_batch_size_per_gpu": config.data.batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": o.max_grad_norm,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": o.lr, "betas": list(o.betas), "eps": o.eps, "weight_decay": o.weight_decay},
        },
        "bf16": {"enabled": w.compute_dtype == "bfloat16"},
        "fp16": {"enabled": False},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    zero |= dict(zero_setting(item) for item in zero_settings)
    if variant == "nvme":
        settings["aio"] = {
            "block_size": 1 << 20,
            "queue_depth": 8,
            "thread_count": 1,
            "single_submit": False,
            "overlap_events": True,
        }
    return settings


def deepspeed_rank(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    world_config = load(args.config, args.overrides)
    world = world_config.worker.num_workers
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import deepspeed
    import torch
    import torch.distributed as dist

    from cargohold.cluster.sections import config_task, model_spec
    from cargohold.services.models.build import build_model
    from cargohold.services.worker.host_allocator import loaded_allocator

    config = world_config
    torch.set_num_threads(config.worker.torch_threads)
    gpu = on_gpu(config)
    if gpu:
        torch.cuda.set_device(rank)
    deepspeed.init_distributed(dist_backend="nccl" if gpu else "gloo")
    model = build_model(model_spec(config), config.data)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=deepspeed_config(config, args.variant, Path(args.root), args.deepspeed_zero),
    )
    data = config_task(config).open_data()
    seconds, losses = [], []
    for step in range(1, config.steps + 1):
        batch = data.batch(step, rank)
        x, y = batch.inputs.to(engine.device), batch.targets.to(engine.device)
        if step == args.warmup + 1:
            if args.profile and rank == 0:
                recorder = start_profile(os.getpid(), Path(out, "profile.txt"))
                time.sleep(1.0)  # py-spy attaches
            dist.barrier()
            cpu, disk, box = cpu_seconds(os.getpid()), disk_bytes(os.getpid()), box_seconds()
        for group in engine.optimizer.param_groups:
            group["lr"] = config.optim.lr_at(step, config.steps)
        started = time.perf_counter()
        output = engine(x, y)
        loss = output[1] if isinstance(output, tuple) else output.loss
        engine.backward(loss)
        engine.step()
        if gpu:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)  # outside the timed region
        losses.append(mean.item() / world)
    kept = config.steps - args.warmup
    if args.profile and rank == 0:
        stop_profile(recorder)
    result = {
        "rank": rank,
        "step": statistics.mean(seconds[args.warmup :]),
        "cpu": [(after - then) / kept for after, then in zip(cpu_seconds(os.getpid()), cpu)],
        "disk": [(after - then) / kept for after, then in zip(disk_bytes(os.getpid()), disk)],
        "peak": peak_rss(os.getpid()),
        "box": box_since(box),
        "allocator": loaded_allocator(),
        "losses": losses,
        "optimizer": type(engine.optimizer).__name__,
    }
    Path(out, f"rank-{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def deepspeed_child(args: argparse.Namespace) -> None:
    import torch.multiprocessing as mp

    config = load(args.config, args.overrides)
    mp.spawn(deepspeed_rank, args=(args, args.port, args.out), nprocs=config.worker.num_workers, join=True)


def run_deepspeed(args: argparse.Namespace, variant: str, root: Path, port: int) -> dict | str:
    """The slowest rank's mean step, each rank's CPU seconds and disk bytes per timed step
    and peak RSS; or why it could not run."""
    out = root / f"deepspeed-{variant}"
    out.mkdir()
    command = [sys.executable, __file__, "--deepspeed-child", "--variant", variant, "--config", args.config]
    command += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--root", str(root)]
    command += ["--port", str(port), "--out", str(out)] + (["--profile"] if args.profile else [])
    command += [item for override in args.overrides for item in ("--set", override)]
    command += [item for setting in args.deepspeed_zero for item in ("--deepspeed-zero", setting)]
    config = load(args.config, args.overrides)
    accelerator = "cuda" if on_gpu(config) else "cpu"
    env = dict(os.environ, DS_ACCELERATOR=accelerator, OMP_NUM_THREADS=str(config.worker.torch_threads))
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600)
    ranks = sorted(out.glob("rank-*.json"))
    if done.returncode != 0 or not ranks:
        return (done.stderr or done.stdout).strip().splitlines()[-1] if (done.stderr or done.stdout) else "failed"
    results = [json.loads(path.read_text()) for path in ranks]
    kept = args.steps - args.warmup
    ranks_cpu = sum(sum(r["cpu"]) for r in results)
    return {  # the box over rank 0's window: the ranks start it together (a barrier)
        "box": box_per_step(results[0]["box"], kept, ranks_cpu),
        "step": max(r["step"] for r in results),
        "cpu": {f"rank {r['rank']}": r["cpu"] for r in results},
        "disk": {f"rank {r['rank']}": r["disk"] for r in results},
        "peak": {f"rank {r['rank']}": r["peak"] for r in results},
        "allocator": {f"rank {r['rank']}": r["allocator"] for r in results},
        "losses": results[0]["losses"],
        "optimizer": results[0]["optimizer"],
        "profile": str(out / "profile.txt"),
    }


# --- the table ------------------------------------------------------------------------------
def describe_disk(read: float, written: float) -> str:
    """A process's disk traffic per timed step, or nothing where it had none."""
    return f" disk {read / 1e9:.2f} GB read {written / 1e9:.2f} GB written" if read + written >= 1e6 else ""


def describe(result: dict) -> str:
    processes = ", ".join(
        f"{name} ({result['allocator'][name]}) {sum(result['cpu'][name]):.2f} CPU-s "
        f"({result['cpu'][name][1]:.2f} system) {result['peak'][name] / 2**30:.2f} GiB"
        f"{describe_disk(*result['disk'][name])}"
        for name in result["cpu"]
    )
    return f"{result['step']:7.3f} s/step; per timed step: {processes}; {describe_box(result['box'])}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(DEMO))
    parser.add_argument("--steps", type=int, default=8, help="steps per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the means")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--root", default=None, help="folder for the NVMe variants' files (default: a temporary one)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--partition-mib",
        type=float,
        default=8.0,
        help="the nvme variant's partition size (its RAM budget: 1/4); DeepSpeed moves whole sub-groups "
        "(sub_group_size, 1e9 elements: all of a rank's state here), and 8 MiB is the largest that leaves the demo's "
        "budget a quarter of its state",
    )
    parser.add_argument("--profile", action="store_true", help="record worker 0 and rank 0 with py-spy (not timed)")
    parser.add_argument(
        "--profile-process", default="worker 0", help='with --profile, the cargohold process: "worker R" or "server I"'
    )
    parser.add_argument(
        "--deepspeed-zero",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting of DeepSpeed's zero_optimization (VALUE in JSON), e.g. stage3_max_reuse_distance=0",
    )
    parser.add_argument("--repeat", type=int, default=1, help="run each variant's pair this many times")
    parser.add_argument("--cargohold-only", action="store_true", help="skip DeepSpeed (no ratio): an A/B of settings")
    parser.add_argument("--deepspeed-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.overrides = [f"steps={args.steps}", "metrics.port=null", *args.overrides]
    if args.deepspeed_child:
        deepspeed_child(args)
        return
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    for item in args.deepspeed_zero:
        try:
            zero_setting(item)
        except ValueError as error:
            parser.error(str(error))
    names = args.variants.split(",")
    if unknown := [n for n in names if n not in VARIANTS]:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    with tempfile.TemporaryDirectory(prefix="vs-deepspeed-", dir=args.root) as folder:
        root = Path(folder)
        print(f"load average {Path('/proc/loadavg').read_text().split()[0]} at the start", flush=True)
        results: dict[str, list[tuple[dict, dict | str]]] = {name: [] for name in names}
        for run in range(args.repeat):
            run_root = root / f"run-{run}"  # each run's files apart: nothing carries over
            run_root.mkdir()
            for number, name in enumerate(names):
                ours, theirs = run_pair(args, name, run_root, port=29600 + run * len(names) + number)
                results[name].append((ours, theirs))
        config = load(args.config, args.overrides)
    m, w = config.model, config.worker
    print(
        f"\nmodel {m.n_layer} x {m.n_embd}, {w.num_workers} ranks x batch {config.data.batch_size} x "
        f"{m.block_size} tokens, {w.torch_threads} thread(s) each, compute {w.compute_dtype}; "
        f"{config.state_server.num_servers} cargohold state server(s); {os.cpu_count()} cores; load average "
        f"{Path('/proc/loadavg').read_text().split()[0]} at the end; mean of steps {args.warmup + 1}..{args.steps}"
    )
    for name, pairs in results.items():
        for ours, theirs in pairs:
            print(f"cargohold {name:6} {describe(ours)}; driver {ours['driver_cpu']:.3f} CPU-s")
            split = ", ".join(f"{phase} {seconds:.3f} s" for phase, seconds in ours["phases"].items())
            print(f"  cargohold's step by phase (rank 0): {split}")
            if isinstance(theirs, dict):
                zero = f"; zero_optimization {', '.join(args.deepspeed_zero)}" if args.deepspeed_zero else ""
                print(f"deepspeed {name:6} {describe(theirs)} ({theirs['optimizer']}{zero})")
                same = "the same" if ours["losses"] == theirs["losses"] else "not the same"
                print(
                    f"  losses: cargohold {ours['losses'][-1]:.4f}, deepspeed {theirs['losses'][-1]:.4f} at the "
                    f"last step ({same} bits)"
                )
    for name, pairs in results.items():
        print(f"RATIO cargohold {name} / deepspeed {name} = {ratio_line(pairs)}")


def run_pair(args: argparse.Namespace, name: str, root: Path, port: int) -> tuple[dict, dict | str]:
    """One variant: cargohold's run, then DeepSpeed's (or why it did not run), files under ``root``."""
    config = load(args.config, [*args.overrides, *CARGOHOLD_SETTINGS[name]])
    if name == "nvme":
        tier = nvme_tier_settings(config, root, args.partition_mib)
        config = load(args.config, [*args.overrides, *CARGOHOLD_SETTINGS[name], *tier])
    profile = root / f"cargohold-{name}.txt" if args.profile else None
    ours = run_cargohold(config, args.warmup, profile, args.profile_process)
    theirs = "skipped" if args.cargohold_only else run_deepspeed(args, name, root, port=port)
    print(f"{name}: cargohold {describe(ours)}", flush=True)
    print(f"{name}: deepspeed {describe(theirs) if isinstance(theirs, dict) else 'did not run: ' + theirs}")
    if profile is not None:
        kept = args.steps - args.warmup
        print(f"profile of cargohold {name}, {args.profile_process}:\n{summarise_profile(profile, kept)}")
        if isinstance(theirs, dict):
            print(f"profile of deepspeed {name}, rank 0:\n{summarise_profile(Path(theirs['profile']), kept)}")
    return ours, theirs


def ratio_line(pairs: list[tuple[dict, dict | str]]) -> str:
    """cargohold's step over DeepSpeed's: the one run's, or the median of the runs with each."""
    ratios = [ours["step"] / theirs["step"] for ours, theirs in pairs if isinstance(theirs, dict)]
    if not ratios:
        reason = next(theirs for _, theirs in pairs if isinstance(theirs, str))
        return f"n/a (deepspeed did not run: {reason})"
    if len(pairs) == 1:
        return f"{ratios[0]:.2f}"
    return f"{statistics.median(ratios):.2f} (median of {len(ratios)} runs: {', '.join(f'{r:.2f}' for r in ratios)})"


if __name__ == "__main__":
    main()
