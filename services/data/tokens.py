"""Pre-tokenized token files, memory-mapped: ``.bin`` (raw ids, no header; the
nanoGPT/torchtitan convention, its dtype given by ``data.token_dtype``) and ``.npy``
(numpy's format, which states its dtype). The dtype must hold every id of the model's
vocabulary."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cargohold.services.errors import ConfigError

BIN_DTYPES: dict[str, np.dtype] = {"uint16": np.dtype(np.uint16), "uint32": np.dtype(np.uint32)}


def open_token_file(path: Path, bin_dtype: str, section: str = "data") -> np.ndarray:
    """The ids of a ``.bin`` (of ``bin_dtype``) or ``.npy`` file, memory-mapped read-only;
    ``section`` (data, eval) names the key that named it in messages."""
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
    dtype = BIN_DTYPES[bin_dtype]
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise ConfigError(
            f"{section}.path {str(path)!r} has {size} bytes, not a whole number of {bin_dtype} ids; "
            "is data.token_dtype right?"
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
            "write the ids as uint32 (and set data.token_dtype=uint32 for a .bin file)"
        )
