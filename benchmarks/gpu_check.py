"""`make gpu-check`: the GPU checks of cargohold in one run of at most 8 minutes.

    python benchmarks/gpu_check.py            # from the repository root, on a machine with CUDA

1. the correctness contract on CUDA with NCCL (tests/test_gpu_contract.py) and the other
   tests marked ``gpu``: bitwise against torch's fused AdamW;
2. host-device copy bandwidth through cargohold's page-locked shared exchange buffers
   against plain pinned memory (benchmarks/pinned_copy.py);
3. benchmarks/end_to_end.py on examples/gpu-check.yaml: the offloaded step against the
   same model trained all on the GPU with AdamW (goal: step ratio <= 1.15).

Each part runs with its own time limit; a part that fails or runs out of time is
reported and the next one runs. The last lines are one line per figure.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = (
    ("gpu tests", [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests"], 200),
    ("pinned copies", [sys.executable, "benchmarks/pinned_copy.py"], 60),
    (
        "end to end",
        [sys.executable, "benchmarks/end_to_end.py", "--config", "examples/gpu-check.yaml", "--variants", "zero3+ac",
         "--steps", "6", "--warmup", "2"],
        200,
    ),
)  # fmt: skip
FIGURE = re.compile(r"^(RATIO .*|\d+ (passed|skipped).*|.*\d+ failed.*|d2h .*|h2d .*)$")


def main() -> int:
    started = time.monotonic()
    figures: list[str] = []
    failed = False
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for name, command, limit in PARTS:
        print(f"=== {name}: {' '.join(command[1:])} (limit {limit} s)", flush=True)
        try:
            done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit)
            output, code = done.stdout + done.stderr, done.returncode
        except subprocess.TimeoutExpired as expired:
            output = (expired.stdout or b"").decode() if isinstance(expired.stdout, bytes) else (expired.stdout or "")
            code = None
        print(output, flush=True)
        lines = [line.strip() for line in output.splitlines() if FIGURE.match(line.strip())]
        status = "timed out" if code is None else ("ok" if code == 0 else f"exit {code}")
        failed |= code != 0
        figures += [f"{name}: {line}" for line in lines] or [f"{name}: no figure ({status})"]
        if code != 0:
            figures.append(f"{name}: {status}")
    print(f"=== figures ({time.monotonic() - started:.0f} s in all)")
    for line in figures:
        print(line)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
