"""Which blocks of a token stream each step reads: epochs of seeded permutations.

The blocks of every epoch are visited in a permutation drawn from ``(seed, epoch)``;
step ``s`` (1-based) takes the next ``rows`` positions of that sequence, so each block is
read once per epoch, the rows of one step never repeat a block (unless the data holds
fewer blocks than a global batch), and no two ranks read the same block. Positions are a
function of the step alone: nothing to checkpoint, a resumed run reads what the
uninterrupted one did.
"""

from __future__ import annotations

import functools

import torch

from cargohold.services.core.errors import ConfigError
from cargohold.services.data.seeds import stable_seed


def step_blocks(num_blocks: int, step: int, rows: int, seed: int) -> torch.Tensor:
    """The blocks (int64 ``[rows]``) of step ``step``'s global batch, in row order."""
    if num_blocks <= 0:
        raise ConfigError(f"num_blocks must be > 0, got {num_blocks}")
    if step < 1:
        raise ConfigError(f"step must be >= 1, got {step}")
    positions = torch.arange((step - 1) * rows, step * rows, dtype=torch.int64)
    epochs = positions // num_blocks
    blocks = torch.empty(rows, dtype=torch.int64)
    for epoch in torch.unique(epochs).tolist():
        here = epochs == epoch
        blocks[here] = _permutation(num_blocks, seed, epoch)[positions[here] % num_blocks]
    return blocks


@functools.lru_cache(maxsize=2)
def _permutation(num_blocks: int, seed: int, epoch: int) -> torch.Tensor:
    """Epoch ``epoch``'s order of the blocks (8 bytes a block; a step spans at most two
    epochs, so two are kept). Read-only: callers index it, never write."""
    generator = torch.Generator().manual_seed(stable_seed("blocks", seed, epoch))
    return torch.randperm(num_blocks, generator=generator)
