"""Training sequences made of whole documents (``data.packing: documents``; chat data by
default): :class:`DocumentRows`.

Each row holds ``seq_len + 1`` tokens: documents placed whole by best-fit decreasing (as
TRL's "bfd" packing), padding after them. A document longer than a row follows
``data.overlong``: ``truncate`` keeps its first ``seq_len + 1`` tokens, ``drop`` leaves it
out, ``split`` cuts it into row-sized pieces, each placed as a document of its own,
``error`` refuses the data (:func:`refuse_overlong`); a
document (or piece) left without a counted target (a chat conversation whose assistant
tokens were all cut) is dropped and counted. Inputs are a row's first ``seq_len`` tokens
and targets its last ``seq_len``; a target counts only inside the document of its input
(never across a boundary, never in padding). Position ids restart at 0 at each document
(and at the padding), which is what confines attention: the built-in GPT and Hugging
Face models (``transformers.masking_utils`` reads packed sequences from the position ids)
then attend only within a document.

Rows are visited as a token stream's blocks are (:mod:`.sampling`): epochs of seeded
permutations, a pure function of the step.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from cargohold.services.core.errors import ConfigError
from cargohold.services.data.batches import Batch, BatchShape, inputs_and_targets, loss_weight
from cargohold.services.data.sampling import step_blocks
from cargohold.services.models.loss import IGNORE_INDEX

Overlong = Literal["truncate", "drop", "split", "error"]
OVERLONG_SHOWN = 5
"""Over-long documents a refusal names (``data.overlong: error``); the rest are counted."""


@dataclass(frozen=True, slots=True)
class OverlongCounts:
    """What ``data.overlong`` did to documents longer than a row."""

    truncated: int = 0
    dropped: int = 0
    split: int = 0
    without_targets: int = 0
    """Documents (or pieces) dropped because no counted target was left in them."""

    def describe(self) -> str:
        parts = [
            f"{n} {what}"
            for what, n in (("truncated", self.truncated), ("dropped", self.dropped), ("split", self.split))
            if n
        ]
        if self.without_targets:
            parts.append(f"{self.without_targets} dropped for having no counted target left")
        return ", ".join(parts) or "none"


def refuse_overlong(
    ends: np.ndarray, capacity: int, name: str, places: Callable[[list[int]], list[str]] | None = None
) -> None:
    """``data.overlong: error``: refuse documents (``ends``: where each ends, exclusive)
    longer than a row of ``capacity`` tokens, naming the first :data:`OVERLONG_SHOWN` by
    ``places`` (document indices to file and line; None: by index) and counting the rest."""
    lengths = np.diff(np.asarray(ends, dtype=np.int64), prepend=0)
    over = np.flatnonzero(lengths > capacity)
    if not len(over):
        return
    shown = over[:OVERLONG_SHOWN].tolist()
    where = places(shown) if places is not None else [f"document {index}" for index in shown]
    listed = "; ".join(f"{place} ({lengths[index]} tokens)" for place, index in zip(where, shown, strict=True))
    more = f"; and {len(over) - len(shown)} more" if len(over) > len(shown) else ""
    raise ConfigError(
        f"{name}: {len(over)} of {len(lengths)} documents are longer than a sequence of data.block_size + 1 = "
        f"{capacity} tokens (its EOS counted), which data.overlong=error refuses: {listed}{more}; shorten them, "
        "raise data.block_size, or set data.overlong to truncate, drop or split"
    )


def place_documents(lengths: list[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing: the indices of ``lengths`` (each <= ``capacity``) grouped into
    rows of ``capacity``, longest first (ties: in order), each into the row with the least
    room that still fits it (ties: the row opened first), a new row when none does. Rows
    in the order they were opened; each row's documents in the order placed. Rows are
    kept in buckets by free room, found with a Fenwick tree over the room: O(log capacity)
    a document, so a million conversations place in seconds."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    by_room: list[list[int]] = [[] for _ in range(capacity + 1)]  # heaps of row numbers
    rooms = _Counts(capacity + 1)
    for index in order:
        size = lengths[index]
        if size > capacity:
            raise ValueError(f"document {index} holds {size} tokens, more than a row's {capacity}")
        room = rooms.first_at_least(size)
        if room is None:
            rows.append([index])
            row, left = len(rows) - 1, capacity - size
        else:
            row = heapq.heappop(by_room[room])
            rooms.add(room, -1)
            rows[row].append(index)
            left = room - size
        heapq.heappush(by_room[left], row)
        rooms.add(left, 1)
    return rows


class _Counts:
    """How many rows have each free room (0..size-1), with the least room >= n in O(log size)."""

    def __init__(self, size: int) -> None:
        self._tree = [0] * (size + 1)
        self._total = 0
        self._top = 1 << size.bit_length()

    def add(self, room: int, delta: int) -> None:
        self._total += delta
        at = room + 1
        while at < len(self._tree):
            self._tree[at] += delta
            at += at & -at

    def _before(self, room: int) -> int:
        """Rows with less room than ``room``."""
        total, at = 0, room
        while at > 0:
            total += self._tree[at]
            at -= at & -at
        return total

    def first_at_least(self, room: int) -> int | None:
        """The least room >= ``room`` some row has, or None."""
        wanted = self._before(room) + 1  # its rank among the rows, by room
        if wanted > self._total:
            return None
        at, step = 0, self._top
        while step:
            if at + step < len(self._tree) and self._tree[at + step] < wanted:
                at += step
                wanted -= self._tree[at]
            step >>= 1
        return at  # the Fenwick index at + 1 holds it: room at


class DocumentRows:
    """Rows of whole documents of a token stream (a
    :class:`~cargohold.services.data.batches.DataSource`), with the interface of
    :class:`~cargohold.services.data.blocks.TokenBlocks` (``num_blocks``, ``rows_of``,
    ``counted_in``), a block being a row.

    ``ends``: where each document of ``tokens`` ends (exclusive); ``counted``: the flags of
    the targets the loss counts (chat), None counts every target inside a document.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        counted: np.ndarray | None,
        ends: np.ndarray,
        shape: BatchShape,
        *,
        seed: int,
        vocab_size: int,
        name: str,
        overlong: Overlong,
        pad_id: int,
    ) -> None:
        if counted is not None and counted.shape != tokens.shape:
            raise ConfigError(f"{name}: {counted.shape[0]} counted flags for {tokens.shape[0]} tokens")
        capacity = shape.seq_len + 1
        if overlong == "error":
            refuse_overlong(ends, capacity, name)  # the data's opener names files and lines first
        pieces, self.overlong = _fit(tokens, counted, ends, capacity, overlong)
        if tokens.shape[0] == 0:
            raise ConfigError(
                f"{name} holds 0 tokens (it is empty, or every record was skipped), fewer than one sequence"
            )
        if not pieces:
            raise ConfigError(
                f"{name} holds no document with a target the loss counts (a chat file without an assistant "
                f"turn?); longer than a sequence (data.overlong={overlong}): {self.overlong.describe()}"
            )
        rows = place_documents([piece.length for piece in pieces], capacity)
        self._starts = np.array([pieces[i].start for row in rows for i in row], dtype=np.int64)
        self._lengths = np.array([pieces[i].length for row in rows for i in row], dtype=np.int64)
        self._row_first = np.cumsum([0, *(len(row) for row in rows)])
        self._row_targets = np.array([sum(pieces[i].targets for i in row) for row in rows], dtype=np.int64)
        """Counted targets of each row (what ``_row`` counts), for the step's weights."""
        self.num_blocks = len(rows)
        self.documents = len(pieces)
        self.padding = self.num_blocks * capacity - int(self._lengths.sum())
        """Padding tokens over all rows."""
        self.tokens, self.counted, self.shape = tokens, counted, shape
        self.seed, self.vocab_size, self.name, self.pad_id = seed, vocab_size, name, pad_id

    def summary(self) -> dict[str, int]:
        """What the placement made of the documents: kept, over-long ones by outcome, the
        rows and their padding tokens (``TrainResult.data_documents``, a launcher metric)."""
        counts = self.overlong
        return {
            "documents": self.documents,
            "sequences": self.num_blocks,
            "padding_tokens": self.padding,
            "truncated": counts.truncated,
            "dropped": counts.dropped,
            "split": counts.split,
            "without_targets": counts.without_targets,
        }

    def batch(self, step: int, rank: int, micro: int = 0) -> Batch:
        return self.rows_of(step_blocks(self.num_blocks, step, self.shape.rows, self.seed), rank, micro)

    def rows_of(self, blocks: torch.Tensor, rank: int, micro: int, counted_in_step: int | None = None) -> Batch:
        """Micro-batch ``micro`` of rank ``rank`` of the global batch of rows ``blocks``."""
        mine = blocks[self.shape.rows_of(rank, micro)].tolist()
        tokens, counts, positions = zip(*(self._row(r) for r in mine), strict=True)
        windows = torch.from_numpy(np.stack(tokens).astype(np.int64))
        inputs, targets = inputs_and_targets(windows, self.vocab_size, self.name, "row", mine)
        counted = torch.from_numpy(np.stack(counts))
        targets[~counted] = IGNORE_INDEX
        position_ids = torch.from_numpy(np.stack(positions).astype(np.int64))
        in_step = self.counted_in(blocks) if counted_in_step is None else counted_in_step
        return Batch(inputs, targets, loss_weight(int(counted.sum()), in_step, self.shape), position_ids)

    def counted_in(self, blocks: torch.Tensor) -> int:
        """Targets of rows ``blocks`` that the loss counts."""
        return int(self._row_targets[blocks.numpy()].sum())

    def _row(self, row: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Row ``row``: its ``seq_len + 1`` tokens, which of its ``seq_len`` targets count,
        and its inputs' position ids."""
        capacity = self.shape.seq_len + 1
        tokens = np.full(capacity, self.pad_id, dtype=np.int64)
        counted = np.zeros(capacity, dtype=bool)  # per token: counted as a target (its predecessor in its document)
        positions = np.empty(capacity, dtype=np.int64)
        at = 0
        for doc in range(self._row_first[row], self._row_first[row + 1]):
            start, length = int(self._starts[doc]), int(self._lengths[doc])
            tokens[at : at + length] = self.tokens[start : start + length]
            flags = np.ones(length, dtype=bool) if self.counted is None else self.counted[start : start + length] != 0
            counted[at + 1 : at + length] = flags[1:]  # a document's first token is no target
            positions[at : at + length] = np.arange(length)
            at += length
        positions[at:] = np.arange(capacity - at)  # the padding: a sequence of its own
        return tokens, counted[1:], positions[:-1]


@dataclass(frozen=True, slots=True)
class _Piece:
    """A document (or a piece of one) to place: its span of the stream and its counted targets."""

    start: int
    length: int
    targets: int


def _fit(
    tokens: np.ndarray, counted: np.ndarray | None, ends: np.ndarray, capacity: int, overlong: Overlong
) -> tuple[list[_Piece], OverlongCounts]:
    """Each document (or piece) to place, after ``overlong``, with at least one counted target."""
    truncated = dropped = split = without_targets = 0
    pieces: list[_Piece] = []
    start = 0
    for end in ends.tolist():
        length = int(end) - start
        if length > capacity:
            if overlong == "drop":
                dropped += 1
                start = int(end)
                continue
            if overlong == "truncate":
                truncated += 1
                candidates = [(start, capacity)]
            else:
                assert overlong == "split", "data.overlong=error refused the data before"
                split += 1
                candidates = [(s, min(capacity, int(end) - s)) for s in range(start, int(end), capacity)]
        else:
            candidates = [(start, length)]
        for piece_start, piece_length in candidates:
            targets = _targets(counted, piece_start, piece_length)
            if targets:
                pieces.append(_Piece(piece_start, piece_length, targets))
            else:
                without_targets += 1
        start = int(end)
    return pieces, OverlongCounts(truncated, dropped, split, without_targets)


def _targets(counted: np.ndarray | None, start: int, length: int) -> int:
    """Counted targets of a piece: every token but its first (with flags: the counted ones)."""
    if length < 2:
        return 0
    return length - 1 if counted is None else int(np.count_nonzero(counted[start + 1 : start + length]))
