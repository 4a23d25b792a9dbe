"""Writing checkpoints for the tests the way state servers and the launcher write them:
each segment in an all-RAM registry, saved by :class:`SegmentCheckpointer`, the
manifest committed last. Used by the checkpoint tests and by their forked writers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from cargohold.services.checkpoint import MANIFEST_NAME, CheckpointDir, LayoutRecord, Manifest, check_compatible
from cargohold.services.checkpoint.reshard import layout_record, saved_layout, segment_runs
from cargohold.services.checkpoint.writer import Records, SegmentCheckpointer
from cargohold.services.core.layout import Layout, build_layout
from cargohold.services.core.optim import AdamWHyperParams
from cargohold.services.core.segment_spec import SegmentSpec
from cargohold.services.segments.segment_registry import SegmentRegistry
from cargohold.services.tiers.fileformat import ARRAYS
from cargohold.services.tiers.source import tensor_source
from cargohold.services.tiers.storage import TieredStorage


def random_data(total: int, seed: int) -> dict[str, torch.Tensor]:
    """master, exp_avg and exp_avg_sq of ``total`` elements, a pure function of ``seed``."""
    block = np.random.default_rng(seed).standard_normal((len(ARRAYS), total), dtype=np.float32)
    return {name: torch.from_numpy(block[i]) for i, name in enumerate(ARRAYS)}


def flat_layout(total: int) -> LayoutRecord:
    """The layout record of a model of one flat parameter of ``total`` elements."""
    return layout_record(build_layout([("flat", (total,))], num_workers=1, num_servers=1, align=1))


def write_segments(
    directory: Path,
    step: int,
    updates: int,
    data: dict[str, torch.Tensor],
    segments: list[tuple[int, int, int]],
    *,
    run: str = "run-test",
    server: int = 0,
) -> Records:
    """What a state server holding ``segments`` ((id, start, stop) of the flat buffer
    ``data``) at update ``updates`` writes into ``directory`` for a checkpoint of ``step``."""
    registry = SegmentRegistry(TieredStorage(None))
    try:
        for segment_id, start, stop in segments:
            spec = SegmentSpec(
                run_id=run,
                segment_id=segment_id,
                start=start,
                numel=stop - start,
                fragments=((0, stop - start),),
                grad_dtype="float32",
                hyper=AdamWHyperParams(),
            )
            moments = (data["exp_avg"][start:stop], data["exp_avg_sq"][start:stop])
            registry.restore(spec, tensor_source(data["master"][start:stop], moments), updates)
        checkpointer = SegmentCheckpointer(registry, f"server{server}")
        checkpointer.begin(run, str(directory), step)
        return checkpointer.wait()
    finally:
        registry.close()


def flat_manifest(step: int, updates: int, total: int, records: Records) -> Manifest:
    """The manifest of a model of one flat parameter of ``total`` elements."""
    return Manifest(
        step=step,
        updates=updates,
        run_id="run-test",
        config={},
        model_signature=(("flat", (total,)),),
        layout=flat_layout(total),
        total=total,
        segments=tuple(sorted((r for r, _ in records), key=lambda r: r.start)),
        files=tuple(f for _, f in records),
    )


def save(store: CheckpointDir, step: int, data: dict[str, torch.Tensor], cuts: list[int]) -> Path:
    """A complete save: begin, one payload file per piece between ``cuts`` (a segment at
    update ``step - 1``: one step was skipped), commit."""
    total = data["master"].numel()
    bounds = [0, *cuts, total]
    segments = [(index, start, stop) for index, (start, stop) in enumerate(zip(bounds, bounds[1:]))]
    records = write_segments(store.begin(step), step, step - 1, data, segments)
    return store.commit(step, flat_manifest(step, step - 1, total, records))


# A model with three FSDP2-like groups; no row count divides evenly by 2, 3 or 4 workers.
SHAPES = [
    ("wte", (301, 24)),
    ("wpe", (19, 24)),
    ("ln_f", (25,)),
    ("blocks.0.w", (41, 24)),
    ("blocks.0.b", (41,)),
    ("blocks.1.w", (29, 13)),
    ("blocks.1.scale", ()),
    ("blocks.1.b", (7,)),
]
UNITS = {"unit_sizes": [3, 2, 3], "unit_names": ["", "blocks.0", "blocks.1"]}
RUN = "run-r"


def unit_layout(workers: int, servers: int) -> Layout:
    """The layout of ``SHAPES`` in ``UNITS`` over ``workers`` and ``servers``."""
    return build_layout(SHAPES, num_workers=workers, num_servers=servers, **UNITS)


def save_layout(
    store: CheckpointDir, step: int, layout: Layout, data: dict[str, torch.Tensor], config: dict | None = None
) -> Path:
    """Save the way state servers and the launcher do: each server its segments, the
    layout (and ``config``, a config as plain data) recorded in the manifest."""
    directory = store.begin(step)
    records = []
    for server in range(layout.num_servers):
        segments = [(s.segment_id, s.start, s.stop) for s in layout.segments_of_server(server)]
        records += write_segments(directory, step, step, data, segments, run=RUN, server=server)
    manifest = Manifest(
        step=step,
        updates=step,
        run_id=RUN,
        config=config or {},
        model_signature=tuple((p.name, p.shape) for p in layout.params),
        layout=layout_record(layout),
        total=layout.total,
        segments=tuple(r for r, _ in records),
        files=tuple(f for _, f in records),
    )
    return store.commit(step, manifest)


def restore(path: Path, target: Layout, server: int, registry: SegmentRegistry) -> None:
    """What the launcher and a state server do on resume, without Ray."""
    manifest = CheckpointDir(path.parent).load(path)
    saved = saved_layout(manifest, str(path / MANIFEST_NAME))
    check_compatible(manifest, model_signature=[(p.name, p.shape) for p in target.params], align=target.align)
    segments = [
        (
            SegmentSpec(
                run_id=RUN,
                segment_id=seg.segment_id,
                start=seg.start,
                numel=seg.numel,
                fragments=tuple((f.segment_start, f.length) for f in seg.fragments),
                grad_dtype="float32",
                hyper=AdamWHyperParams(),
            ),
            segment_runs(saved, target, seg),
        )
        for seg in target.segments_of_server(server)
    ]
    SegmentCheckpointer(registry, f"server{server}").restore(str(path), manifest, segments)
