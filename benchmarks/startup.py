"""Peak host memory of every process when a run starts from a local Hugging Face checkpoint.

    python benchmarks/startup.py                         # Llama 24 x 1024, vocab 32000: 374M parameters, W=2
    python benchmarks/startup.py --layers 12 --wire bfloat16 --keep /tmp/llama-ckpt

A child process builds a transformers ``LlamaForCausalLM`` with random fp32 weights and
``save_pretrained``-s it (safetensors) into a temporary folder under /tmp, deleted at the
end. A fresh driver process then starts Ray and a ``TrainingSession`` with
``hf.checkpoint_dir`` set (W workers, 1 state server) and runs 1 step; a thread of the
driver samples every Ray process every 50 ms (``capacity.RayProcessWatch``: VmHWM, and the
actor call that raised it). The same is done first for a tiny checkpoint of the same
architecture (2 x 64), whose peaks are each process's *runtime* (interpreter, torch,
transformers, Ray, gRPC).

Each process is compared with the goal ``VmHWM <= 1.3 x (its share + the largest unit) +
runtime``:

* a worker's share: ``TrainingWorker.resident_bytes()`` (its FSDP2 weights in the compute
  dtype, and its exchange buffers: gradients in the wire dtype, fetched weights);
* the state server's: the fp32 master weights and both Adam moments of its range (12 B per
  element of the flat space it owns);
* the driver's: nothing (it only plans the layout on the meta device);
* the largest unit: the largest ``fully_shard`` unit (a block, or the root: embeddings,
  head and final norm) whole, in fp32 as the checkpoint stores it and as a worker reads
  it.

The printed ratio is ``(VmHWM - runtime) / (share + largest unit)``, for the peak once the
session has started (start-up: building, reading the checkpoint, registering) and for the
peak after the first step (steady state: the state server then also holds the step's
staged gradients and the weights prepared for the fetch). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from capacity import run_session, session_overrides

GIB = 2**30
GOAL = 1.3
TINY = {"layers": 2, "hidden": 64, "intermediate": 172, "heads": 2, "vocab": 320}


def llama_config(spec: dict):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=spec["vocab"],
        hidden_size=spec["hidden"],
        intermediate_size=spec["intermediate"],
        num_hidden_layers=spec["layers"],
        num_attention_heads=spec["heads"],
        num_key_value_heads=spec["heads"],
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )


def save_checkpoint(spec: dict, folder: str) -> None:
    """Run in a child process, so the driver's peak never holds the model."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config(spec)).float()
    model.save_pretrained(folder, safe_serialization=True)


def overrides(folder: str, workers: int, dtype: str, wire: str) -> list[str]:
    return [f"hf.checkpoint_dir={folder}", *session_overrides(workers, dtype, wire)]


def probe(folder: str, workers: int, dtype: str, wire: str) -> dict:
    """Run in a fresh child process: it is the driver whose peak is measured."""
    return run_session(overrides(folder, workers, dtype, wire), workers)


def run_child(*args: str, env: dict[str, str] | None = None) -> dict | None:
    out = subprocess.run(
        [sys.executable, __file__, *args],
        capture_output=True,
        text=True,
        timeout=3600,
        env={**os.environ, **(env or {})},
    )
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:1])} failed: {(out.stderr or out.stdout).strip()[-2000:]}")
    lines = out.stdout.strip().splitlines()
    return json.loads(lines[-1]) if lines else None


def sizes(folder: str, workers: int, dtype: str, wire: str) -> dict:
    """Parameters, the largest unit (fp32 bytes) and each server's state bytes, from the layout."""
    from cargohold.cluster.schema.io import load_config
    from cargohold.cluster.sections import config_layout

    config = load_config(None, overrides(folder, workers, dtype, wire))
    _, _, layout = config_layout(config)
    units = [sum(place.numel for place in layout.unit_params(u.index)) for u in layout.units]
    largest = max(range(len(units)), key=units.__getitem__)
    servers = [12 * (stop - start) for start, stop in (layout.server_range(s) for s in range(layout.num_servers))]
    return {
        "params": layout.num_real_elements,
        "unit": 4 * units[largest],
        "unit_name": layout.units[largest].name or "<root>",
        "servers": servers,
    }


def rows(result: dict, size: dict) -> list[tuple[str, int, int, int, dict | None]]:
    """(process, VmHWM once started, VmHWM after the first step, share bytes, its trace)
    for every process (the driver's peak is taken at the end only)."""
    out = [
        (f"worker {rank}", w["hwm_at"]["started"], w["hwm"], sum(result["buffers"][rank].values()), w)
        for rank, w in enumerate(result["workers"])
    ]
    out += [
        (f"server {i}", s["hwm_at"]["started"], s["hwm"], size["servers"][i], None)
        for i, s in enumerate(result["servers"])
    ]
    out.append(("driver", result["driver"], result["driver"], 0, None))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000, help=">= 256: cargohold's data is byte-level")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="worker.compute_dtype")
    parser.add_argument(
        "--wire", default="float32", choices=["float32", "bfloat16"], help="tuning.worker.grad_wire_dtype"
    )
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="environment of the session's processes (e.g. MALLOC_MMAP_THRESHOLD_=131072)",
    )
    parser.add_argument("--keep", help="save the checkpoint here and keep it (default: a temporary folder)")
    parser.add_argument("--save", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.save:
        save_checkpoint(json.loads(args.save[0]), args.save[1])
        return
    if args.probe:
        print(json.dumps(probe(**json.loads(args.probe))))
        return

    big = {
        "layers": args.layers,
        "hidden": args.hidden,
        "intermediate": args.intermediate,
        "heads": args.heads,
        "vocab": args.vocab,
    }
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="cargohold-startup-", dir="/tmp"))
    folders = {"tiny": root / "tiny", "big": root / "big"}
    session = {"workers": args.workers, "dtype": args.dtype, "wire": args.wire}
    env = dict(item.split("=", 1) for item in args.env)
    print(f"load average {Path('/proc/loadavg').read_text().split()[0]}", flush=True)
    results, size = {}, {}
    try:
        for name, spec in (("tiny", TINY), ("big", big)):
            started = time.perf_counter()
            if not (folders[name] / "config.json").is_file():
                run_child("--save", json.dumps(spec), str(folders[name]))
            on_disk = sum(f.stat().st_size for f in folders[name].iterdir())
            saved = time.perf_counter() - started
            started = time.perf_counter()
            results[name] = run_child("--probe", json.dumps({"folder": str(folders[name]), **session}), env=env)
            size[name] = sizes(str(folders[name]), **session)
            print(
                f"{name}: Llama {spec['layers']} x {spec['hidden']} (intermediate {spec['intermediate']}, vocab "
                f"{spec['vocab']}): {size[name]['params'] / 1e6:.1f}M parameters, {on_disk / GIB:.2f} GiB on disk "
                f"(saved in {saved:.0f}s); session start {results[name]['start_s']:.0f}s, first step "
                f"{results[name]['step_s']:.0f}s (run {time.perf_counter() - started:.0f}s)",
                flush=True,
            )
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)

    runtime = {process: hwm for process, _, hwm, _, _ in rows(results["tiny"], size["tiny"])}
    unit = size["big"]["unit"]
    settings = "".join(f", {k}={v}" for k, v in env.items())
    print(
        f"\nW={args.workers}, compute {args.dtype}, wire {args.wire}{settings}; largest unit "
        f"{size['big']['unit_name']!r} {unit / GIB:.3f} GiB in fp32; runtime = the same process's peak with the "
        "tiny checkpoint; started = once the session has started (no step yet), step = after the first step"
    )
    print(
        f"{'process':10} {'started':>9} {'step':>9} {'runtime':>9} {'share':>9} {'goal':>9} {'ratio':>6} "
        f"{'step':>6}  peak during (VmHWM after each call, GiB)"
    )
    ratios = []
    for process, started, hwm, share, trace in rows(results["big"], size["big"]):
        goal = GOAL * (share + unit) + runtime[process]
        ratio, after_step = ((peak - runtime[process]) / (share + unit) for peak in (started, hwm))
        ratios.append((process, ratio, after_step))
        if trace is not None:  # an actor's calls (a server serves gRPC, not Ray calls)
            calls = ", ".join(f"{c} {v / GIB:.2f}" for c, v in trace["hwm_after"].items())
            calls = f"{trace['peak_during']} ({calls})"
        elif process.startswith("server"):
            shared = results["big"]["servers"][int(process.split()[1])]["shared"]
            calls = (
                f"{shared / GIB:.2f} GiB of its RSS after the step are the workers' shared exchange buffers: "
                f"without them the step ratio is {(hwm - shared - runtime[process]) / (share + unit):.2f}"
            )
        else:
            calls = ""
        print(
            f"{process:10} {started / GIB:5.2f} GiB {hwm / GIB:5.2f} GiB {runtime[process] / GIB:5.2f} GiB "
            f"{share / GIB:5.2f} GiB {goal / GIB:5.2f} GiB {ratio:6.2f} {after_step:6.2f}  {calls}"
        )
    for process, ratio, after_step in ratios:
        print(
            f"RATIO {process} start-up (VmHWM - runtime) / (share + largest unit) = {ratio:.2f} (goal <= {GOAL}); "
            f"after the first step {after_step:.2f}"
        )


if __name__ == "__main__":
    main()
