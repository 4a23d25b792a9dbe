"""The tier store of the tier storage tests: one segment of 11 partitions (16 KiB
partitions, the last one short, padding between its fragments) over two NVMe paths whose
RAM budget holds the staging buffers and two resident partitions, trained with clipping
on; an observer that records what the store reports. Used by the ``test_tier_storage*``
modules."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from cargohold.cluster.schema.server import TierConfig
from cargohold.services.core.optim import AdamWHyperParams
from cargohold.services.core.segment_spec import SegmentSpec
from cargohold.services.segments.segment_state import SegmentState
from cargohold.services.tiers.fileformat import FileLayout, gradient_file_bytes
from cargohold.services.tiers.residency import Residency
from cargohold.services.tiers.storage import TieredStorage

HYPER = AdamWHyperParams(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, max_grad_norm=1.0)
PARTITION_BYTES = 16 << 10  # 1344 elements a partition
PER_PARTITION = 1344
NUMEL = 10 * PER_PARTITION + 320  # 11 partitions, the last one short
FRAGMENTS = ((0, 5000), (5056, 6000), (11072, 2688))  # cut at multiples of 64; padding between
GRADIENT_BYTES = gradient_file_bytes(PER_PARTITION, 4)  # a partition's staged fp32 gradient
BUFFER_BYTES = FileLayout(PER_PARTITION).file_bytes + GRADIENT_BYTES
"""A partition in its file layout with its staged fp32 gradient: what a staging buffer and
what a resident partition each cost the budget."""
BUFFERS = 3
BUDGET = BUFFERS * BUFFER_BYTES + 2 * BUFFER_BYTES  # staging plus two resident partitions
LR = 1e-2
NORM = 2.0  # > max_grad_norm: clipping is active


def tier_segment_spec(segment_id: int = 0, run_id: str = "run-t") -> SegmentSpec:
    """Segment ``segment_id`` of ``run_id``: ``NUMEL`` elements at 0, ``FRAGMENTS``, fp32 gradients."""
    return SegmentSpec(
        run_id=run_id,
        segment_id=segment_id,
        start=0,
        numel=NUMEL,
        fragments=FRAGMENTS,
        grad_dtype="float32",
        hyper=HYPER,
    )


def seeded_randn(seed: int) -> torch.Tensor:
    """``NUMEL`` standard normal values, a pure function of ``seed``: weights or a gradient."""
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed))


def tier_config(tmp_path: Path, **changes: object) -> TierConfig:
    """The tier on two paths under ``tmp_path`` (d0, d1) with ``BUDGET``, with ``changes``."""
    fields: dict[str, object] = dict(
        nvme_paths=[str(tmp_path / "d0"), str(tmp_path / "d1")],
        ram_budget_bytes=BUDGET,
        partition_bytes=PARTITION_BYTES,
        buffer_count=BUFFERS,
        io_threads=2,
    )
    fields.update(changes)
    return TierConfig(**fields)  # type: ignore[arg-type]


def assert_same_segment(tiered: SegmentState, ram: SegmentState) -> None:
    """Assert the two states' arrays are bitwise equal."""
    a, b = tiered.snapshot(), ram.snapshot()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs"


class Recorder:
    """A TierObserver that keeps what it is told."""

    def __init__(self) -> None:
        self.io: dict[str, list[int]] = {"read": [], "write": []}
        self.hits = self.misses = 0
        self.wait = 0.0
        self.depths: list[int] = []
        self.plans: list[dict[str, int]] = []

    def record_tier_io(self, op: str, nbytes: int, seconds: float) -> None:
        self.io[op].append(nbytes)

    def set_tier_queue_depth(self, depth: int) -> None:
        self.depths.append(depth)

    def record_prefetch(self, hit: bool) -> None:
        self.hits += hit
        self.misses += not hit

    def add_tier_io_wait(self, seconds: float) -> None:
        self.wait += seconds

    def set_tier_plan(self, partitions: dict[str, int], predicted_io_seconds: float) -> None:
        self.plans.append(partitions)


@contextmanager
def open_storage(config: TierConfig, observer: Recorder | None = None) -> Iterator[TieredStorage]:
    """A TieredStorage of ``config`` reporting to ``observer``, closed on the way out."""
    storage = TieredStorage(config, observer=observer)
    try:
        yield storage
    finally:
        storage.close()


def cold_disk_file(storage: TieredStorage) -> str:
    """A disk partition in the middle of the segment: not among the last ones written, so
    no staging buffer still holds it and the next step must read its file."""
    disk = [r for r in storage.rows() if r.actual is Residency.NVME]
    return disk[len(disk) // 2].path
