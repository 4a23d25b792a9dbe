"""Where a segment's first state comes from when it is added to the tiers: initial
weights, or a checkpoint read a partition at a time (:data:`StateSource`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from cargohold.services.core.state_precision import StoredMoment
from cargohold.services.tiers.fileformat import ARRAYS
from cargohold.services.tiers.tier import Partition

Moments = tuple[torch.Tensor, torch.Tensor] | tuple[StoredMoment, StoredMoment]
StateSource = Callable[[int, int], tuple[torch.Tensor, Moments | None]]
"""Elements ``[start, stop)`` of a segment -> fp32 master weights and (exp_avg, exp_avg_sq),
fp32 or already in the segment's stored form (a checkpoint of the same
``optim.state_dtype``, copied as it is), or None for zero moments. They are copied (and
fp32 ones encoded) before the next call, so a source may hand out views of one reused
scratch buffer."""


def tensor_source(initial: torch.Tensor, moments: tuple[torch.Tensor, torch.Tensor] | None = None) -> StateSource:
    """A :data:`StateSource` over whole-segment tensors."""

    def piece(start: int, stop: int) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        return initial[start:stop], None if moments is None else (moments[0][start:stop], moments[1][start:stop])

    return piece


def source_piece(source: StateSource, part: Partition, segment_id: int) -> tuple[torch.Tensor, Moments | None]:
    """The source's arrays for ``part``, checked to be fp32 (or the partition's stored form)
    of the partition's size."""
    master, moments = source(part.span.start, part.span.stop)
    for name, array in zip(ARRAYS, (master, *(moments or ()))):
        if isinstance(array, StoredMoment):
            if array.dtype != part.state_dtype or array.numel != part.span.numel:
                raise ValueError(
                    f"segment {segment_id}: the {name} source gave {array.numel} {array.dtype} elements for "
                    f"{part.key}, expected {part.span.numel} {part.state_dtype}"
                )
            continue
        if array.dtype != torch.float32 or array.shape != (part.span.numel,):
            raise ValueError(
                f"segment {segment_id}: the {name} source gave {array.dtype} of shape "
                f"{tuple(array.shape)} for {part.key}, expected float32 ({part.span.numel},)"
            )
    return master, moments
