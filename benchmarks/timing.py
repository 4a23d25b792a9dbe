"""Wall-clock and CPU timing shared by the benchmark scripts."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes."""
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def cpu_seconds(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of a process so far (``/proc/<pid>/stat``; 0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0, 0.0
    return int(fields[11]) / CLOCK_TICKS, int(fields[12]) / CLOCK_TICKS
