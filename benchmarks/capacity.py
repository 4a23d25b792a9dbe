"""The largest GPT a worker trains within a per-worker memory limit, found by running.

    python benchmarks/capacity.py                      # 2 GiB: plain fp32; cargohold bf16 W=2, 4 x wire fp32, bf16
    python benchmarks/capacity.py --approaches cargohold --workers 2 --wire bfloat16
    python benchmarks/capacity.py --approaches cargohold --workers 2 --wire bfloat16 --widths 1408,1152 \
        --set worker.reshard_after_forward=false       # exactly these widths, ZeRO-2-like
    python benchmarks/capacity.py --trace-step 1280    # one worker's step without Ray, phase by phase
    python benchmarks/capacity.py > /tmp/capacity.log 2>&1 &   # ~17 min: run it in the background

Candidates are GPTs of ``--n-layer`` blocks (byte vocabulary, block 128) whose width grows
in steps of 64 (``n_head = width / 64``). A candidate fits when the peak resident set of
every worker process (``VmHWM`` in /proc/<pid>/status: the high-water mark of RSS, which
counts the interpreter, torch, gRPC, Ray's core worker and the shared-memory exchange
buffers the worker touched) stays within the limit.

* plain: a fresh process builds the fp32 model, runs 2 steps of forward/backward and
  ``torch.optim.AdamW(fused=True)`` (weights, grads, exp_avg, exp_avg_sq: 16 B/param).
* cargohold: a fresh driver process starts Ray and a ``TrainingSession`` of W workers
  (FSDP2, ``--dtype`` weights, each wire dtype of ``--wire`` for gradients) and 1 state
  server, and runs 1 step. A thread of the driver samples every Ray process it started
  every 50 ms: its VmHWM, its RSS and its title (``ray::TrainingWorker.<method>``), so the
  peak is attributed to the call that raised it (``init_process_group``: building the
  sharded model and the exchange buffers; ``register_segments``: the initial values and the
  fp32 registration; ``train_step``). The state server's memory is host RAM outside the
  worker: reported, not counted against the limit. A configuration whose server would
  need more than ``--server-ram-gib`` (at ~20 B/param) keeps the server's state on an
  NVMe tier under ``--tier-path``, so that the probes fit a shared machine; the workers do
  not change. ``--env`` sets variables in the probes' environment, which Ray's processes
  inherit and which win over the launcher's allocator environment (``tuning.worker.host_allocator``:
  mimalloc keeps what a step frees, and glibc's ``MALLOC_MMAP_THRESHOLD_`` changes the
  workers' peak a lot: see docs/benchmarks.md; ``--set tuning.worker.host_allocator=glibc`` for
  the figures recorded there).

The search per configuration: a first probe of the tiny model (width 64) gives the
process's *runtime* (interpreter, torch, Ray, gRPC: everything that is not the model);
then each probe picks the widest candidate that the straight line through the probes so
far (peak against parameters) predicts to fit, kept strictly inside the bracket of the
widest fitting and the narrowest failing probe. Peak memory is close to linear in the
parameters (when the allocator gives memory back), so 3 probes land on adjacent widths.
"B/param" = (peak - runtime) / parameters, the cost of a parameter with everything in
flight (gathered blocks, gradients, registration) included; "buffers" =
``TrainingWorker.resident_bytes()`` (weights + exchange) / parameters, what the worker
holds between steps.

One sequence of 128 tokens per worker per step, 1 torch thread per process. Nothing is
asserted; the limit is compared, not enforced (RLIMIT_AS would count the address space
torch and Ray reserve, not what they touch). Other processes on a shared machine do not
change VmHWM, only how long the probes take.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from process_memory import ProcessTrace, RayProcessWatch, peak_rss, read_text, start_local_ray

from cargohold.cluster.schema.model import GPTConfig
from cargohold.services.models.gpt import GPT, num_parameters

BLOCK = 128
TINY_WIDTH = 64
"""The runtime probe: the same n_layer at width 64 (~1.3M parameters, a few MB)."""
WIDTHS = range(128, 8193, 64)
PLAIN_BYTES_PER_PARAM = 16
"""fp32 weights, gradients, exp_avg, exp_avg_sq."""
ESTIMATE_BYTES_PER_PARAM = {
    "plain": 16.5,
    ("bfloat16", "float32"): 1.5,
    ("bfloat16", "bfloat16"): 1.4,
    ("float32", "float32"): 2.5,
    ("float32", "bfloat16"): 2.4,
}
"""Rough peak bytes per parameter at W=2 with 24 blocks, only to place the first probe.
A cargohold worker holds its 1/W chunk of the weights in the compute dtype (bf16 at W=2:
1 B/param; fp32: 2), a few unit-sized exchange slots and the units in flight. Divided
by W/2 for other W; plain AdamW does not depend on W. The line fit takes over after the
first probe."""
BASE_BYTES = {"plain": 350 << 20, "cargohold": 650 << 20}
"""Rough runtime resident memory, only to place the first probe."""


# --- the models -------------------------------------------------------------------------
def gpt_config(n_layer: int, width: int) -> GPTConfig:
    return GPTConfig(vocab_size=256, block_size=BLOCK, n_layer=n_layer, n_head=width // 64, n_embd=width)


def params_of(n_layer: int, width: int) -> int:
    with torch.device("meta"):
        return num_parameters(GPT(gpt_config(n_layer, width)))


# --- plain AdamW, one process --------------------------------------------------------
def plain_probe(n_layer: int, width: int) -> dict:
    """Run in a child process: train 2 steps, return the peak RSS."""
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
    return {"worker": peak_rss(read_text("/proc/self/status"))}


# --- cargohold: W workers + 1 state server ----------------------------------------------------
def session_overrides(workers: int, dtype: str, wire: str) -> list[str]:
    """One step of W workers and 1 state server on sequences of BLOCK tokens, batch 1, one
    torch thread each, no metrics, patient timeouts (probes run on a loaded box)."""
    return [
        "steps=1",
        "metrics.port=null",
        f"model.block_size={BLOCK}",
        "data.batch_size=1",
        "data.corpus_bytes=200000",
        f"worker.compute_dtype={dtype}",
        f"tuning.worker.grad_wire_dtype={wire}",
        f"worker.num_workers={workers}",
        "state_server.num_servers=1",
        "tuning.cluster.startup_timeout_s=1200",
        "tuning.state_server.rpc_timeout_s=1200",
    ]


def cargohold_overrides(
    n_layer: int,
    width: int,
    workers: int,
    dtype: str,
    wire: str,
    tier: str | None = None,
    budget: int = 0,
    extra: tuple[str, ...] = (),
) -> list[str]:
    overrides = [
        f"model.n_layer={n_layer}",
        f"model.n_embd={width}",
        f"model.n_head={width // 64}",
        *session_overrides(workers, dtype, wire),
    ]
    if tier:
        overrides += [f"state_server.tier.nvme_paths=[{tier}]", f"state_server.tier.ram_budget_bytes={budget}"]
    return [*overrides, *extra]


def run_session(overrides: list[str], workers: int) -> dict:
    """Start Ray in this process, run one step of a session under a
    :class:`RayProcessWatch`, and report every process's memory (this one's too)."""
    import ray

    from cargohold.cluster.launcher import TrainingSession
    from cargohold.cluster.schema.io import load_config

    run_id = f"bench-{os.getpid()}-{int(time.time())}"
    config = load_config(None, [*overrides, f"run_id={run_id}"])
    start_local_ray(workers + 1)
    timings = {}
    try:
        with RayProcessWatch() as watch:
            started = time.perf_counter()
            with TrainingSession(config) as session:
                timings["start_s"] = time.perf_counter() - started
                watch.mark("started")
                started = time.perf_counter()
                report = session.step()
                timings["step_s"] = time.perf_counter() - started
                buffers = ray.get([w.resident_bytes.remote() for w in session.workers])
                watch.freeze_rss()
    finally:
        ray.shutdown()
        for path in config.state_server.tier.nvme_paths:
            shutil.rmtree(Path(path) / run_id, ignore_errors=True)

    def trace(t: ProcessTrace) -> dict:
        return {
            "hwm": t.hwm,
            "rss": t.rss,
            "shared": t.shared,
            "peak_during": t.peak_during,
            "hwm_after": t.hwm_after,
            "hwm_at": t.hwm_at,
        }

    return {
        "workers": [trace(t) for t in watch.by_role("worker")],
        "servers": [trace(t) for t in watch.by_role("server")],
        "driver": peak_rss(read_text("/proc/self/status")),
        "buffers": buffers,
        "phases": report.phases,
        "loss": report.loss,
        **timings,
    }


def cargohold_probe(
    n_layer: int,
    width: int,
    workers: int,
    dtype: str,
    wire: str,
    tier: str | None = None,
    budget: int = 0,
    extra: tuple[str, ...] = (),
) -> dict:
    result = run_session(cargohold_overrides(n_layer, width, workers, dtype, wire, tier, budget, tuple(extra)), workers)
    if len(result["workers"]) != workers:
        raise RuntimeError(f"watched {len(result['workers'])} worker processes, expected {workers}")
    result["worker"] = max(w["hwm"] for w in result["workers"])
    return result


# --- the search -------------------------------------------------------------------------
@dataclass
class Search:
    """One configuration: an approach, and for cargohold W, dtypes, the server's tier and
    the workers' environment."""

    approach: str
    workers: int = 1
    dtype: str = "float32"
    wire: str = "float32"
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment of the probe process (Ray's processes inherit it)."""
    tier: str | None = None
    """The state server's NVMe-tier folder (None: all its state in RAM)."""
    budget: int = 0
    extra: tuple[str, ...] = ()
    """Further config overrides (``--set``)."""
    runtime: dict | None = None
    probes: list[tuple[int, int, dict]] = field(default_factory=list)
    """(width, params, result) of every probe but the runtime one."""

    @property
    def label(self) -> str:
        if self.approach == "plain":
            return "plain AdamW fp32"
        extra = "".join(f", {k}={v}" for k, v in self.env.items()) + "".join(f", {o}" for o in self.extra)
        return f"cargohold {_short(self.dtype)} W={self.workers}, wire {_short(self.wire)}{extra}"

    def fitting(self, limit: int) -> list[tuple[int, int, dict]]:
        return [p for p in self.probes if p[2]["worker"] is not None and p[2]["worker"] <= limit]

    def measure(self, n_layer: int, width: int) -> dict:
        """One probe in a fresh child process (its own Ray, nothing left from earlier probes)."""
        spec = {"approach": self.approach, "n_layer": n_layer, "width": width}
        if self.approach != "plain":
            spec.update(
                workers=self.workers,
                dtype=self.dtype,
                wire=self.wire,
                tier=self.tier,
                budget=self.budget,
                extra=self.extra,
            )
        out = subprocess.run(
            [sys.executable, __file__, "--probe", json.dumps(spec)],
            capture_output=True,
            text=True,
            timeout=1800,
            env={**os.environ, **self.env},
        )
        if out.returncode != 0:
            return {"error": (out.stderr or out.stdout).strip().splitlines()[-1:] or ["?"], "worker": None}
        return json.loads(out.stdout.strip().splitlines()[-1])

    def prior(self) -> tuple[float, float]:
        """(bytes per parameter, base bytes) before any probe of this configuration."""
        if self.approach == "plain":
            return ESTIMATE_BYTES_PER_PARAM["plain"], BASE_BYTES["plain"]
        return ESTIMATE_BYTES_PER_PARAM[(self.dtype, self.wire)] * 2 / self.workers, BASE_BYTES["cargohold"]


def _short(dtype: str) -> str:
    return {"float32": "fp32", "bfloat16": "bf16"}[dtype]


def next_width(search: Search, limit: int, n_layer: int) -> int | None:
    """The widest candidate predicted to fit, strictly between the bracket's ends."""
    fits = [w for w, _, r in search.probes if r["worker"] is not None and r["worker"] <= limit]
    fails = [w for w, _, r in search.probes if r["worker"] is None or r["worker"] > limit]
    lo, hi = max(fits, default=0), min(fails, default=WIDTHS[-1] + 64)
    inside = [w for w in WIDTHS if lo < w < hi]
    if not inside:
        return None
    points = [(p, r["worker"]) for _, p, r in search.probes if r["worker"] is not None]
    if points:
        points.append((params_of(n_layer, TINY_WIDTH), search.runtime["worker"]))
        slope, base = fit_line(points)
    else:
        slope, base = search.prior()
        base = search.runtime["worker"] + 0.1 * 2**30 if search.runtime else base
    predicted = [w for w in inside if base + slope * params_of(n_layer, w) <= limit]
    return predicted[-1] if predicted else inside[0]


def fit_line(points: list[tuple[int, int]]) -> tuple[float, float]:
    """Least-squares (slope, intercept) of y against x."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / spread if spread else 0.0
    return slope, my - slope * mx


def run_search(
    search: Search, limit: int, n_layer: int, probes: int, runtimes: dict, widths: list[int] | None = None
) -> None:
    """``runtimes`` caches the width-64 probe per (approach, W, environment): the wire dtype
    changes nothing at 1.3M parameters. ``widths``: probe exactly these instead of searching."""
    gib = 2**30
    key = (search.approach, search.workers, tuple(sorted(search.env.items())), search.extra)
    if key not in runtimes:
        started = time.perf_counter()
        runtimes[key] = search.measure(n_layer, TINY_WIDTH)
        print(
            f"  {search.label}: runtime (width {TINY_WIDTH}) worker peak "
            f"{runtimes[key]['worker'] / gib:.2f} GiB ({time.perf_counter() - started:.0f}s)",
            flush=True,
        )
    search.runtime = runtimes[key]
    for index in range(len(widths) if widths else probes):
        width = widths[index] if widths else next_width(search, limit, n_layer)
        if width is None:
            break
        started = time.perf_counter()
        result = search.measure(n_layer, width)
        params = params_of(n_layer, width)
        search.probes.append((width, params, result))
        if result["worker"] is None:
            print(f"  {search.label}: width {width} {params / 1e6:.1f}M failed: {result['error']}", flush=True)
            continue
        print(
            f"  {search.label}: width {width:5} {params / 1e6:7.1f}M  {describe(result, limit)} "
            f"({time.perf_counter() - started:.0f}s)",
            flush=True,
        )


def describe(result: dict, limit: int) -> str:
    gib = 2**30
    text = f"worker peak {result['worker'] / gib:5.2f} GiB -> {'fits' if result['worker'] <= limit else 'too big'}"
    if "workers" in result:
        top = max(result["workers"], key=lambda w: w["hwm"])
        calls = ", ".join(f"{call} {hwm / gib:.2f}" for call, hwm in top["hwm_after"].items())
        server = max(result["servers"], key=lambda s: s["hwm"])
        peaks = ", ".join(f"{w['hwm'] / gib:.2f}" for w in result["workers"])
        text += (
            f"; peak during {top['peak_during']} (VmHWM after each call: {calls}); RSS after the step "
            f"{top['rss'] / gib:.2f}, {top['shared'] / gib:.2f} of it shared memory (every worker's peak: "
            f"{peaks}); server peak {server['hwm'] / gib:.2f} GiB, RSS after the step {server['rss'] / gib:.2f}, "
            f"{server['shared'] / gib:.2f} of it the workers' exchange buffers in shared memory; "
            f"start {result['start_s']:.0f}s, step {result['step_s']:.0f}s"
        )
    return text


def report(searches: list[Search], limit: int) -> None:
    gib = 2**30
    width = max([len(s.label) for s in searches] + [13])
    print(
        f"\n{'configuration':{width}} {'largest fitting':>17} {'worker peak':>11} {'runtime':>8} {'B/param':>8} "
        f"{'buffers':>8} {'slope':>6} {'server peak':>12}"
    )
    best = {}
    for search in searches:
        fitting = search.fitting(limit)
        if not fitting:
            print(f"{search.label:{width}} {'none probed fits':>17}")
            continue
        model_width, params, result = max(fitting, key=lambda p: p[1])
        best[search.label] = (search, params)
        runtime = search.runtime["worker"]
        buffers = f"{sum(result['buffers'][0].values()) / params:8.2f}" if "buffers" in result else f"{'-':>8}"
        server = f"{'-':>12}"
        if "servers" in result:
            top = max(result["servers"], key=lambda s: s["hwm"])
            server = f"{top['hwm'] / gib:8.2f} GiB ({(top['hwm'] - top['shared']) / gib:.2f} without shared memory)"
        if search.tier:
            server += f" (NVMe tier, {search.budget / gib:.0f} GiB RAM budget)"
        measured = [(p, r["worker"]) for _, p, r in search.probes if r["worker"] is not None]
        slope = fit_line(measured)[0] if len({p for p, _ in measured}) >= 2 else float("nan")
        print(
            f"{search.label:{width}} {params / 1e6:10.1f}M w{model_width:<5} {result['worker'] / gib:7.2f} GiB "
            f"{runtime / gib:4.2f} GiB {(result['worker'] - runtime) / params:8.2f} {buffers} {slope:6.2f} {server}"
        )
    plain = next((params for s, params in best.values() if s.approach == "plain"), None)
    for label, (search, params) in best.items():
        if plain and search.approach != "plain":
            print(f"RATIO {label} / plain AdamW, largest model = {params / plain:.2f}")
    for label, (search, params) in best.items():
        twin = next(
            (
                p
                for s, p in best.values()
                if s.approach == search.approach
                and s.workers == 2
                and (s.dtype, s.wire, s.env, s.extra) == (search.dtype, search.wire, search.env, search.extra)
            ),
            None,
        )
        if search.workers > 2 and twin:
            print(
                f"RATIO {label} / the same at W=2, largest model = {params / twin:.2f} "
                f"(W ratio {search.workers / 2:.0f})"
            )
    print(
        f"B/param = (worker peak - runtime) / params, with everything in flight; plain AdamW holds "
        f"{PLAIN_BYTES_PER_PARAM} B/param of tensors. buffers = resident_bytes() (weights + exchange) / params. "
        f"slope = least-squares bytes per extra parameter over the probes. runtime = the worker peak at width "
        f"{TINY_WIDTH}. The search resolves widths only to the probes it made."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit-gib", type=float, default=2.0, help="per-worker memory limit")
    parser.add_argument("--approaches", default="plain,cargohold")
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["float32", "bfloat16"],
        help="cargohold's compute dtype (plain AdamW is always fp32)",
    )
    parser.add_argument("--wire", default="float32,bfloat16", help="gradient wire dtypes to try (comma-separated)")
    parser.add_argument("--workers", default="2,4", help="cargohold worker counts to try (comma-separated)")
    parser.add_argument("--n-layer", type=int, default=24)
    parser.add_argument("--probes", type=int, default=3, help="probes per configuration after the runtime one")
    parser.add_argument("--widths", help="probe exactly these widths (comma-separated) instead of searching")
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="environment of cargohold's processes (e.g. MALLOC_MMAP_THRESHOLD_=131072)",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra config override for cargohold's sessions (repeatable)",
    )
    parser.add_argument(
        "--server-ram-gib",
        type=float,
        default=12.0,
        help="a configuration whose state server would need more (20 B/param at the largest "
        "candidate the prior predicts) runs it with an NVMe tier",
    )
    parser.add_argument("--tier-path", default="/tmp/cargohold-capacity", help="folder for that NVMe tier")
    parser.add_argument("--tier-budget-gib", type=float, default=2.0, help="RAM budget of that tier")
    parser.add_argument(
        "--trace-step",
        type=int,
        metavar="WIDTH",
        help="instead of searching: one worker's memory after each phase of start-up and 4 steps, "
        "without Ray or a server (first worker count and wire dtype)",
    )
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trace_step:
        from step_trace import trace_step  # it imports this module's model helpers

        trace_step(args.n_layer, args.trace_step, int(args.workers.split(",")[0]), args.wire.split(",")[0], 4)
        return
    if args.probe:
        spec = json.loads(args.probe)
        if spec.pop("approach") == "plain":
            print(json.dumps(plain_probe(**spec)))
        else:
            print(json.dumps(cargohold_probe(**spec)))
        return

    limit = int(args.limit_gib * 2**30)
    env = dict(item.split("=", 1) for item in args.env)
    searches = []
    if "plain" in args.approaches.split(","):
        searches.append(Search("plain"))
    if "cargohold" in args.approaches.split(","):
        for workers in (int(w) for w in args.workers.split(",")):
            for wire in args.wire.split(","):
                search = Search("cargohold", workers, args.dtype, wire, env, extra=tuple(args.overrides))
                slope, base = search.prior()
                largest = (limit - base) / slope
                if 20 * largest > args.server_ram_gib * 2**30:
                    search.tier, search.budget = args.tier_path, int(args.tier_budget_gib * 2**30)
                searches.append(search)
    print(
        f"limit {args.limit_gib} GiB per worker; GPT n_layer={args.n_layer}, vocab 256, block {BLOCK}; "
        f"load average {Path('/proc/loadavg').read_text().split()[0]}",
        flush=True,
    )
    runtimes: dict = {}
    try:
        for search in searches:
            run_search(
                search,
                limit,
                args.n_layer,
                args.probes,
                runtimes,
                [int(w) for w in args.widths.split(",")] if args.widths else None,
            )
    finally:
        shutil.rmtree(args.tier_path, ignore_errors=True)
    report(searches, limit)


if __name__ == "__main__":
    main()
