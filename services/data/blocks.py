"""A token stream read as training sequences: :class:`TokenBlocks`.

Block ``b`` is the ``seq_len + 1`` tokens from ``b * seq_len``: inputs are its first
``seq_len``, targets its last ``seq_len``, so consecutive blocks share one token and every
token but the first is a target of exactly one block. Only the blocks a batch needs are
read: the stream may be a memory-mapped file far larger than memory.
"""

from __future__ import annotations

import numpy as np
import torch

from cargohold.services.core.errors import ConfigError
from cargohold.services.data.batches import Batch, BatchShape, inputs_and_targets, loss_weight
from cargohold.services.data.sampling import step_blocks
from cargohold.services.models.loss import IGNORE_INDEX


class TokenBlocks:
    """Batches of a token stream (a :class:`~cargohold.services.data.batches.DataSource`).

    ``counted`` (same length as ``tokens``; nonzero where the token is a target the loss
    counts) masks the others with IGNORE_INDEX; None counts every token. ``name`` says where
    the tokens come from, for messages.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        counted: np.ndarray | None,
        shape: BatchShape,
        *,
        seed: int,
        vocab_size: int,
        name: str,
    ) -> None:
        if tokens.ndim != 1:
            raise ConfigError(f"{name} must hold a 1-D sequence of token ids, got shape {tokens.shape}")
        if counted is not None and counted.shape != tokens.shape:
            raise ConfigError(f"{name}: {counted.shape[0]} counted flags for {tokens.shape[0]} tokens")
        self.num_blocks = max(0, (tokens.shape[0] - 1) // shape.seq_len)
        if self.num_blocks == 0:
            raise ConfigError(
                f"{name} holds {tokens.shape[0]} tokens"
                + (" (it is empty, or every record was skipped)" if tokens.shape[0] == 0 else "")
                + f", fewer than one sequence of data.block_size + 1 = {shape.seq_len + 1}"
            )
        self.tokens, self.counted, self.shape = tokens, counted, shape
        self.seed, self.vocab_size, self.name = seed, vocab_size, name

    def batch(self, step: int, rank: int, micro: int = 0) -> Batch:
        return self.rows_of(step_blocks(self.num_blocks, step, self.shape.rows, self.seed), rank, micro)

    def rows_of(self, blocks: torch.Tensor, rank: int, micro: int, counted_in_step: int | None = None) -> Batch:
        """Micro-batch ``micro`` of rank ``rank`` of the global batch of ``blocks`` (row
        order); ``counted_in_step``: the tokens all of ``blocks`` count, when known."""
        mine = blocks[self.shape.rows_of(rank, micro)]
        windows = torch.from_numpy(self._windows(self.tokens, mine).astype(np.int64))
        inputs, targets = inputs_and_targets(windows, self.vocab_size, self.name, "block", mine.tolist())
        if self.counted is None:
            return Batch(inputs, targets)
        counted = torch.from_numpy(self._windows(self.counted, mine)[:, 1:] != 0)
        targets[~counted] = IGNORE_INDEX
        in_step = self.counted_in(blocks) if counted_in_step is None else counted_in_step
        return Batch(inputs, targets, loss_weight(int(counted.sum()), in_step, self.shape))

    def counted_in(self, blocks: torch.Tensor) -> int:
        """Targets of ``blocks`` that the loss counts."""
        if self.counted is None:
            return len(blocks) * self.shape.seq_len
        return int((self._windows(self.counted, blocks)[:, 1:] != 0).sum())

    def _windows(self, stream: np.ndarray, blocks: torch.Tensor) -> np.ndarray:
        """``[len(blocks), seq_len + 1]`` of ``stream``: each block's tokens (or flags)."""
        length = self.shape.seq_len
        return np.stack([stream[b * length : b * length + length + 1] for b in blocks.tolist()])
