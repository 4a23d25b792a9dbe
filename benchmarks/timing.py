"""Wall-clock timing shared by the benchmark scripts."""

from __future__ import annotations

import time
from collections.abc import Callable


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes."""
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started
