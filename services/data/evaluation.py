"""Held-out data for validation (``eval.*``): :func:`open_eval_set` gives the
:class:`EvalSet` every evaluation of a run reads, the same batches each time.

The held-out stream is cut into blocks as training data is (:mod:`.blocks`), or made into
rows of whole documents when training data is (:mod:`.rows`), but read in order, without
shuffling: batch i of rank r is blocks ``[(i * W + r) * B, ... + B)``, the
set's whole batches and no more (or the first ``eval.max_batches``). The set is weighted
as one step whose micro-batches are its batches (:class:`~.batches.BatchShape`): each
batch's :attr:`~.batches.Batch.weight` is its share of the set's counted tokens, so the
weighted mean over every batch and rank is the mean loss over the set's counted tokens.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from cargohold.cluster.schema.data import DataConfig
from cargohold.cluster.schema.eval import EvalConfig
from cargohold.services.core.errors import ConfigError
from cargohold.services.data.batches import Batch, BatchShape
from cargohold.services.data.blocks import TokenBlocks
from cargohold.services.data.corpus import load_tokens
from cargohold.services.data.rows import DocumentRows, Overlong, refuse_overlong
from cargohold.services.data.tokenization import document_places, tokenized_stream
from cargohold.services.data.tokens import check_dtype_holds_vocab, check_ids_in_vocab, open_token_file
from cargohold.services.models.dimensions import sequence_length, vocab_size
from cargohold.services.models.spec import ModelSpec


class EvalSource(Protocol):
    """Held-out batches: ``num_batches`` for each rank, the same every evaluation."""

    num_batches: int

    def batch(self, index: int, rank: int) -> Any:
        """Batch ``index`` (0-based) of rank ``rank``; its ``weight`` scales its mean loss."""
        ...


class EvalSet:
    """The held-out batches: ``num_batches`` of them, each ``world_size x batch_size``
    sequences."""

    def __init__(
        self,
        tokens: np.ndarray,
        counted: np.ndarray | None,
        *,
        world_size: int,
        batch_size: int,
        seq_len: int,
        max_batches: int | None,
        vocab_size: int,
        name: str,
        documents: tuple[np.ndarray, Overlong] | None = None,
    ) -> None:
        """``documents``: the stream's document ends and ``data.overlong``, to read it as rows
        of whole documents (:mod:`.rows`) as training data is; None cuts blocks."""
        per_batch = world_size * batch_size
        rows = None
        if documents is not None:
            one = BatchShape(world_size=world_size, batch_size=batch_size, seq_len=seq_len)
            rows = DocumentRows(
                tokens,
                counted,
                documents[0],
                one,
                seed=0,
                vocab_size=vocab_size,
                name=name,
                overlong=documents[1],
                pad_id=0,
            )
            available = rows.num_blocks // per_batch
        else:
            available = max(0, tokens.shape[0] - 1) // seq_len // per_batch
        if available == 0:
            raise ConfigError(
                f"{name} holds {tokens.shape[0]} tokens, fewer than one eval batch: worker.num_workers x "
                f"tuning.eval.batch_size (null: data.batch_size) = {per_batch} sequences of data.block_size + 1 = "
                f"{seq_len + 1} tokens"
            )
        self.num_batches = min(available, max_batches or available)
        shape = BatchShape(
            world_size=world_size, batch_size=batch_size, seq_len=seq_len, micro_batches=self.num_batches
        )
        self._blocks: TokenBlocks | DocumentRows
        if rows is not None:
            rows.shape = shape
            self._blocks = rows
        else:
            self._blocks = TokenBlocks(tokens, counted, shape, seed=0, vocab_size=vocab_size, name=name)
        self._order = torch.arange(shape.rows, dtype=torch.int64)
        self._counted = self._blocks.counted_in(self._order)
        if self._counted == 0:
            raise ConfigError(f"{name}: its first {self.num_batches} eval batches count no token (every target masked)")

    def batch(self, index: int, rank: int) -> Batch:
        """Batch ``index`` (0-based) of rank ``rank``."""
        return self._blocks.rows_of(self._order, rank, index, self._counted)


def open_eval_set(
    model: ModelSpec, data: DataConfig, held_out: EvalConfig, num_workers: int, *, check_token_file: bool = True
) -> EvalSet | None:
    """The held-out data ``eval.*`` (``held_out``) names, read as ``data.format`` reads
    training data, for ``num_workers`` workers; None when validation is off. ConfigError
    names the key and file that are wrong. ``check_token_file``: as
    :func:`~.sources.open_source`'s."""
    if not held_out.enabled:
        return None
    seq_len, vocab = sequence_length(model, data), vocab_size(model)
    counted: np.ndarray | None = None
    documents: tuple[np.ndarray, Overlong] | None = None
    name = f"eval.path {held_out.path!r}"
    if data.format == "bytes":
        tokens = load_tokens(held_out.path, data.corpus_bytes, data.seed, seq_len=seq_len, key="eval.path").numpy()
    elif data.format == "tokens":
        path = Path(held_out.path or "").expanduser()
        tokens = open_token_file(path, vocab, "eval")
        check_dtype_holds_vocab(tokens.dtype, vocab, name)
        if check_token_file:
            check_ids_in_vocab(path, tokens, vocab, name)
    else:
        source = dataclasses.replace(data, path=held_out.path or data.path, split=held_out.split or data.split)
        stream = tokenized_stream(source, model.hf, vocab, "eval")
        tokens, counted = stream.tokens, stream.counted
        documents = (stream.ends, data.overlong) if data.whole_documents else None
        name = f"eval.path {source.path!r}" + (f" (split {source.split!r})" if data.format == "hf_dataset" else "")
        if documents is not None and data.overlong == "error":
            refuse_overlong(stream.ends, seq_len + 1, name, lambda shown: document_places(source, shown, "eval"))
    return EvalSet(
        tokens,
        counted,
        world_size=num_workers,
        batch_size=held_out.batch_size or data.batch_size,
        seq_len=seq_len,
        max_batches=held_out.max_batches,
        vocab_size=vocab,
        name=name,
        documents=documents,
    )
