"""worker.retain_freed_memory: a buffer freed and allocated again (what a step does with
every unit's gathered weights, gradients and activations) is not faulted in again."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cargohold.cluster.config import WorkerConfig
from cargohold.cluster.launcher import worker_env

ALLOCATE_AGAIN = """
import json, resource, sys
import torch
from cargohold.services.host_allocator import retain_freed_memory
applied = retain_freed_memory() if sys.argv[1] == "retain" else False
# A step's buffers, as a unit's gathered weights, gradients and activations: allocated,
# filled and freed, step after step.
SIZES = [6 << 20, 6 << 20, 3 << 19, 3 << 19, 24 << 20, 1 << 20]
def step():
    held = [torch.ones(n // 4) for n in SIZES]
    del held
for _ in range(3):  # the heap settles into its layout in the first steps
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    step()
print(json.dumps({"applied": applied, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def _faults(mode: str) -> dict:
    """Faults of 3 steps after 3, in a process with the workers' environment (its fixed
    mmap threshold: without one, glibc raises its threshold as large blocks are freed and
    may come to keep them anyway)."""
    done = subprocess.run(
        [sys.executable, "-c", ALLOCATE_AGAIN, mode],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **worker_env()},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_retained_buffers_are_not_faulted_in_again_every_step() -> None:
    default, retained = _faults("default"), _faults("retain")
    assert retained["applied"] and not default["applied"]
    # glibc maps the large buffers (above the workers' 4 MiB threshold) for every step:
    # every step faults their ~36 MiB in again (4 KiB pages)...
    assert default["faults"] >= 3 * 8 * 1024, default
    # ...where the retained heap serves the next step from the pages the last one freed.
    assert retained["faults"] * 10 < default["faults"], (default, retained)


def test_the_setting_is_off_by_default() -> None:
    assert WorkerConfig().retain_freed_memory is False
