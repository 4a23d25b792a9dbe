"""Host memory of a whole run against model size, with weights and optimizer state on disk
and one host budget (issue 23): bf16 Llama-shaped models of ~0.25B to ~2B parameters each
train a few steps with one worker and one state server, every unit's weights in files
(``worker.weights_nvme_path``) and ``cluster.host_memory_bytes`` for every process of the
run (the planner gives the state server's RAM tier what the others leave; the rest of the
optimizer state in partition files). A tiny model measures what each process holds
whatever the model (its runtime). Each process's peak is read from /proc, not from
cargohold's counters.

    python benchmarks/host_memory.py                          # tiny, 0.25B, 0.5B, 1B, 2B; ~35 min
    python benchmarks/host_memory.py --sizes 0.25 --steps 2   # one size, a quick look
    python benchmarks/host_memory.py --root /mnt/nvme0/bench  # the files on another drive

Each size runs in a fresh driver process (``--child``) that starts its own local Ray, a
``TrainingSession`` and the steps. Reported per process (worker, state server, driver)
and summed: peak RSS (``VmHWM`` of /proc/<pid>/status, read once after the steps: a
high-water mark needs no sampling) and peak PSS (``Pss`` of /proc/<pid>/smaps_rollup,
sampled once a second by a thread of the driver: the one number here that needs a
sampler, cheap at that rate, and the driver's CPU time over the steps is printed to show
it; PSS splits the shared-memory exchange buffers between the worker and the server that
both map them, so the PSS sum counts them once). Ray's own daemons (raylet, GCS) are
listed apart: they do not grow with the model. Beside the measurements, the plan's
figures for the same config (``cargohold plan``'s host peak of the worker, RAM peak of
the server and the driver's, runtimes included) and the NVMe bytes per step, measured by
the metrics endpoints and planned. Seconds per step are the mean of the steps after the
first. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

SIZES = {
    # name: (hidden, layers, intermediate, heads) of a Llama with a 32000-token vocabulary
    "tiny": (128, 2, 344, 4),  # ~8M: what each process holds whatever the model (its runtime)
    "0.25": (1024, 16, 2816, 16),
    "0.5": (1536, 16, 4096, 12),
    "1": (2048, 16, 5632, 16),
    "2": (2048, 36, 5632, 16),
}
GiB = 1 << 30


def label(size: str) -> str:
    """A size as the tables name it: "0.25B", "tiny"."""
    return f"{size}B" if size[0].isdigit() else size


def llama_folder(folder: Path, hidden: int, layers: int, intermediate: int, heads: int) -> Path:
    """A Llama ``config.json`` (fresh weights, no checkpoint) in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": hidden // heads,
        "vocab_size": 32000,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "initializer_range": 0.02,
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def overrides(model: Path, root: Path, args: argparse.Namespace) -> list[str]:
    """W=1, S=1, bf16 weights and wire, units no larger than ``--max-unit-params`` (blocks
    split into attention and MLP projections, the embeddings and head apart) with their
    weights in files (a window of 2), one host budget of ``--budget-gib`` for every process
    (the planner gives the state server's RAM tier what the others leave; the rest of the
    optimizer state in files); one sequence per step."""
    return [
        f"steps={args.steps}",
        f"hf.config_path={model}",
        "data.format=bytes",
        f"data.block_size={args.seq}",
        "data.batch_size=1",
        "data.corpus_bytes=200000",
        "optim.lr=1e-4",
        "worker.num_workers=1",
        "worker.cpus=2",
        "worker.compute_dtype=bfloat16",
        "tuning.worker.grad_wire_dtype=bfloat16",
        "worker.activation_checkpointing=blocks",
        f"worker.weights_nvme_path={root / 'weights'}",
        "tuning.worker.weight_window=2",
        f"worker.max_unit_params={args.max_unit_params}",
        "tuning.worker.exchange_slots=1",
        "state_server.num_servers=1",
        "state_server.cpus=2",
        "tuning.state_server.rpc_threads=1",
        f"state_server.tier.nvme_paths=[{root / 'state'}]",
        f"cluster.host_memory_bytes={int(args.budget_gib * GiB)}",
        f"tuning.state_server.tier.partition_bytes={args.partition_mib << 20}",
        "tuning.state_server.tier.buffer_count=2",
        "tuning.cluster.startup_timeout_s=1800",
        "tuning.state_server.rpc_timeout_s=1800",
    ]


# --- reading /proc ------------------------------------------------------------------------
def status_bytes(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def pss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            line = next(line for line in rollup if line.startswith("Pss:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration):
        return 0


class PssPeaks:
    """The highest PSS seen of each pid, sampled once a second."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.peaks = dict.fromkeys(pids, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self.sample()

    def sample(self) -> None:
        for name, pid in self.pids.items():
            self.peaks[name] = max(self.peaks[name], pss_bytes(pid))

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        self.sample()
        return self.peaks


def scrape(address: str, names: tuple[str, ...]) -> dict[str, float]:
    """The samples of ``names`` an endpoint serves, by name and ``op`` label."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as reply:
        families = text_string_to_metric_families(reply.read().decode())
    found: dict[str, float] = {}
    for family in families:
        for sample in family.samples:
            if sample.name in names:
                key = sample.name + (f"{{op={sample.labels['op']}}}" if "op" in sample.labels else "")
                found[key] = found.get(key, 0.0) + sample.value
    return found


def nvme_bytes(targets: list[str]) -> dict[str, float]:
    """Every endpoint's NVMe byte counters, summed by name."""
    total: dict[str, float] = {}
    for address in targets:
        for key, value in scrape(address, NVME_BYTES).items():
            total[key] = total.get(key, 0.0) + value
    return total


NVME_BYTES = (
    "cargohold_tier_read_bytes_total",
    "cargohold_tier_write_bytes_total",
    "cargohold_worker_weight_file_bytes_total",
)


# --- one size, in its own driver process --------------------------------------------------
def child(args: argparse.Namespace) -> None:
    import ray

    from cargohold.cluster.launcher import TrainingSession
    from cargohold.cluster.plan.run import plan_run
    from cargohold.cluster.schema.io import load_config

    root = Path(args.root)
    model = llama_folder(root / "model", *SIZES[args.size])
    config = load_config(None, [*overrides(model, root, args), f"run_id=hostmem-{os.getpid()}"])
    plan = plan_run(config)
    ray.init(address="local", num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    seconds = []
    try:
        with TrainingSession(config) as session:
            pids = {
                "worker": ray.get(session.workers[0].__ray_call__.remote(lambda _: os.getpid())),
                "server": ray.get(session.servers[0].__ray_call__.remote(lambda _: os.getpid())),
                "driver": os.getpid(),
            }
            targets = [t.address for t in session.metrics_targets()]
            pss = PssPeaks(pids)
            driver_cpu = time.process_time()
            before: dict[str, float] = {}
            for number in range(args.steps):
                if number == args.steps - 1:
                    before = nvme_bytes(targets)
                started = time.perf_counter()
                session.step()
                seconds.append(time.perf_counter() - started)
            after = nvme_bytes(targets)
            nvme_by_kind = {key: value - before.get(key, 0.0) for key, value in after.items()}
            nvme_step = sum(nvme_by_kind.values())
            driver_cpu = time.process_time() - driver_cpu  # the sampler's and the launcher's, all steps
            hwm = {name: status_bytes(pid, "VmHWM") for name, pid in pids.items()}
            peaks = pss.stop()
            daemons = {p.name(): p.memory_info().rss for p in _ray_daemons() if p.name() in ("raylet", "gcs_server")}
    finally:
        ray.shutdown()
    w, s = plan.worker, plan.servers[0]
    print(
        json.dumps(
            {
                "size": args.size,
                "parameters": plan.parameters,
                "hwm": hwm,
                "pss": peaks,
                "daemons": daemons,
                "seconds": seconds,
                "driver_cpu_s": driver_cpu,
                "nvme_step": nvme_step,
                "nvme_by_kind": nvme_by_kind,
                "tier_budget": session.config.state_server.tier.ram_budget_bytes,
                "plan": {
                    "worker": w.host_peak_bytes,
                    "server": s.ram_peak_bytes,
                    "driver": plan.driver_bytes,
                    # The worker's shared exchange buffers: in the worker's plan, mapped by the
                    # server too, so they count in both RSS (the PSS splits them).
                    "server_mapped": w.shared_memory_bytes,
                    "nvme_step": w.traffic.weight_read_bytes
                    + w.traffic.weight_write_bytes
                    + s.traffic.nvme_read_bytes
                    + s.traffic.nvme_write_bytes,
                    "nvme_by_kind": {
                        "weight_read": w.traffic.weight_read_bytes,
                        "weight_write": w.traffic.weight_write_bytes,
                        "tier_read": s.traffic.nvme_read_bytes,
                        "tier_write": s.traffic.nvme_write_bytes,
                    },
                },
            }
        )
    )


def _ray_daemons():
    import psutil

    return [p for p in psutil.process_iter(["name"]) if p.info["name"] in ("raylet", "gcs_server")]


# --- the table ----------------------------------------------------------------------------
def gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, of {list(SIZES)}")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--partition-mib", type=int, default=64)
    parser.add_argument(
        "--max-unit-params",
        type=int,
        default=40_000_000,
        help="worker.max_unit_params (0: a unit per block, the embeddings and head in the root)",
    )
    parser.add_argument(
        "--budget-gib", type=float, default=3.0, help="cluster.host_memory_bytes: every process of the run together"
    )
    parser.add_argument("--root", default=None, help="folder for the files (default: a temporary one)")
    parser.add_argument(
        "--table-from",
        nargs="+",
        metavar="LOG",
        help="print the table of earlier runs from their stderr ('<size> done: {...}' lines) instead of running",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--size", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    if args.table_from:
        done = [line.split(" done: ", 1)[1] for log in args.table_from for line in Path(log).read_text().splitlines()]
        report([json.loads(row) for row in done if row], args.budget_gib)
        return
    rows = []
    for size in args.sizes.split(","):
        root = Path(tempfile.mkdtemp(prefix=f"cargohold-hostmem-{size}-", dir=args.root))
        try:
            command = [sys.executable, __file__, "--child", "--size", size, "--root", str(root)]
            command += ["--steps", str(args.steps), "--seq", str(args.seq)]
            command += ["--budget-gib", str(args.budget_gib), "--partition-mib", str(args.partition_mib)]
            command += ["--max-unit-params", str(args.max_unit_params)]
            done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
            if done.returncode != 0:
                print(f"size {label(size)} failed:\n{done.stderr[-4000:]}", file=sys.stderr)
                continue
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        finally:
            shutil.rmtree(root, ignore_errors=True)
        row = rows[-1]
        print(f"{label(size)} done: {json.dumps(row)}", file=sys.stderr)
    report(rows, args.budget_gib)


def report(rows: list[dict], budget_gib: float) -> None:
    """The table and a RATIO line per size."""
    print(
        "| model | parameters | worker RSS / PSS | server RSS / PSS | driver RSS | sum RSS / PSS (GiB) "
        "| plan worker / server | s/step | NVMe GB/step (plan) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        h, p, plan = r["hwm"], r["pss"], r["plan"]
        timed = r["seconds"][1:] or r["seconds"]
        print(
            f"| {label(r['size'])} | {r['parameters'] / 1e9:.2f}B | {gib(h['worker'])} / {gib(p['worker'])} "
            f"| {gib(h['server'])} / {gib(p['server'])} | {gib(h['driver'])} "
            f"| {gib(sum(h.values()))} / {gib(sum(p.values()))} | {gib(plan['worker'])} / {gib(plan['server'])} "
            f"| {sum(timed) / len(timed):.1f} | {r['nvme_step'] / 1e9:.1f} ({plan['nvme_step'] / 1e9:.1f}) |"
        )
    budget = budget_gib * GiB
    for r in rows:
        total = sum(r["pss"].values())
        print(
            f"RATIO {label(r['size'])} PSS sum / budget {budget_gib:g} GiB = {total / budget:.2f}; "
            f"worker RSS / plan = {r['hwm']['worker'] / r['plan']['worker']:.2f}, "
            f"server RSS / (plan + mapped exchange) = "
            f"{r['hwm']['server'] / (r['plan']['server'] + r['plan']['server_mapped']):.2f}, "
            f"driver RSS / plan = {r['hwm']['driver'] / r['plan']['driver']:.2f}; "
            f"RAM tier {gib(r['tier_budget'] or 0)} GiB; driver CPU {r['driver_cpu_s']:.2f} s over the steps; "
            f"Ray daemons {', '.join(f'{k} {gib(v)} GiB' for k, v in r['daemons'].items())}"
        )


if __name__ == "__main__":
    main()
