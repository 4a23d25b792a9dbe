"""Host-device copy bandwidth through cargohold's exchange buffers against plain pinned memory.

    python benchmarks/pinned_copy.py                 # 256 MiB, 10 copies each way
    python benchmarks/pinned_copy.py --mib 1024 --repeats 5

Needs CUDA. cargohold's path: a GPU worker's exchange slot, a sealed memfd shared with a
co-located state server and page-locked in place (services/worker/page_lock.py); a reduced
gradient is copied device to host into the slot's gradients, updated weights host to
device from its weights, with ``non_blocking`` copies on a side stream as the worker does.
The baseline: the same copies between the device and ``torch.empty(pin_memory=True)``.
Prints GB/s of each and the ratios (1.0: the shared region copies as fast as pinned
memory can).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cargohold.services.worker.state_port import ExchangeBuffers

MIB = 1 << 20


def bandwidth(copy, nbytes: int, repeats: int, stream: torch.cuda.Stream) -> float:
    """Median bytes/s of ``copy()`` on ``stream`` (after one warm-up)."""
    times = []
    for attempt in range(repeats + 1):
        torch.cuda.synchronize()
        started = time.perf_counter()
        with torch.cuda.stream(stream):
            copy()
        stream.synchronize()
        if attempt:
            times.append(time.perf_counter() - started)
    return nbytes / statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="bytes per copy (one slot's gradients)")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("pinned_copy.py needs a CUDA device")
    numel = args.mib * MIB // 4
    buffers = ExchangeBuffers.allocate(
        numel, torch.float32, torch.float32, slots=1, shared_name="bench-pinned-copy", pin=True
    )
    try:
        if buffers.pin_refused is not None:
            print(f"WARNING the exchange buffers are pageable: {buffers.pin_refused}")
        slot = buffers.slots[0]
        plain = torch.empty(numel, dtype=torch.float32, pin_memory=True)
        device = torch.randn(numel, device="cuda")
        stream = torch.cuda.Stream()
        nbytes = numel * 4
        figures = {
            "d2h cargohold": bandwidth(
                lambda: slot.grads.copy_(device, non_blocking=True), nbytes, args.repeats, stream
            ),
            "d2h plain pinned": bandwidth(lambda: plain.copy_(device, non_blocking=True), nbytes, args.repeats, stream),
            "h2d cargohold": bandwidth(
                lambda: device.copy_(slot.weights, non_blocking=True), nbytes, args.repeats, stream
            ),
            "h2d plain pinned": bandwidth(lambda: device.copy_(plain, non_blocking=True), nbytes, args.repeats, stream),
        }
    finally:
        buffers.close()
    print(f"device: {torch.cuda.get_device_name()}; {args.mib} MiB per copy, median of {args.repeats}")
    for name, rate in figures.items():
        print(f"{name:18} {rate / 1e9:7.2f} GB/s")
    for way in ("d2h", "h2d"):
        ratio = figures[f"{way} cargohold"] / figures[f"{way} plain pinned"]
        print(f"RATIO {way} cargohold / plain pinned = {ratio:.3f}")


if __name__ == "__main__":
    main()
