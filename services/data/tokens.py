"""Pre-tokenized token files, memory-mapped: ``.bin`` (raw ids, no header; the
nanoGPT/torchtitan convention: uint16 for a vocabulary of up to 65,536 ids, uint32
above, :func:`bin_dtype`) and ``.npy`` (numpy's format, which states its dtype). The
dtype must hold every id of the model's vocabulary, and every id must lie in it:
:func:`check_ids_in_vocab` reads the file once, before anything trains."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from cargohold.services.core.errors import ConfigError

UINT16_IDS = 1 << 16
"""The largest vocabulary a ``.bin`` file holds as uint16 ids (nanoGPT's convention);
one larger holds uint32 ids."""
SCAN_IDS = 1 << 24
"""Ids a check of the whole file reads at a time (32 or 64 MiB): the pages of a
memory-mapped file come in a piece at a time, and no copy of it is made."""

_id_ranges: dict[tuple[str, int, int, int], tuple[int, int]] = {}
"""The least and greatest id of each file checked, by (path, size, mtime, inode): a
process reads a file once (the command line's check, then the launcher's)."""


def bin_dtype(vocab_size: int) -> np.dtype:
    """The dtype of a ``.bin`` file's ids for a model of ``vocab_size`` ids: uint16 up to
    65,536 ids (nanoGPT's convention), uint32 above. Ids of another dtype are written as
    ``.npy``, which states its own."""
    return np.dtype(np.uint16 if vocab_size <= UINT16_IDS else np.uint32)


def open_token_file(path: Path, vocab_size: int, section: str = "data") -> np.ndarray:
    """The ids of a ``.bin`` (of :func:`bin_dtype` for the model's ``vocab_size``) or
    ``.npy`` file, memory-mapped read-only; ``section`` (data, eval) names the key that
    named it in messages."""
    if not path.is_file():
        raise ConfigError(f"{section}.path {str(path)!r} is not a file (a .bin or .npy of token ids)")
    if path.suffix == ".npy":
        try:
            tokens = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError as error:
            raise ConfigError(f"{section}.path {str(path)!r} is not a readable .npy file: {error}") from error
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise ConfigError(
                f"{section}.path {str(path)!r} holds {tokens.dtype} of shape {tokens.shape}; "
                "token ids are a 1-D array of integers"
            )
        return tokens
    if path.suffix != ".bin":
        raise ConfigError(f"{section}.path {str(path)!r}: data.format=tokens reads .bin or .npy files")
    dtype = bin_dtype(vocab_size)
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise ConfigError(
            f"{section}.path {str(path)!r} has {size} bytes, not a whole number of {dtype} ids (a .bin file "
            f"holds {dtype} ids for a vocabulary of {vocab_size} ids: uint16 up to {UINT16_IDS}, uint32 above); "
            "write ids of another dtype as a .npy file"
        )
    if size == 0:
        raise ConfigError(f"{section}.path {str(path)!r} is empty")
    return np.memmap(path, dtype=dtype, mode="r")


def check_dtype_holds_vocab(dtype: np.dtype, vocab_size: int, what: str) -> None:
    """Refuse ids of ``dtype`` for a vocabulary it cannot number (e.g. uint16 for more than
    65536 ids): such a file was written for another tokenizer, or truncated its ids."""
    dtype = np.dtype(dtype)
    if dtype.kind not in "iu":
        raise ConfigError(f"{what} holds {dtype}, not integer token ids")
    largest = int(np.iinfo(dtype).max)
    if vocab_size - 1 > largest:
        raise ConfigError(
            f"{what} holds {dtype} ids (at most {largest}) but the model's vocabulary has {vocab_size} ids; "
            "write the ids as uint32 (a .npy file of uint32, or a .bin file, whose ids are uint32 for a vocabulary "
            f"above {UINT16_IDS} ids)"
        )


def check_ids_in_vocab(path: Path, ids: np.ndarray, vocab_size: int, what: str) -> None:
    """Refuse ids of the token file ``path`` (``ids``, its memory map) outside
    ``[0, vocab_size)``, naming the first one's position: one pass over the file, a piece
    at a time, remembered for the file as it is now. A worker that reads the same file
    after its launcher checked it need not: each batch's ids are checked as it is read."""
    if len(ids) == 0:
        return  # refused as shorter than a sequence
    stat = os.stat(path)
    signature = (str(path.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ino)
    if signature not in _id_ranges:
        least, greatest = int(ids[0]), int(ids[0])
        for start in range(0, len(ids), SCAN_IDS):
            piece = ids[start : start + SCAN_IDS]  # read from disk once; min and max then from memory
            least, greatest = min(least, int(piece.min())), max(greatest, int(piece.max()))
        _id_ranges[signature] = (least, greatest)
    least, greatest = _id_ranges[signature]
    if least >= 0 and greatest < vocab_size:
        return
    for start in range(0, len(ids), SCAN_IDS):
        piece = ids[start : start + SCAN_IDS]
        outside = np.flatnonzero((piece < 0) | (piece >= vocab_size))
        if len(outside):
            at = start + int(outside[0])
            raise ConfigError(
                f"{what} holds token id {int(ids[at])} at position {at}, outside the model's vocabulary of "
                f"{vocab_size} ids (ids {least} to {greatest} occur): the file was written with another "
                "tokenizer, or the model's vocab_size is too small"
            )
