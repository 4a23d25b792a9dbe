"""The NVMe tier the plan tests plan with (and the real runs they compare against use)."""

from __future__ import annotations

from pathlib import Path

NVME_TIER = {"ram_budget_bytes": 400 << 10, "partition_bytes": 64 << 10, "buffer_count": 3, "io_threads": 2}
"""The bitwise NVMe contract test's tier: ~1.6 MiB of state, most of it on disk."""


def nvme_tier(tmp_path: Path, **overrides) -> dict:
    """``NVME_TIER`` on two paths under ``tmp_path``, with ``overrides``."""
    return {**NVME_TIER, "nvme_paths": [str(tmp_path / "nvme0"), str(tmp_path / "nvme1")], **overrides}
