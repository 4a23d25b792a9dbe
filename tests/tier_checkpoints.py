"""The state server of the tier checkpoint tests: two segments of 11 partitions each (16
KiB partitions, the last one short) in a registry over an NVMe tier whose RAM budget
holds a few of them, trained with clipping on, saved as state servers save (each segment
preserved by :class:`SegmentCheckpointer`, the manifest committed last) and read back.
Used by the tier checkpoint tests and by their SIGKILLed writer processes."""

from __future__ import annotations

from pathlib import Path

import torch

from cargohold.cluster.schema.server import TierConfig
from cargohold.services.checkpoint import CheckpointDir, Manifest, read_flat_range
from cargohold.services.checkpoint.reshard import layout_record
from cargohold.services.checkpoint.writer import SegmentCheckpointer
from cargohold.services.core.errors import CheckpointError
from cargohold.services.core.layout import build_layout
from cargohold.services.core.optim import AdamWHyperParams
from cargohold.services.core.segment_spec import SegmentSpec
from cargohold.services.segments.segment_registry import SegmentRegistry
from cargohold.services.tiers.fileformat import ARRAYS, FileLayout, gradient_file_bytes
from cargohold.services.tiers.residency import PartitionKey, Residency
from cargohold.services.tiers.storage import TieredStorage

RUN = "run-ck"
HYPER = AdamWHyperParams(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, max_grad_norm=1.0)
PER_PARTITION = 1344  # 16 KiB partitions
NUMEL = 10 * PER_PARTITION + 320  # 11 partitions, the last one short
FRAGMENTS = ((0, 5000), (5056, 6000), (11072, 2688))
SEGMENTS = 2
TOTAL = SEGMENTS * NUMEL
BUFFER_BYTES = FileLayout(PER_PARTITION).file_bytes + gradient_file_bytes(PER_PARTITION, 4)
"""A partition in its file layout with its staged fp32 gradient: what a staging buffer or a
resident partition costs the budget."""
LR = 1e-2
NORM = 2.0  # > max_grad_norm: clipping is active
FLAT = (("flat", (TOTAL,)),)
"""The model signature of the checkpoints: one flat parameter."""


def tier_config(root: Path, **changes: object) -> TierConfig:
    """An NVMe tier on two paths under ``root`` whose RAM budget holds five partitions, with ``changes``."""
    fields: dict[str, object] = dict(
        nvme_paths=[str(root / "d0"), str(root / "d1")],
        ram_budget_bytes=5 * BUFFER_BYTES,
        partition_bytes=16 << 10,
        buffer_count=3,
        io_threads=2,
    )
    fields.update(changes)
    return TierConfig(**fields)  # type: ignore[arg-type]


def specs() -> list[SegmentSpec]:
    """The ``SEGMENTS`` segments, one after the other in the flat space."""
    return [
        SegmentSpec(
            run_id=RUN,
            segment_id=i,
            start=i * NUMEL,
            numel=NUMEL,
            fragments=FRAGMENTS,
            grad_dtype="float32",
            hyper=HYPER,
        )
        for i in range(SEGMENTS)
    ]


def whole_segments() -> list[tuple[SegmentSpec, tuple[tuple[int, int, int], ...]]]:
    """Each spec with the run restoring all of it from where it was saved (same layout)."""
    return [(spec, ((0, spec.start, spec.numel),)) for spec in specs()]


def fresh_registry(tier: TierConfig | None) -> SegmentRegistry:
    """A registry over ``tier`` (None: all in RAM) holding every segment at seeded initial values."""
    registry = SegmentRegistry(TieredStorage(tier))
    for spec in specs():
        registry.register(spec, torch.randn(NUMEL, generator=torch.Generator().manual_seed(spec.segment_id)))
    return registry


def push_steps(registry: SegmentRegistry, steps: range) -> None:
    """Update every segment once per step in ``steps``, each step's gradients seeded by the step."""
    for step in steps:
        for spec in specs():
            gradient = torch.randn(NUMEL, generator=torch.Generator().manual_seed(1000 * step + spec.segment_id))
            registry.get(RUN, spec.segment_id).apply_gradient(step, gradient, global_norm=NORM, lr=LR)


def state_of(registry: SegmentRegistry) -> dict[str, torch.Tensor]:
    """Every array of the registry's segments, concatenated in flat order."""
    segments = [registry.get(RUN, spec.segment_id).snapshot() for spec in specs()]
    return {key: torch.cat([s[key] for s in segments]) for key in ARRAYS}


def assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Assert every array of ``a`` and ``b`` is bitwise equal."""
    for key in ARRAYS:
        assert torch.equal(a[key], b[key]), f"{key} differs"


def save_checkpoint(store: CheckpointDir, registry: SegmentRegistry, step: int) -> tuple[Path, dict[str, int]]:
    """Save and commit ``step`` as server 0 (aborted on a CheckpointError); the folder,
    and how many partitions were linked, copied and written."""
    checkpointer = SegmentCheckpointer(registry, "server0")
    directory = store.begin(step)
    update = checkpointer.begin(RUN, str(directory), step)
    try:
        records = checkpointer.wait()
    except CheckpointError:
        store.abort(step)
        raise
    manifest = Manifest(
        step=step,
        updates=update,
        run_id=RUN,
        config={},
        model_signature=FLAT,
        layout=layout_record(build_layout(FLAT, num_workers=1, num_servers=1, align=1)),
        total=TOTAL,
        segments=tuple(sorted((r for r, _ in records), key=lambda r: r.start)),
        files=tuple(f for _, f in records),
    )
    return store.commit(step, manifest), checkpointer.preserved


def read_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """Every array of the checkpoint at ``path``, whole."""
    manifest = CheckpointDir(path.parent).load(path)
    return read_flat_range(path, manifest, 0, manifest.total)


def disk_rows(registry: SegmentRegistry) -> dict[PartitionKey, str]:
    """The partitions now on the NVMe tier, with their files."""
    return {r.key: r.path for r in registry.storage.rows(RUN) if r.actual is Residency.NVME}


def checkpoint_file(path: Path, key: PartitionKey) -> Path:
    """The name a checkpoint at ``path`` gives partition ``key``'s file."""
    return path / f"server0-shard{key.segment_id:06d}-part{key.index:05d}.tier"
