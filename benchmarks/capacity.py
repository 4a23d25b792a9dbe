"""The largest GPT each approach trains within a per-worker memory limit, found by running.

    python benchmarks/capacity.py                                   # 2 GiB, plain vs cargohold fp32
    python benchmarks/capacity.py --approaches cargohold --dtype bfloat16
    python benchmarks/capacity.py --limit-gib 4 --probes 5

Candidates are GPTs of ``--n-layer`` blocks (byte vocabulary, block 128) whose width grows
in steps of 64. For each approach a binary search of ``--probes`` runs over the widths
whose estimated footprint is below 1.6 x the limit; a candidate fits when the measured
peak resident set (``VmHWM`` in /proc/<pid>/status: the high-water mark of RSS, which
counts the interpreter, torch, gRPC and Ray's core worker too) stays within the limit.

* plain: a fresh process builds the fp32 model, runs 2 steps of forward/backward and
  ``torch.optim.AdamW(fused=True)`` (weights, grads, exp_avg, exp_avg_sq: 16 B/param).
* cargohold: a ``TrainingSession`` with 2 workers and 1 state server runs 1 step (every
  buffer exists from construction on); the worker's figure is the larger of the two
  workers' VmHWM, read from inside each actor (their RSS after the step is printed too:
  the steady state, below the peak that the worker's construction reaches). The state
  server's memory is host RAM outside the worker: reported, not counted against the limit.

Both run one sequence of 128 tokens per worker per step (activations are small next to
the states) on 1 thread. Nothing is asserted; the limit is compared, not enforced.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

from cargohold.services.models.gpt import GPT, GPTConfig, num_parameters

BLOCK = 128
ESTIMATE_BYTES_PER_PARAM = {"plain": 16, ("cargohold", "float32"): 12, ("cargohold", "bfloat16"): 7}
"""Rough peak bytes per parameter, only to bound the search: plain AdamW 4 x 4; a cargohold
worker at W=2 holds weights, grads and two half-size shards (fp32 12, bf16 2 + 2 + 3); its
construction, which moves the fp32 model into the flat buffer one parameter at a time,
stays below that."""
BASE_BYTES = 600 << 20
"""Rough interpreter + torch (+ Ray) resident memory, only to bound the search."""


def peak_rss(status: str, field: str = "VmHWM") -> int:
    """VmHWM (or another Vm field) in bytes from the text of /proc/<pid>/status."""
    line = next(line for line in status.splitlines() if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def gpt_config(n_layer: int, width: int) -> GPTConfig:
    return GPTConfig(vocab_size=256, block_size=BLOCK, n_layer=n_layer, n_head=width // 64, n_embd=width)


def params_of(config: GPTConfig) -> int:
    with torch.device("meta"):
        return num_parameters(GPT(config))


# --- plain AdamW, one process --------------------------------------------------------
def plain_probe(n_layer: int, width: int) -> None:
    """Run in a child process: train 2 steps, print the peak RSS as JSON."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(gpt_config(n_layer, width)).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    for _ in range(2):
        x = torch.randint(0, 256, (1, BLOCK))
        optimizer.zero_grad(set_to_none=True)
        _, loss = model(x, x)
        loss.backward()
        optimizer.step()
    with open("/proc/self/status") as f:
        print(json.dumps({"peak": peak_rss(f.read())}))


def measure_plain(n_layer: int, width: int, _dtype: str) -> dict[str, int]:
    out = subprocess.run([sys.executable, __file__, "--probe-plain", f"{n_layer},{width}"],
                         capture_output=True, text=True, timeout=600, check=True)
    return {"worker": json.loads(out.stdout.strip().splitlines()[-1])["peak"]}


# --- cargohold, 2 workers + 1 state server -----------------------------------------------
def measure_cargohold(n_layer: int, width: int, dtype: str) -> dict[str, int]:
    import ray

    from cargohold.cluster.config import load_config
    from cargohold.cluster.launcher import TrainingSession

    config = load_config(None, [
        "steps=1", "progress=false", "metrics.enabled=false",
        f"model.n_layer={n_layer}", f"model.n_embd={width}", f"model.n_head={width // 64}",
        f"model.block_size={BLOCK}", "data.batch_size=1", "data.corpus_bytes=200000",
        f"worker.compute_dtype={dtype}", f"worker.grad_wire_dtype={dtype}",
        "worker.num_workers=2", "worker.torch_threads=1", "state_server.num_servers=1",
    ])
    read_status = lambda actor: open("/proc/self/status").read()  # noqa: E731 (runs inside the actor)
    with TrainingSession(config) as session:
        session.step()
        workers = ray.get([w.__ray_call__.remote(read_status) for w in session.workers])
        servers = ray.get([s.__ray_call__.remote(read_status) for s in session.servers])
        buffers = session.worker_resident_bytes()
    return {"worker": max(peak_rss(s) for s in workers), "server": max(peak_rss(s) for s in servers),
            "steady": max(peak_rss(s, "VmRSS") for s in workers), "buffers": sum(buffers.values())}


# --- the search -------------------------------------------------------------------------
def search(approach: str, dtype: str, limit: int, n_layer: int, probes: int) -> list[tuple[int, int, dict]]:
    """Binary search over widths; returns (width, params, measurement) of every probe."""
    key = "plain" if approach == "plain" else (approach, dtype)
    widths = [w for w in range(128, 8193, 64)
              if BASE_BYTES + ESTIMATE_BYTES_PER_PARAM[key] * params_of(gpt_config(n_layer, w)) < 1.6 * limit]
    measure = measure_plain if approach == "plain" else measure_cargohold
    lo, hi = -1, len(widths)  # widths[lo] fits, widths[hi] does not (sentinels)
    probed = []
    for _ in range(probes):
        if hi - lo <= 1:
            break
        mid = (lo + hi) // 2
        width = widths[mid]
        started = time.perf_counter()
        result = measure(n_layer, width, dtype)
        params = params_of(gpt_config(n_layer, width))
        probed.append((width, params, result))
        fits = result["worker"] <= limit
        steady = f" (RSS after the step {result['steady'] / 2**30:.2f} GiB)" if "steady" in result else ""
        print(f"  {approach:9} width {width:5} {params / 1e6:7.1f}M params: worker peak "
              f"{result['worker'] / 2**30:5.2f} GiB{steady} -> {'fits' if fits else 'too big'} "
              f"({time.perf_counter() - started:.0f}s)", flush=True)
        lo, hi = (mid, hi) if fits else (lo, mid)
    return probed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit-gib", type=float, default=2.0, help="per-worker memory limit")
    parser.add_argument("--approaches", default="plain,cargohold")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="cargohold's compute and gradient dtype (plain AdamW is always fp32)")
    parser.add_argument("--n-layer", type=int, default=12)
    parser.add_argument("--probes", type=int, default=4, help="runs per approach")
    parser.add_argument("--probe-plain", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe_plain:
        plain_probe(*(int(v) for v in args.probe_plain.split(",")))
        return

    limit = int(args.limit_gib * 2**30)
    approaches = args.approaches.split(",")
    print(f"limit {args.limit_gib} GiB per worker; GPT n_layer={args.n_layer}, vocab 256, block {BLOCK}")
    owns_ray = False
    if "cargohold" in approaches:
        import ray

        owns_ray = not ray.is_initialized()
        if owns_ray:
            # address="local": never join a cluster someone else started on this machine.
            ray.init(address="local", num_cpus=3, include_dashboard=False, _node_ip_address="127.0.0.1",
                     log_to_driver=False)
    try:
        found = {a: search(a, args.dtype, limit, args.n_layer, args.probes) for a in approaches}
    finally:
        if owns_ray:
            ray.shutdown()

    print(f"\n{'approach':22} {'largest fitting':>16} {'worker peak':>12} {'B/param':>8} {'marginal':>9} "
          f"{'server peak':>12}")
    best = {}
    for approach, probed in found.items():
        label = approach if approach == "plain" else f"cargohold {args.dtype}"
        fitting = [p for p in probed if p[2]["worker"] <= limit]
        if not fitting:
            print(f"{label:22} {'none probed fits':>16}")
            continue
        width, params, result = max(fitting, key=lambda p: p[1])
        best[approach] = params
        server = f"{result['server'] / 2**30:10.2f} GiB" if "server" in result else f"{'-':>12}"
        print(f"{label:22} {params / 1e6:11.1f}M w{width:<4} {result['worker'] / 2**30:8.2f} GiB "
              f"{result['worker'] / params:8.1f} {marginal(probed):>9} {server}")
    if len(best) == 2:
        print(f"RATIO cargohold / plain largest model = {best['cargohold'] / best['plain']:.2f}")
    print("worker peak = VmHWM of the process (interpreter, torch, gRPC, Ray included); B/param = "
          "that peak / params; marginal = bytes per extra parameter and fixed base, fitted over the "
          "probes. The search resolves widths only to the probes it made.")


def marginal(probed: list[tuple[int, int, dict]]) -> str:
    """'slope B/param + base GiB' of peak against params over the probes (least squares)."""
    if len({p[1] for p in probed}) < 2:
        return "-"
    xs, ys = [p[1] for p in probed], [p[2]["worker"] for p in probed]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return f"{slope:.1f}+{(my - slope * mx) / 2**30:.2f}G"


if __name__ == "__main__":
    main()
