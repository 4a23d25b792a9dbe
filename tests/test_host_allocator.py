"""How a worker gets host memory for what a step frees and allocates again (every unit's
gathered weights, gradients and activations): mimalloc reuses it, and glibc, the other
choice, maps the large buffers on transparent huge pages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cargohold.cluster.schema.worker import WorkerConfig
from cargohold.services.worker.host_allocator import loaded_allocator, resolve_allocator, worker_env

ALLOCATE_AGAIN = """
import json, resource
import torch
from cargohold.services.worker.host_allocator import loaded_allocator
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
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"allocator": loaded_allocator(), "faults": faults}))
"""


PLAIN_PAGES = {"GLIBC_TUNABLES": ""}
"""glibc's environment without its huge pages: every mapping faulted 4 KiB at a time."""


def _faults(allocator: str, **env: str) -> dict:
    """Faults of 3 steps after 3, in a process started as a worker is with ``allocator``,
    its environment updated with ``env``."""
    done = subprocess.run(
        [sys.executable, "-c", ALLOCATE_AGAIN],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **worker_env(allocator), **env},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _fewest_faults(allocator: str, runs: int, **env: str) -> dict:
    """The run of ``runs`` with the fewest faults (an allocator sometimes places a large
    buffer afresh in a step or two after the first ones)."""
    return min((_faults(allocator, **env) for _ in range(runs)), key=lambda r: r["faults"])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD and glibc")
def test_mimalloc_serves_a_step_from_the_memory_the_last_one_freed() -> None:
    glibc = _fewest_faults("glibc", 2, **PLAIN_PAGES)
    mimalloc = _fewest_faults("mimalloc", 2)
    assert (glibc["allocator"], mimalloc["allocator"]) == ("glibc", "mimalloc")
    # glibc maps the large buffers (above the 4 MiB threshold) for every step: every step
    # faults their ~36 MiB in again (4 KiB pages)...
    assert glibc["faults"] >= 3 * 8 * 1024, glibc
    # ...where mimalloc keeps what a step frees for the next.
    assert mimalloc["faults"] * 4 < glibc["faults"], (glibc, mimalloc)


def _transparent_huge_pages() -> str:
    """The kernel's THP mode ("always", "madvise", "never"), or "" where it has none."""
    try:
        modes = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return ""
    return modes.partition("[")[2].partition("]")[0]


@pytest.mark.skipif(
    _transparent_huge_pages() != "madvise",
    reason="huge pages on request need THP in 'madvise' mode ('always' gives them to every mapping)",
)
def test_the_workers_large_buffers_are_faulted_in_on_huge_pages() -> None:
    plain = _fewest_faults("glibc", 2, **PLAIN_PAGES)
    huge = _fewest_faults("glibc", 2)
    assert plain["faults"] >= 3 * 8 * 1024, plain  # ~36 MiB a step in 4 KiB pages
    assert huge["faults"] * 4 < plain["faults"], (plain, huge)  # 2 MiB pages, but for the unaligned ends


def test_workers_run_mimalloc_unless_the_run_has_one_host_budget() -> None:
    assert WorkerConfig().host_allocator == "auto"
    assert resolve_allocator("auto", None) == "mimalloc"
    assert resolve_allocator("auto", 3 << 30) == "glibc"  # host memory is what is short there
    assert resolve_allocator("mimalloc", 3 << 30) == "mimalloc"
    assert Path(worker_env("mimalloc")["LD_PRELOAD"]).is_file()


def test_the_drivers_environment_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MIMALLOC_PURGE_DELAY", "100")
    assert worker_env("mimalloc")["MIMALLOC_PURGE_DELAY"] == "100"
    assert "LD_PRELOAD" not in worker_env("glibc")


def test_the_loaded_allocator_is_read_from_the_memory_map(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_text("7f0000000000-7f0000001000 r-xp 00000000 08:01 42 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert loaded_allocator(maps) == "glibc"
    mimalloc = "7f0000002000-7f0000003000 r-xp 00000000 08:01 43 /site/cmeel.prefix/lib/libmimalloc.so\n"
    maps.write_text(maps.read_text() + mimalloc)
    assert loaded_allocator(maps) == "mimalloc"
