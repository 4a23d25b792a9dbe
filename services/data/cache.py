"""The tokenization cache: a tokenized stream is kept on disk under a key made of the
data's content, the tokenizer's files and the settings that shape the stream, so a second
run of the same data and tokenizer reads it back instead of tokenizing again, and a
change to any of them makes another key (the old entry is simply no longer read).

An entry is a folder: ``tokens.bin`` (raw ids), ``counted.bin`` (uint8 flags; chat only),
``ends.bin`` (uint64: where each document ends in the stream, exclusive) and
``meta.json``, written last, so an entry without it is incomplete (a crash) and is
written anew. Each file goes through :func:`~cargohold.services.durable.replace_durably`.
Writers of one entry (workers of another node missing it at once) take turns on a lock.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cargohold.services.data.packing import Piece
from cargohold.services.durable import replace_durably

CACHE_FORMAT = 2
"""Changes when the entries' layout changes, so older entries are not misread."""
META = "meta.json"

_digests: dict[tuple[str, int, int, int], str] = {}
"""File digests by (path, size, mtime, inode): a process hashes each file once."""


def cache_key(content: str, tokenizer: str, settings: Mapping[str, Any]) -> str:
    """The entry name for data of digest ``content`` tokenized by a tokenizer of digest
    ``tokenizer`` with ``settings`` (JSON-serializable)."""
    body = json.dumps(
        {"format": CACHE_FORMAT, "content": content, "tokenizer": tokenizer, "settings": dict(settings)},
        sort_keys=True,
    )
    return hashlib.sha256(body.encode()).hexdigest()[:32]


def content_digest(path: Path) -> str:
    """A hash of a file's bytes, or of every file under a folder (names and bytes)."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    digest = hashlib.sha256()
    for file in files:
        digest.update(f"{file.relative_to(path) if path.is_dir() else ''}\0".encode())
        digest.update(_file_digest(file).encode())
    return digest.hexdigest()


def _file_digest(path: Path) -> str:
    stat = path.stat()
    signature = (str(path.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ino)
    if signature not in _digests:
        with path.open("rb") as handle:
            _digests[signature] = hashlib.file_digest(handle, "sha256").hexdigest()
    return _digests[signature]


@dataclass(frozen=True, slots=True)
class CachedStream:
    """A tokenized stream, memory-mapped from its entry."""

    tokens: np.ndarray
    counted: np.ndarray | None
    ends: np.ndarray
    """Where each document ends in ``tokens`` (exclusive), in order."""
    meta: dict[str, Any]


class TokenCache:
    """One entry: :meth:`read` it, or :meth:`write` it from the stream's pieces."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def read(self) -> CachedStream | None:
        """The entry, or None while it is missing or incomplete."""
        try:
            meta = json.loads((self.folder / META).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        dtype = np.dtype(meta["dtype"])
        tokens = self._map("tokens.bin", dtype, meta["tokens"])
        counted = self._map("counted.bin", np.dtype(np.uint8), meta["tokens"]) if meta["counted"] else None
        ends = self._map("ends.bin", np.dtype(np.uint64), meta["documents"])
        return CachedStream(tokens, counted, ends, meta)

    def write(self, pieces: Iterable[Piece], dtype: np.dtype, meta: Mapping[str, Any]) -> CachedStream:
        """Write the entry from ``pieces`` of the stream (ids of ``dtype``, counted flags or
        None, document ends in the piece), unless another process completed it meanwhile;
        then read it."""
        self.folder.mkdir(parents=True, exist_ok=True)
        with (self.folder / "lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            done = self.read()
            if done is not None:
                return done
            tokens, counted, documents = self._write_pieces(pieces, dtype)
            body = {**meta, "dtype": dtype.name, "tokens": tokens, "counted": counted, "documents": documents}
            with replace_durably(self.folder / META) as temporary:
                Path(temporary).write_text(json.dumps(body, indent=1))
        cached = self.read()
        assert cached is not None, f"{self.folder} was just written"
        return cached

    def _write_pieces(self, pieces: Iterable[Piece], dtype: np.dtype) -> tuple[int, bool, int]:
        total, with_counted, documents = 0, False, 0
        with (
            replace_durably(self.folder / "tokens.bin", sync_directory=False) as tokens_path,
            replace_durably(self.folder / "counted.bin", sync_directory=False) as counted_path,
            replace_durably(self.folder / "ends.bin", sync_directory=False) as ends_path,
            open(tokens_path, "wb") as tokens_file,
            open(counted_path, "wb") as counted_file,
            open(ends_path, "wb") as ends_file,
        ):
            for tokens, counted, ends in pieces:
                tokens_file.write(np.ascontiguousarray(tokens, dtype=dtype).tobytes())
                if counted is not None:
                    counted_file.write(np.ascontiguousarray(counted, dtype=np.uint8).tobytes())
                    with_counted = True
                ends_file.write((np.asarray(ends, dtype=np.uint64) + np.uint64(total)).tobytes())
                documents += len(ends)
                total += len(tokens)
        return total, with_counted, documents

    def _map(self, name: str, dtype: np.dtype, count: int) -> np.ndarray:
        if count == 0:
            return np.empty(0, dtype=dtype)
        return np.memmap(self.folder / name, dtype=dtype, mode="r", shape=(count,))
