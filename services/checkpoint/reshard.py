"""Restoring a checkpoint onto another layout: rebuild the layout that saved it from its
manifest, and map each segment of the new layout onto the saved flat space.

The flat space is worker-major (:mod:`cargohold.services.core.layout`): where a parameter
element sits depends on the worker count, the units and the alignment, so a
checkpoint saved by W workers cannot be read at the same flat offsets by W' workers. The
manifest therefore records everything that placed the parameters (its ``layout``,
:func:`layout_record`), the launcher rebuilds the saving layout (:func:`saved_layout`)
and gives each new segment the runs of the saved flat space that hold its elements
(:func:`segment_runs`); a state server reads only those. Runs follow parameters by name,
so the new layout may also order the parameters otherwise or form other units. Padding
is in no run: it restores as zeros.
"""

from __future__ import annotations

import math

from cargohold.services.checkpoint.manifest import LAYOUT_KIND, LayoutRecord, Manifest
from cargohold.services.core.errors import CheckpointError, LayoutError
from cargohold.services.core.layout import Layout, Segment, build_layout

Run = tuple[int, int, int]
"""``(segment_offset, saved_flat_start, length)``: elements ``[segment_offset,
segment_offset + length)`` of a new segment are the saved flat elements ``[saved_flat_start,
saved_flat_start + length)``."""


def layout_record(layout: Layout) -> LayoutRecord:
    """The manifest's ``layout``: what rebuilds ``layout`` with the manifest's model
    signature (its parameters, in layout order)."""
    return LayoutRecord(
        kind=LAYOUT_KIND,
        align=layout.align,
        num_workers=layout.num_workers,
        num_servers=layout.num_servers,
        unit_sizes=tuple(u.stop_param - u.first_param for u in layout.units),
        unit_names=tuple(u.name for u in layout.units),
    )


def saved_layout(manifest: Manifest, source: str) -> Layout:
    """The layout that wrote the checkpoint of ``manifest`` (read from ``source``, named
    in errors); refuses a recorded layout that does not rebuild one of ``total`` elements,
    checking first (:func:`check_layout_bounds`) what would make rebuilding it costly."""
    check_layout_bounds(manifest, source)
    record = manifest.layout
    try:
        layout = build_layout(
            manifest.model_signature,
            align=record.align,
            num_workers=record.num_workers,
            num_servers=record.num_servers,
            unit_sizes=record.unit_sizes,
            unit_names=record.unit_names,
        )
    except LayoutError as error:
        raise CheckpointError(f"{source}: the recorded layout cannot be rebuilt: {error}") from error
    if layout.total != manifest.total:
        raise CheckpointError(
            f"{source}: the recorded layout spans {layout.total} elements, the manifest's total is "
            f"{manifest.total}; the manifest is inconsistent"
        )
    return layout


def check_layout_bounds(manifest: Manifest, source: str) -> None:
    """Refuse, naming the field and ``source``, layout values the payload cannot hold,
    before anything is built from them: a layout of 10**7 workers over a few thousand
    elements once made a resume loop and grow for minutes.

    The units' padded sizes, laid out for ``num_workers``, must add up to ``total``
    (arithmetic over the parameters). Every server's range holds at least one
    ``align``-sized span of ``total`` and at least one segment record, and so does every
    worker's range of every non-empty unit: a checkpoint has a record for each
    segment (or more, one per partition), so these counts are bounded by what the
    manifest lists, and so is the work of rebuilding the layout."""
    record, total = manifest.layout, manifest.total
    spans, records = total // record.align, len(manifest.segments)
    if record.num_servers > min(spans, records):
        raise CheckpointError(
            f"{source}: layout.num_servers is {record.num_servers}, more than the payload can hold: its {total} "
            f"elements hold {spans} spans of layout.align {record.align}, it lists {records} segment records, "
            "and each server needs one of each; the manifest is inconsistent"
        )
    sizes = _padded_unit_sizes(manifest)
    if sizes is None:
        return  # the unit sizes do not fit the parameters: the rebuild names that
    worker_size, active = sum(sizes), sum(1 for size in sizes if size)
    if record.num_workers * active > records or record.num_workers > spans:
        raise CheckpointError(
            f"{source}: layout.num_workers is {record.num_workers}, more than the payload can hold: its "
            f"{active} non-empty units need a segment record per worker, and it lists {records} segment records "
            f"({spans} spans of layout.align {record.align} in all); the manifest is inconsistent"
        )
    if worker_size * record.num_workers != total:
        raise CheckpointError(
            f"{source}: the recorded layout spans {worker_size * record.num_workers} elements, the manifest's "
            f"total is {total}; the manifest is inconsistent"
        )


def _padded_unit_sizes(manifest: Manifest) -> list[int] | None:
    """Elements each unit of the saved layout reserves in a worker's range (the sum of
    its parameters' padded dim-0 chunks); None where the unit sizes (``layout.group_sizes``)
    do not add up to the parameters."""
    record = manifest.layout
    if sum(record.unit_sizes) != len(manifest.model_signature):
        return None
    reserved = []
    for _, shape in manifest.model_signature:
        rows, row_numel = (shape[0], math.prod(shape[1:])) if shape else (1, 1)
        padded = -(-rows // record.num_workers) * row_numel
        reserved.append(-(-padded // record.align) * record.align)
    sizes, first = [], 0
    for count in record.unit_sizes:
        sizes.append(sum(reserved[first : first + count]))
        first += count
    return sizes


def segment_runs(saved: Layout, new: Layout, segment: Segment) -> tuple[Run, ...]:
    """Where the real elements of ``segment`` (of layout ``new``) lie in the flat space of
    ``saved``, in segment order; adjacent runs are merged so that each is one read.

    A parameter ``saved`` lacks, or holds in another shape, raises CheckpointError
    (:func:`~cargohold.services.checkpoint.compat.check_compatible` names every difference first).
    """
    index = {place.name: i for i, place in enumerate(saved.params)}
    runs: list[Run] = []
    for fragment in segment.fragments:
        place = new.params[fragment.param_index]
        if place.name not in index or saved.params[index[place.name]].shape != place.shape:
            raise CheckpointError(f"the checkpoint holds no parameter {place.name!r} of shape {place.shape}")
        shift = fragment.segment_start - fragment.param_start
        for flat_start, param_start, length in saved.flat_runs(
            index[place.name], fragment.param_start, fragment.length
        ):
            offset = param_start + shift
            if runs and runs[-1][0] + runs[-1][2] == offset and runs[-1][1] + runs[-1][2] == flat_start:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + length)
            else:
                runs.append((offset, flat_start, length))
    return tuple(runs)
