"""Documents packed into one token stream: each document's ids, then the tokenizer's EOS,
with where each document ends. Training sequences are then either cut from the stream
(:mod:`.blocks`, ``data.packing: stream``) whatever the documents' lengths: no padding, a
sequence may hold the end of one document and the start of the next; or made of whole
documents (:mod:`.rows`, ``data.packing: documents``)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

Document = tuple[Sequence[int], Sequence[bool] | None]
"""A document's ids, and which of them the loss counts (None: all)."""
Piece = tuple[np.ndarray, np.ndarray | None, list[int]]
"""A piece of the stream: ids, counted flags (chat) or None, and the offsets in the piece
where a document ends (exclusive; a document may span pieces: text files)."""


def stream_dtype(vocab: int) -> np.dtype:
    """The smallest of uint16 and uint32 that numbers ``vocab`` ids."""
    return np.dtype(np.uint16) if vocab <= 1 << 16 else np.dtype(np.uint32)


def pack(documents: Sequence[Document], eos_id: int, dtype: np.dtype) -> Piece:
    """A piece of the stream: ``documents`` back to back, each followed by ``eos_id``. With
    counted flags (chat), a ``uint8`` array of them too, the EOS separators not counted."""
    if not documents:
        return np.empty(0, dtype=dtype), None, []
    sizes = [len(ids) + 1 for ids, _ in documents]
    tokens = np.empty(sum(sizes), dtype=dtype)
    masked = documents[0][1] is not None
    counted = np.zeros(len(tokens), dtype=np.uint8) if masked else None
    at = 0
    for (ids, flags), size in zip(documents, sizes):
        if (flags is not None) != masked:
            raise ValueError("documents of one stream either all carry counted flags or none do")
        tokens[at : at + size - 1] = ids
        tokens[at + size - 1] = eos_id
        if counted is not None and flags is not None:
            counted[at : at + size - 1] = flags
        at += size
    return tokens, counted, list(np.cumsum(sizes).tolist())
