"""Gradient accumulation on a worker: :class:`Accumulator` sums the reduced gradient
chunks of a step's micro-batches, so that the state servers get one push per step.

The sum is fp32 whatever the wire dtype, and each micro-batch's chunk is cast to fp32
before it is added: what FSDP2 does when it accumulates reduce-scattered gradients into
fp32 parameters' ``.grad``, so the run stays bitwise equal to FSDP2 +
``torch.optim.AdamW(fused=True)`` accumulating the same micro-batches in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cargohold.services.core.layout import ChunkPlace


class Accumulator:
    """The fp32 sum of this worker's reduced chunks over the worker's range, in host
    memory (pinned on GPU nodes): 4 bytes a parameter of the range, 1/W of the model's."""

    def __init__(self, numel: int, *, pin: bool = False) -> None:
        self.sums = torch.empty(numel, dtype=torch.float32, pin_memory=pin)

    def add(self, places: Sequence[ChunkPlace], reduced: torch.Tensor, *, first: bool) -> None:
        """Add a unit's ``reduced`` chunks (its parameters' padded chunks back to back, as
        FSDP2's all-reduce hook hands them over); ``first`` starts the sum afresh."""
        for part, piece in self._pieces(places, reduced):
            if first:
                part.copy_(piece)
            else:
                part.add_(piece)

    def total_into(self, places: Sequence[ChunkPlace], reduced: torch.Tensor, out: torch.Tensor, base: int) -> None:
        """Write the sum with the last micro-batch's ``reduced`` chunks into ``out`` (fp32;
        the unit's part of the range, which starts at ``base``), leaving the sum as it was."""
        for (part, piece), place in zip(self._pieces(places, reduced), places):
            torch.add(part, piece, out=out[place.offset - base : place.offset - base + place.padded_numel])

    def _pieces(self, places: Sequence[ChunkPlace], reduced: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(this parameter's part of the sum, its chunk of ``reduced`` in fp32 on the host)."""
        pieces, at = [], 0
        for place in places:
            chunk = reduced[at : at + place.padded_numel].to(device="cpu", dtype=torch.float32)
            pieces.append((self.sums[place.offset : place.offset + place.padded_numel], chunk))
            at += place.padded_numel
        return pieces
