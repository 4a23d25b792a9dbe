"""The tokenization cache: a tokenized stream is kept on disk under a key made of the
data's content, the tokenizer's files and the settings that shape the stream, so a second
run of the same data and tokenizer reads it back instead of tokenizing again, and a
change to any of them makes another key (the old entry is simply no longer read).

An entry is a folder: ``tokens.bin`` (raw ids), ``counted.bin`` (uint8 flags; chat only),
``ends.bin`` (uint64: where each document ends in the stream, exclusive) and
``meta.json``, written last, so an entry without it is incomplete (a crash) and is
written anew. Each file goes through :func:`~cargohold.services.core.durable.replace_durably`.
Writers of one entry (workers of another node missing it at once) take turns on a lock.

``meta.json`` records each file's size and CRC-32C, and a CRC-32C of its own content. An
entry is verified whenever it is read (one streamed pass over its files): one edited or
truncated on disk, or whose document ends are out of order, is named in a warning and
written anew, never trained on.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cargohold.services.core.checksum import crc32c
from cargohold.services.core.durable import replace_durably
from cargohold.services.data.packing import Piece

logger = logging.getLogger(__name__)

CACHE_FORMAT = 3
"""Changes when the entries' layout changes, so older entries are not misread (3: with
checksums)."""
META = "meta.json"
FILES = ("tokens.bin", "counted.bin", "ends.bin")
VERIFY_BYTES = 1 << 20
"""An entry's files are verified in pieces of this many bytes, read into one buffer."""

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


class _DamagedEntry(Exception):
    """A cache entry whose files do not match their checksums or each other."""


class TokenCache:
    """One entry: :meth:`read` it, or :meth:`write` it from the stream's pieces."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def read(self) -> CachedStream | None:
        """The entry, or None while it is missing or incomplete, or when it is damaged
        (named in a warning: it is then written anew)."""
        try:
            return self._verified()
        except _DamagedEntry as error:
            logger.warning("tokenization cache entry %s is damaged (%s); tokenizing again", self.folder, error)
            return None

    def write(self, pieces: Iterable[Piece], dtype: np.dtype, meta: Mapping[str, Any]) -> CachedStream:
        """Write the entry from ``pieces`` of the stream (ids of ``dtype``, counted flags or
        None, document ends in the piece), unless another process completed it meanwhile;
        then read it."""
        self.folder.mkdir(parents=True, exist_ok=True)
        with (self.folder / "lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                done = self._verified()
            except _DamagedEntry:  # named by the read that found it
                done = None
            if done is not None:
                return done
            (self.folder / META).unlink(missing_ok=True)  # incomplete until written anew
            tokens, counted, documents, files = self._write_pieces(pieces, dtype)
            body = {
                **meta,
                "dtype": dtype.name,
                "tokens": tokens,
                "counted": counted,
                "documents": documents,
                "files": files,
            }
            with replace_durably(self.folder / META) as temporary:
                Path(temporary).write_text(json.dumps({**body, "checksum": _checksum(body)}, indent=1))
        cached = self._verified()
        assert cached is not None, f"{self.folder} was just written"
        return cached

    def _verified(self) -> CachedStream | None:
        """The entry, verified; None while it has no ``meta.json``. Raises _DamagedEntry."""
        try:
            text = (self.folder / META).read_text()
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as error:
            raise _DamagedEntry(f"{META} cannot be read: {error}") from error
        try:
            meta = json.loads(text)
            body = {key: value for key, value in meta.items() if key != "checksum"}
            if meta.get("checksum") != _checksum(body):
                raise _DamagedEntry(f"{META} does not match its checksum")
            dtype = np.dtype(meta["dtype"])
            counts = {"tokens.bin": meta["tokens"], "counted.bin": meta["tokens"] if meta["counted"] else 0}
            counts["ends.bin"] = meta["documents"]
            sizes = {"tokens.bin": dtype.itemsize, "counted.bin": 1, "ends.bin": 8}
            for name in FILES:
                record = meta["files"][name]
                if record["bytes"] != counts[name] * sizes[name]:
                    raise _DamagedEntry(f"{META} records {record['bytes']} bytes of {name} for {counts[name]} values")
                self._verify_file(name, record["bytes"], record["crc32c"])
        except (json.JSONDecodeError, AttributeError, KeyError, TypeError) as error:
            raise _DamagedEntry(f"{META} is not an entry's description ({type(error).__name__}: {error})") from error
        tokens = self._map("tokens.bin", dtype, meta["tokens"])
        counted = self._map("counted.bin", np.dtype(np.uint8), meta["tokens"]) if meta["counted"] else None
        ends = self._map("ends.bin", np.dtype(np.uint64), meta["documents"])
        if len(ends) and not (int(ends[-1]) == len(tokens) and int(ends[0]) > 0 and bool(np.all(ends[1:] > ends[:-1]))):
            raise _DamagedEntry("its document ends are not increasing to the end of the stream")
        return CachedStream(tokens, counted, ends, meta)

    def _verify_file(self, name: str, nbytes: int, checksum: int) -> None:
        """Check the size and CRC-32C of file ``name``, read in pieces into one buffer."""
        buffer = bytearray(VERIFY_BYTES)
        crc, total = 0, 0
        try:
            with (self.folder / name).open("rb", buffering=0) as handle:
                while count := handle.readinto(buffer):
                    crc = crc32c(memoryview(buffer)[:count], crc)
                    total += count
        except OSError as error:
            raise _DamagedEntry(f"{name} cannot be read: {error}") from error
        if total != nbytes:
            raise _DamagedEntry(f"{name} is {total} bytes, {META} records {nbytes} (truncated?)")
        if crc != checksum:
            raise _DamagedEntry(f"{name} does not match its checksum (edited?)")

    def _write_pieces(self, pieces: Iterable[Piece], dtype: np.dtype) -> tuple[int, bool, int, dict[str, Any]]:
        total, with_counted, documents = 0, False, 0
        crcs = dict.fromkeys(FILES, 0)
        sizes = dict.fromkeys(FILES, 0)
        with (
            replace_durably(self.folder / "tokens.bin", sync_directory=False) as tokens_path,
            replace_durably(self.folder / "counted.bin", sync_directory=False) as counted_path,
            replace_durably(self.folder / "ends.bin", sync_directory=False) as ends_path,
            open(tokens_path, "wb") as tokens_file,
            open(counted_path, "wb") as counted_file,
            open(ends_path, "wb") as ends_file,
        ):
            handles = {"tokens.bin": tokens_file, "counted.bin": counted_file, "ends.bin": ends_file}

            def put(name: str, values: np.ndarray, dtype: np.dtype) -> None:
                data = np.require(values, dtype, ["C", "W"]).data.cast("B")  # writable: checksummed in place
                handles[name].write(data)
                crcs[name] = crc32c(data, crcs[name])
                sizes[name] += len(data)

            for tokens, counted, ends in pieces:
                put("tokens.bin", tokens, dtype)
                if counted is not None:
                    put("counted.bin", counted, np.dtype(np.uint8))
                    with_counted = True
                put("ends.bin", np.asarray(ends, dtype=np.uint64) + np.uint64(total), np.dtype(np.uint64))
                documents += len(ends)
                total += len(tokens)
        files = {name: {"bytes": sizes[name], "crc32c": crcs[name]} for name in FILES}
        return total, with_counted, documents, files

    def _map(self, name: str, dtype: np.dtype, count: int) -> np.ndarray:
        if count == 0:
            return np.empty(0, dtype=dtype)
        return np.memmap(self.folder / name, dtype=dtype, mode="r", shape=(count,))


def _checksum(body: Mapping[str, Any]) -> int:
    """CRC-32C of an entry's description, its keys sorted."""
    return crc32c(memoryview(bytearray(json.dumps(body, sort_keys=True).encode())))
