"""How fast does a state server apply AdamW, against what the memory system allows?

    python benchmarks/optimizer_step.py                       # 50M and 200M parameters
    python benchmarks/optimizer_step.py --sizes 50e6 --reps 3

For each size it lays out a GPT-like model (byte vocabulary of 50304 tokens, 12 blocks,
width chosen to reach the size) as one segment with one fragment per parameter, exactly
as a state server holding a whole model would, and times:

* ``optim.fused_adamw_`` over the fragment views (the kernel the server runs), with all
  cores and with one thread, and the same kernel run over chunks of ``--chunk-elements``;
* ``SegmentState.push`` (what a PushGradient ends in) and ``push`` + ``weights("bfloat16")``
  (a whole server step: update, then the weights a worker fetches, handed back with
  ``recycle`` as the server does after the last chunk, so the next push writes them into
  the same buffer);
* ``torch.optim.AdamW`` with ``fused=True`` and with ``foreach=True`` on separate
  parameter tensors of the same shapes.

The bound is a STREAM-style bandwidth (the best of copy, triad ``a = b + s*c`` and an
in-place ``a += s*c`` on three fp32 arrays of 512 MiB, more than the caches hold, best
of 3 runs, taken before and after the optimizer runs) divided by the bytes Adam must move per
parameter: read param, grad, exp_avg, exp_avg_sq (16 B) and write param, exp_avg,
exp_avg_sq (12 B) = 28 B, plus 2 B when the bf16 weights for the worker are written too.
Every variant runs the same steps on the same gradients and is compared bitwise
(``torch.equal`` of master weights and exp_avg_sq) with ``torch.optim.AdamW(fused=True)``.
Times are the best of ``--reps`` steps after one warm-up step. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import gc
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from timing import timed

from cargohold.cluster.schema.model import GPTConfig
from cargohold.services.core.layout import build_layout
from cargohold.services.core.optim import AdamWHyperParams, AdamWState, fused_adamw_
from cargohold.services.core.segment_spec import SegmentSpec
from cargohold.services.models.gpt import GPT, num_parameters
from cargohold.services.segments.segment_state import SegmentState

ADAM_BYTES_PER_PARAM = 28
"""Read param, grad, exp_avg, exp_avg_sq (4 x 4 B); write param, exp_avg, exp_avg_sq (3 x 4 B)."""
BF16_OUT_BYTES_PER_PARAM = 2
LR = 1e-3
HYPER = AdamWHyperParams(weight_decay=0.01)


@dataclass(frozen=True, slots=True)
class Result:
    name: str
    threads: int
    seconds: float
    bytes_per_param: int
    bitwise: bool | None


# --- the model and its layout ------------------------------------------------------
def gpt_shapes(target: float) -> tuple[GPTConfig, list[tuple[str, tuple[int, ...]]]]:
    """Shapes of a 12-block GPT (vocab 50304) whose width gets closest to ``target`` params."""
    best = None
    for width in range(128, 4097, 64):
        config = GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=width // 64, n_embd=width)
        with torch.device("meta"):
            model = GPT(config)
        count = num_parameters(model)
        if best is None or abs(count - target) < abs(best[2] - target):
            best = (config, [(n, tuple(p.shape)) for n, p in model.named_parameters()], count)
        if count > target:
            break
    return best[0], best[1]


def segment_fragments(shapes: list[tuple[str, tuple[int, ...]]]) -> tuple[int, tuple[tuple[int, int], ...]]:
    """numel and (offset, length) fragments of the single segment of a 1-worker, 1-server layout."""
    layout = build_layout(shapes, num_workers=1, num_servers=1)
    (segment,) = layout.segments
    return segment.numel, tuple((f.segment_start, f.length) for f in segment.fragments)


# --- the bound ------------------------------------------------------------------------
def stream_bandwidth(threads: int, elements: int = 1 << 27, reps: int = 3) -> dict[str, float]:
    """Best-of-``reps`` bytes/s of STREAM copy (8 B/elem) and triad (12 B/elem), and of an
    in-place ``a += s*c`` (12 B/elem; like Adam, every array it writes it has read, so
    no write-allocate traffic goes uncounted). Arrays of 512 MiB: each pass touches 1.5 GiB,
    three times this box's 480 MiB L3.
    """
    torch.set_num_threads(threads)
    a, b, c = [torch.full((elements,), 1.0 + i) for i in range(3)]
    kernels = {
        "copy": (lambda: a.copy_(b), 8),
        "triad": (lambda: torch.add(b, c, alpha=3.0, out=a), 12),
        "update": (lambda: a.add_(c, alpha=1e-3), 12),
    }
    result = {}
    for name, (kernel, bytes_per_elem) in kernels.items():
        kernel()
        best = min(timed(kernel) for _ in range(reps))
        result[name] = elements * bytes_per_elem / best
    result["bound"] = max(result.values())
    return result


# --- the variants ---------------------------------------------------------------------
def chunked_views(fragments, buffer: torch.Tensor, chunk: int) -> list[list[torch.Tensor]]:
    """Views of the fragments cut every ``chunk`` elements (a multiple of 64 keeps bits)."""
    views = [buffer[o : o + n] for o, n in fragments]
    pieces = [v[i : i + chunk] for v in views for i in range(0, v.numel(), chunk)]
    groups, current, size = [], [], 0
    for piece in pieces:  # group small pieces so each kernel call covers ~chunk elements
        current.append(piece)
        size += piece.numel()
        if size >= chunk:
            groups.append(current)
            current, size = [], 0
    return groups + ([current] if current else [])


def run_kernel(numel, fragments, weights, grad, steps, threads, chunk=None) -> tuple[list[float], tuple]:
    """The fused kernel over fragment views (or over chunks of them), as the server runs
    it per partition; returns times, state."""
    torch.set_num_threads(threads)
    master, exp_avg, exp_avg_sq = weights.clone(), torch.zeros(numel), torch.zeros(numel)
    views = lambda t: [t[o : o + n] for o, n in fragments]  # noqa: E731
    state = AdamWState(
        master=views(master), exp_avg=views(exp_avg), exp_avg_sq=views(exp_avg_sq), step=torch.tensor(0.0)
    )
    grads = views(grad)
    if chunk is None:

        def step() -> None:
            state.step += 1
            fused_adamw_(state, grads, lr=LR, hyper=HYPER)

    else:
        parts = [
            (AdamWState(master=m, exp_avg=e, exp_avg_sq=s, step=state.step), g)
            for m, e, s, g in zip(*(chunked_views(fragments, t, chunk) for t in (master, exp_avg, exp_avg_sq, grad)))
        ]

        def step() -> None:
            state.step += 1
            for part, g in parts:
                fused_adamw_(part, g, lr=LR, hyper=HYPER)

    return [timed(step) for _ in range(steps)], (master, exp_avg_sq)


def run_segment_state(numel, fragments, weights, grad, steps, threads, fetch: bool) -> tuple[list[float], tuple]:
    torch.set_num_threads(threads)
    spec = SegmentSpec(
        run_id="bench", segment_id=0, start=0, numel=numel, fragments=fragments, grad_dtype="float32", hyper=HYPER
    )
    segment = SegmentState(spec, weights)
    times = []
    for k in range(1, steps + 1):

        def step(k: int = k) -> None:
            segment.apply_gradient(k, grad, global_norm=0.0, lr=LR)
            if fetch:  # as the server does once a fetch has sent its last chunk
                segment.recycle(segment.weights(k, "bfloat16"))

        times.append(timed(step))
    snap = segment.snapshot()
    return times, (snap["master"], snap["exp_avg_sq"])


def run_torch(numel, fragments, weights, grad, steps, threads, *, fused: bool) -> tuple[list[float], tuple]:
    """torch.optim.AdamW on one tensor per fragment (the model's parameters)."""
    torch.set_num_threads(threads)
    params = [torch.nn.Parameter(weights[o : o + n].clone()) for o, n in fragments]
    for p, (o, n) in zip(params, fragments):
        p.grad = grad[o : o + n].clone()
    optimizer = torch.optim.AdamW(
        params,
        lr=LR,
        betas=(HYPER.beta1, HYPER.beta2),
        eps=HYPER.eps,
        weight_decay=HYPER.weight_decay,
        fused=fused,
        foreach=not fused,
    )
    times = [timed(optimizer.step) for _ in range(steps)]
    master, exp_avg_sq = weights.clone(), torch.zeros(numel)  # padding as the views leave it
    for p, (o, n) in zip(params, fragments):
        master[o : o + n] = p.detach()
        exp_avg_sq[o : o + n] = optimizer.state[p]["exp_avg_sq"]
    return times, (master, exp_avg_sq)


def measure_size(target: float, reps: int, chunk: int, all_threads: int) -> tuple[str, int, list[Result]]:
    config, shapes = gpt_shapes(target)
    numel, fragments = segment_fragments(shapes)
    real = sum(n for _, n in fragments)
    generator = torch.Generator().manual_seed(0)
    weights = torch.randn(numel, generator=generator) * 0.02
    grad = torch.randn(numel, generator=generator) * 1e-3
    steps = reps + 1
    variants: list[tuple[str, int, int, Callable]] = [
        (
            "torch AdamW fused (reference)",
            all_threads,
            28,
            lambda t: run_torch(numel, fragments, weights, grad, steps, t, fused=True),
        ),
        (
            "torch AdamW foreach",
            all_threads,
            28,
            lambda t: run_torch(numel, fragments, weights, grad, steps, t, fused=False),
        ),
        ("optim.fused_adamw_", all_threads, 28, lambda t: run_kernel(numel, fragments, weights, grad, steps, t)),
        ("optim.fused_adamw_", 1, 28, lambda t: run_kernel(numel, fragments, weights, grad, steps, t)),
        (
            f"fused_adamw_ chunked {chunk >> 20}M",
            all_threads,
            28,
            lambda t: run_kernel(numel, fragments, weights, grad, steps, t, chunk),
        ),
        (
            f"fused_adamw_ chunked {chunk >> 20}M",
            1,
            28,
            lambda t: run_kernel(numel, fragments, weights, grad, steps, t, chunk),
        ),
        (
            "SegmentState.push",
            all_threads,
            28,
            lambda t: run_segment_state(numel, fragments, weights, grad, steps, t, False),
        ),
        ("SegmentState.push", 1, 28, lambda t: run_segment_state(numel, fragments, weights, grad, steps, t, False)),
        (
            "push + weights(bf16)",
            all_threads,
            30,
            lambda t: run_segment_state(numel, fragments, weights, grad, steps, t, True),
        ),
        ("push + weights(bf16)", 1, 30, lambda t: run_segment_state(numel, fragments, weights, grad, steps, t, True)),
    ]
    results, reference = [], None
    for name, threads, bytes_per_param, run in variants:
        times, state = run(threads)
        if reference is None:
            reference, same = state, None
        else:
            same = all(torch.equal(a, b) for a, b in zip(state, reference))
        results.append(Result(name, threads, min(times[1:]), bytes_per_param, same))
        del state
        gc.collect()
    torch.set_num_threads(all_threads)
    copy = min(timed(lambda: grad.to(torch.float32, copy=True)) for _ in range(reps))
    model = (
        f"\nmodel: GPT n_layer={config.n_layer} n_embd={config.n_embd} vocab={config.vocab_size}: "
        f"{real / 1e6:.1f}M params in {len(fragments)} fragments (segment of {numel} elements)\n"
        f"SegmentState.push uses an fp32 gradient in place; the copy it used to make first "
        f"(gradient.to(float32, copy=True), a fresh allocation each push) would take {copy * 1e3:.0f} ms "
        f"alone, {numel * 8 / copy / 1e9:.1f} GB/s with its page faults"
    )
    print(f"measured {real / 1e6:.1f}M params", flush=True)
    return model, real, results


# --- output -------------------------------------------------------------------------
def print_table(params: int, results: list[Result], bandwidth: dict[int, dict[str, float]]) -> None:
    print(
        f"{'variant':32} {'thr':>3} {'ms/step':>9} {'Mparam/s':>9} {'GB/s':>6} "
        f"{'bound Mp/s':>10} {'ratio':>6}  bitwise==fused"
    )
    for r in results:
        rate = params / r.seconds
        bound = bandwidth[r.threads]["bound"] / r.bytes_per_param
        equal = "reference" if r.bitwise is None else ("yes" if r.bitwise else "NO")
        print(
            f"{r.name:32} {r.threads:>3} {r.seconds * 1e3:9.1f} {rate / 1e6:9.1f} "
            f"{rate * r.bytes_per_param / 1e9:6.2f} {bound / 1e6:10.1f} {rate / bound:6.2f}  {equal}"
        )
    fastest = min(results, key=lambda r: r.seconds)
    print(
        f"fastest: {fastest.name} on {fastest.threads} thread(s); bitwise equal to the reference: "
        f"{'reference itself' if fastest.bitwise is None else fastest.bitwise}"
    )
    ref = results[0].seconds
    for r in results[1:]:
        print(f"  RATIO {r.name} ({r.threads} thr) / torch fused: speed x{ref / r.seconds:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="50e6,200e6", help="comma-separated parameter counts")
    parser.add_argument("--reps", type=int, default=2, help="timed steps per variant (after one warm-up)")
    parser.add_argument(
        "--chunk-elements", type=int, default=1 << 20, help="chunk of the chunked variant (multiple of 64)"
    )
    args = parser.parse_args()
    all_threads = os.cpu_count() or 1
    thread_counts = sorted({1, all_threads})
    print(f"load average before: {_loadavg()}", flush=True)
    before = {t: stream_bandwidth(t) for t in thread_counts}
    measured = [measure_size(float(s), args.reps, args.chunk_elements, all_threads) for s in args.sizes.split(",")]
    after = {t: stream_bandwidth(t) for t in thread_counts}
    # On a shared box a neighbour's burst depresses any one measurement: the bound is the
    # best bandwidth seen, before or after the optimizer runs.
    bandwidth = {t: {k: max(before[t][k], after[t][k]) for k in before[t]} for t in thread_counts}
    print("\nSTREAM-style bandwidth (fp32, 3 x 512 MiB arrays, best of 3, before | after the runs):")
    for t in thread_counts:
        b, a = before[t], after[t]
        print(
            f"  {t} thread(s): copy {b['copy'] / 1e9:.1f} | {a['copy'] / 1e9:.1f}, triad {b['triad'] / 1e9:.1f} | "
            f"{a['triad'] / 1e9:.1f}, a+=s*c {b['update'] / 1e9:.1f} | {a['update'] / 1e9:.1f} GB/s "
            f"-> Adam bound (best / 28 B) {bandwidth[t]['bound'] / ADAM_BYTES_PER_PARAM / 1e6:.0f} Mparam/s"
        )
    for model, params, results in measured:
        print(model)
        print_table(params, results, bandwidth)
    print(
        "\nratio = achieved / (best STREAM bandwidth at that thread count / bytes per param); goal >= 0.8.\n"
        "GB/s = params/s x bytes per param (28, or 30 with the bf16 weights written)."
    )
    print(f"load average after: {_loadavg()} (other processes share these {all_threads} cores)")
    torch.set_num_threads(all_threads)


def _loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


if __name__ == "__main__":
    main()
