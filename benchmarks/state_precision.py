"""How fast is the AdamW update over moments stored as fp32, bf16 and 8-bit blocks?

    python benchmarks/state_precision.py                        # 64 Mi parameters, 5 rounds
    python benchmarks/state_precision.py --params 16777216 --rounds 3 --threads 1

One flat parameter range per kind (``services/core/state_precision.py``), the same fp32 gradient
for all, one warm-up update each so the moments hold real values. Then ``--rounds`` rounds,
each timing one ``adamw_step_`` of every kind in turn (interleaved, so load from other
processes falls on all kinds alike); a kind's time is the median of its rounds. Also the
codec alone: ``decode_range`` and ``encode_range_`` of one moment, piece by piece.

Bytes moved per parameter: the state read and written (master, both moments and their
scales, each way) plus the gradient read: 28 (fp32), 20 (bf16), 16.06 (8-bit). GB/s is
that over the median time. Only the call itself is inside the timed window: the garbage
collector is off and nothing samples (no profiler, no metrics thread, no logging).
The last lines, ``RATIO <kind> / float32 time`` and ``... bytes_per_param``, compare each
kind with fp32 from this same run. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics

import torch
from timing import timed

from cargohold.services.core.optim import AdamWHyperParams
from cargohold.services.core.state_precision import (
    PIECE_ELEMENTS,
    STATE_DTYPES,
    StateDtype,
    StoredMoment,
    adamw_step_,
    bytes_per_parameter,
    decode_range,
    encode_range_,
    zeros,
)

HYPER = AdamWHyperParams()


def moved_per_parameter(dtype: StateDtype) -> float:
    """State read and written once each, plus the fp32 gradient read."""
    return 2 * bytes_per_parameter(dtype) + 4


def update_seconds(
    master: torch.Tensor, moments: tuple[StoredMoment, StoredMoment], gradient: torch.Tensor, step: torch.Tensor
) -> float:
    return timed(lambda: adamw_step_(master, *moments, gradient, step=step, lr=1e-3, hyper=HYPER))


def codec_seconds(stored: StoredMoment, rounds: int) -> tuple[float, float]:
    """The median seconds of a decode and of an encode of a whole moment, a piece at a time
    (an encode is timed as decode + encode, less the decode)."""
    buffer = torch.empty(PIECE_ELEMENTS)

    def decode_all() -> None:
        for start in range(0, stored.numel, PIECE_ELEMENTS):
            decode_range(stored, start, buffer[: min(PIECE_ELEMENTS, stored.numel - start)])

    def encode_all() -> None:
        for start in range(0, stored.numel, PIECE_ELEMENTS):
            piece = buffer[: min(PIECE_ELEMENTS, stored.numel - start)]
            decode_range(stored, start, piece)
            encode_range_(stored, start, piece)

    decode = statistics.median(timed(decode_all) for _ in range(rounds))
    return decode, statistics.median(timed(encode_all) for _ in range(rounds)) - decode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, default=64 << 20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    n = args.params
    print(f"{n} parameters, torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs")
    print(f"load average before: {os.getloadavg()[0]:.2f}")

    generator = torch.Generator().manual_seed(0)
    gradient = torch.randn(n, generator=generator) * 1e-3
    start_weights = torch.randn(n, generator=generator)
    states = {}
    for dtype in STATE_DTYPES:
        master = start_weights.clone()
        moments = (zeros(dtype, "exp_avg", n), zeros(dtype, "exp_avg_sq", n))
        adamw_step_(master, *moments, gradient, step=torch.tensor(1.0), lr=1e-3, hyper=HYPER)  # warm-up
        states[dtype] = (master, moments)

    seconds: dict[str, list[float]] = {dtype: [] for dtype in STATE_DTYPES}
    gc.collect()
    gc.disable()
    try:
        for round_ in range(args.rounds):
            step = torch.tensor(float(round_ + 2))
            for dtype, (master, moments) in states.items():
                seconds[dtype].append(update_seconds(master, moments, gradient, step))
    finally:
        gc.enable()
    print(f"load average after: {os.getloadavg()[0]:.2f}")

    median = {dtype: statistics.median(times) for dtype, times in seconds.items()}
    for dtype in STATE_DTYPES:
        t = median[dtype]
        print(
            f"{dtype:10s} update {t:7.3f} s (min {min(seconds[dtype]):.3f})  {n / t / 1e6:7.1f} M params/s  "
            f"state {bytes_per_parameter(dtype):.5g} B/param  moved {moved_per_parameter(dtype):.5g} B/param  "
            f"{n * moved_per_parameter(dtype) / t / 1e9:6.2f} GB/s"
        )
    for dtype in STATE_DTYPES[1:]:
        for moment in states[dtype][1]:
            decode, encode_ = codec_seconds(moment, args.rounds)
            print(
                f"{dtype:10s} {moment.moment:10s} decode {n / decode / 1e6:7.1f} M elements/s  "
                f"encode {n / encode_ / 1e6:7.1f} M elements/s"
            )
    for dtype in STATE_DTYPES[1:]:
        print(f"RATIO {dtype} / float32 time {median[dtype] / median['float32']:.3f}")
        ratio = bytes_per_parameter(dtype) / bytes_per_parameter("float32")
        print(f"RATIO {dtype} / float32 bytes_per_param {ratio:.4f}")


if __name__ == "__main__":
    main()
