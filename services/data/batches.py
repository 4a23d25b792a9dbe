"""What a data source hands a worker: the :class:`Batch` of one (step, micro-batch, rank),
and the :class:`BatchShape` of a step's global batch.

A step's global batch is ``micro_batches x world_size x batch_size`` rows, in that order:
micro-batch m of rank r is rows ``[(m * world_size + r) * batch_size, ... + batch_size)``.
With one micro-batch (no accumulation) rank r takes rows ``[r * batch_size, ...)``, so the
ranks of a world of N split the batch a world of 1 with N times the batch size sees.

Ranks may count different numbers of tokens (chat data masks prompts), yet gradients are
averaged over ranks (FSDP2) and, with accumulation, over micro-batches: each batch's
:attr:`Batch.weight` scales its mean loss so that this average is the mean over every
counted token of the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from cargohold.services.core.errors import ConfigError


@dataclass(frozen=True, slots=True)
class BatchShape:
    """The shape of a step's global batch."""

    world_size: int
    batch_size: int
    """Rows of one rank's micro-batch."""
    seq_len: int
    micro_batches: int = 1
    """Micro-batches a rank accumulates per step."""

    def __post_init__(self) -> None:
        for name in ("world_size", "batch_size", "seq_len", "micro_batches"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def rows(self) -> int:
        """Rows of the step's global batch."""
        return self.micro_batches * self.world_size * self.batch_size

    def rows_of(self, rank: int, micro: int = 0) -> slice:
        """The global batch's rows that micro-batch ``micro`` of rank ``rank`` takes."""
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank must be in [0, world_size={self.world_size}), got {rank}")
        if not 0 <= micro < self.micro_batches:
            raise ConfigError(f"micro must be in [0, micro_batches={self.micro_batches}), got {micro}")
        first = (micro * self.world_size + rank) * self.batch_size
        return slice(first, first + self.batch_size)


@dataclass(frozen=True, slots=True)
class Batch:
    """One rank's inputs and targets, int64 ``[batch_size, seq_len]``; a target of
    :data:`~cargohold.services.models.loss.IGNORE_INDEX` is not counted."""

    inputs: torch.Tensor
    targets: torch.Tensor
    weight: float = 1.0
    """The factor of this batch's mean loss (see the module docstring): its counted
    tokens times ``world_size x micro_batches`` over the step's; exactly 1.0 when every
    batch counts as many, 0.0 when it counts none."""
    position_ids: torch.Tensor | None = None
    """int64 ``[batch_size, seq_len]``, restarting at 0 at each document of a row of whole
    documents (:mod:`.rows`): attention stays within a document. None: 0..seq_len-1."""


class DataSource(Protocol):
    """Batches as a pure function of (step, rank, micro-batch): a resumed run, or a
    single-process reference, gets exactly what rank r got at step s."""

    shape: BatchShape

    def batch(self, step: int, rank: int, micro: int = 0) -> Any:
        """Micro-batch ``micro`` of rank ``rank`` in step ``step`` (1-based): a
        :class:`Batch` for the config's data; whatever a user's loss takes otherwise,
        with a ``weight`` (see the module docstring)."""
        ...


def loss_weight(counted: int, counted_in_step: int, shape: BatchShape) -> float:
    """:attr:`Batch.weight` of a batch counting ``counted`` of the step's
    ``counted_in_step`` tokens. Integer arithmetic up to the one division, so equal shares
    give exactly 1.0 (and the unmasked path stays bitwise what it was)."""
    if counted_in_step == 0:
        return 0.0
    return counted * shape.world_size * shape.micro_batches / counted_in_step


def inputs_and_targets(
    windows: torch.Tensor, vocab_size: int, name: str, kind: str, ids: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inputs (every token of each ``seq_len + 1`` window but the last) and targets (all
    but the first) of int64 ``windows``, refusing an id outside the vocabulary; window i is
    ``kind`` ``ids[i]`` for the message ("block 7", "row 3"). Separate tensors: with one row
    both slices are contiguous views of one storage, and masking the targets would write
    into the inputs."""
    outside = (windows < 0) | (windows >= vocab_size)
    if outside.any():
        row = int(outside.any(dim=1).nonzero()[0])
        raise ConfigError(
            f"{name} holds token id {int(windows[row][outside[row]][0])} (in {kind} {ids[row]}), "
            f"outside the model's vocabulary of {vocab_size} ids"
        )
    return windows[:, :-1].clone(), windows[:, 1:].clone()
