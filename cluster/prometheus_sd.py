"""Publish a run's metrics endpoints for Prometheus' file-based service discovery.

Each actor serves its metrics on a port chosen at start (unless metrics.port fixes a
range), so a static scrape config cannot name them; Prometheus re-reads a file_sd file
whenever it changes. The file is replaced atomically so a reader never sees half of it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from cargohold.services.core.durable import replace_durably


@dataclass(frozen=True, slots=True)
class Target:
    address: str
    role: str
    index: int


def write_file_sd(path: str | Path, run_id: str, targets: list[Target]) -> None:
    """Write ``targets`` as a file_sd JSON list, replacing the file durably."""
    path = Path(path)
    groups = [
        {"targets": [t.address], "labels": {"job": "cargohold", "run": run_id, "role": t.role, "index": str(t.index)}}
        for t in targets
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    with replace_durably(path) as temporary:
        Path(temporary).write_text(json.dumps(groups, indent=2), encoding="utf-8")
