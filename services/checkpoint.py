"""The on-disk checkpoint format: payload files per segment, a manifest written last.

A checkpoint is one directory under a root, named after its step::

    <root>/step-0000001200/
        manifest.json        written last: format version, step, run id, config hash,
                             model signature, padded length, shard records, the format,
                             size and CRC-32C of every payload file, and a free-form
                             ``extra``
        seg-00003.bin ...    payload files, each holding a flat range (any cut of the
                             flat buffer): shard files (below), or NVMe-tier partition
                             files (:mod:`cargohold.services.tiers.fileformat`), which a
                             state server hard-links from its tier instead of copying

The directory is built as ``step-<step>.partial`` (:meth:`CheckpointStore.begin`); each
payload file is written to a temporary name, fsynced and renamed, and the directory is
fsynced. :meth:`CheckpointStore.commit` then writes the manifest the same way and renames
the directory to its final name, so a directory named ``step-<step>`` exists only once
all its files and its manifest are durable. A crash at any point leaves earlier
checkpoints as they were and, at worst, a ``.partial`` directory that is never read and
is removed by the next commit. Directories that are being deleted or replaced are first
renamed out of the ``step-<step>`` namespace for the same reason.

A payload file is a fixed little-endian header, then the raw fp32 arrays::

    magic "CHOLDCKP" | version u32 | header bytes u32 | step u64 | start u64 | numel u64
    | dtype u32 | arrays u32 | per array: name (16 bytes, NUL-padded), CRC-32C u32
    | CRC-32C of the header so far u32
    master, exp_avg, exp_avg_sq: numel x float32 each

The header checksum catches a flipped byte in the header, the per-array checksums one in
the data, the size check a torn file; the manifest's whole-file checksum ties the file to
the manifest that names it. A tier partition file ties itself by its header's checksum,
which covers its identity, update count and per-array checksums: recording it costs a
4 KiB read where a whole-file checksum would read every byte of a linked file.

A file covers a flat range ``[start, stop)``, and :class:`CheckpointReader` assembles any
other range from whichever files cover it: how the saving servers cut the space does not
matter. Where a parameter element sits in the flat space depends on the worker count
and the grouping, though, so restoring onto another layout reads each new segment's
elements from their saved positions (:mod:`cargohold.services.reshard`, from the layout
the manifest's ``extra`` records).

One writer per root at a time (the launcher); readers may run concurrently with it.
"""

from __future__ import annotations

import bisect
import errno
import itertools
import json
import logging
import os
import re
import shutil
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import google_crc32c
import torch

from cargohold.services.durable import TEMP_SUFFIX, fsync_directory, replace_durably
from cargohold.services.errors import CheckpointError, CorruptCheckpointError, CorruptPartitionError
from cargohold.services.tiers import fileformat as tier_format

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2
"""Of the manifest. Version 2 added ``files[].format``; version 1 manifests (every file a
shard file) are still read."""
READABLE_VERSIONS = (1, 2)
SHARD_FILE_VERSION = 1
"""Of a shard payload file's header."""
SHARD_FILE = "shard"
"""A payload file in the format below, whole-file CRC-32C in the manifest."""
TIER_PARTITION_FILE = "tier-partition"
"""An NVMe-tier partition file (:mod:`cargohold.services.tiers.fileformat`), hard-linked
or copied from the tier or written from RAM; the manifest records its header's CRC-32C,
which covers the checksums of its arrays."""
FILE_FORMATS = (SHARD_FILE, TIER_PARTITION_FILE)
MAGIC = b"CHOLDCKP"
MANIFEST_NAME = "manifest.json"
ARRAYS = ("master", "exp_avg", "exp_avg_sq")
"""The arrays of every payload file, in file order."""
DTYPE_FLOAT32 = 1

_STEP_DIR = re.compile(r"step-(\d{10,})")
_PARTIAL_DIR = re.compile(r"step-(\d{10,})\.partial")
_TRASH_SUFFIXES = (".deleting", ".replaced")
"""Suffixes of directories on their way out; never read, removed by the next commit."""

_HEADER = struct.Struct("<8sIIQQQII")
_ARRAY = struct.Struct("<16sI")
_CRC = struct.Struct("<I")
_HEADER_BYTES = _HEADER.size + len(ARRAYS) * _ARRAY.size + _CRC.size
_CHUNK = 1 << 20
"""Files are written from 1 MiB copies (the whole-file checksum runs over them as they go)
and verified by reading 1 MiB pieces into one reused buffer."""


# ----------------------------------------------------------------------------- manifest


@dataclass(frozen=True, slots=True)
class FileRecord:
    """A payload file as the manifest knows it: its name in the checkpoint directory, its
    size and the CRC-32C of its whole content."""

    name: str
    nbytes: int
    crc32c: int
    """Of the whole file for a shard file, of the header for a tier partition file."""
    format: str = SHARD_FILE


@dataclass(frozen=True, slots=True)
class ShardRecord:
    """The flat range ``[start, stop)`` of the model buffer that ``file`` holds."""

    segment_id: int
    start: int
    stop: int
    step: int
    file: str


@dataclass(frozen=True, slots=True)
class Manifest:
    """Everything needed to find, verify and place a checkpoint's payload.

    Construction validates the fields (types, ranges, no overlapping shards, every shard's
    file listed, every shard at ``step``) and raises :class:`CheckpointError`.
    """

    format_version: int
    step: int
    run_id: str
    config_hash: str
    model_signature: tuple[tuple[str, tuple[int, ...]], ...]
    """Parameter names and shapes, in layout order."""
    total: int
    """Padded length of the flat buffer the checkpoint was saved from."""
    shards: tuple[ShardRecord, ...]
    files: tuple[FileRecord, ...]
    extra: dict[str, Any] = field(default_factory=dict)
    """JSON-able extras: the update count, and the saving layout
    (:func:`cargohold.services.reshard.layout_extra`: its kind, ``align``, worker and server
    counts, groups)."""

    def __post_init__(self) -> None:
        _validate_manifest(self)

    def to_json(self) -> str:
        body = {
            "format_version": self.format_version,
            "step": self.step,
            "run_id": self.run_id,
            "config_hash": self.config_hash,
            "model_signature": [[name, list(shape)] for name, shape in self.model_signature],
            "total": self.total,
            "shards": [
                {"segment_id": s.segment_id, "start": s.start, "stop": s.stop, "step": s.step, "file": s.file}
                for s in self.shards
            ],
            "files": [{"name": f.name, "nbytes": f.nbytes, "crc32c": f.crc32c}
                      | ({"format": f.format} if self.format_version >= 2 else {}) for f in self.files],
            "extra": self.extra,
        }
        try:
            return json.dumps(body, indent=1, allow_nan=False) + "\n"
        except (TypeError, ValueError) as error:
            raise CheckpointError(f"manifest extra is not JSON-able: {error}") from error

    @classmethod
    def from_json(cls, text: str, *, source: str) -> Manifest:
        """Parse and validate; every error names ``source`` (the manifest's path)."""
        try:
            body = json.loads(text)
        except ValueError as error:
            raise CheckpointError(f"{source}: not a valid manifest (JSON: {error})") from error
        try:
            return cls._from_body(body)
        except CheckpointError as error:
            raise CheckpointError(f"{source}: {error}") from error

    @classmethod
    def _from_body(cls, body: object) -> Manifest:
        if not isinstance(body, dict):
            raise CheckpointError(f"the manifest is a JSON {type(body).__name__}, not an object")
        version = body.get("format_version")
        if version not in READABLE_VERSIONS or isinstance(version, bool):
            raise CheckpointError(
                f"format version {version!r}; this build reads versions {list(READABLE_VERSIONS)}"
            )
        keys = {"format_version", "step", "run_id", "config_hash", "model_signature", "total",
                "shards", "files", "extra"}
        if set(body) != keys:
            missing, unknown = sorted(keys - set(body)), sorted(set(body) - keys)
            raise CheckpointError(f"manifest fields missing {missing}, unknown {unknown}")
        signature = _list(body["model_signature"], "model_signature")
        shards = _list(body["shards"], "shards")
        files = _list(body["files"], "files")
        extra = body["extra"]
        if not isinstance(extra, dict):
            raise CheckpointError("extra must be an object")
        return cls(
            format_version=version,
            step=body["step"],
            run_id=body["run_id"],
            config_hash=body["config_hash"],
            model_signature=tuple(_signature_entry(entry, i) for i, entry in enumerate(signature)),
            total=body["total"],
            shards=tuple(ShardRecord(**_record(entry, ShardRecord, f"shards[{i}]"))
                         for i, entry in enumerate(shards)),
            files=tuple(FileRecord(**_record(entry, FileRecord, f"files[{i}]",
                                             without=("format",) if version == 1 else ()))
                        for i, entry in enumerate(files)),
            extra=extra,
        )


def _list(value: object, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise CheckpointError(f"{what} must be a list, got {type(value).__name__}")
    return value


def _signature_entry(entry: object, index: int) -> tuple[str, tuple[int, ...]]:
    if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], list)):
        raise CheckpointError(f"model_signature[{index}] must be [name, [dims]], got {entry!r}")
    return entry[0], tuple(entry[1])


def _record(entry: object, kind: type, what: str, without: Sequence[str] = ()) -> dict[str, Any]:
    names = set(kind.__dataclass_fields__) - set(without)  # type: ignore[attr-defined]
    if not isinstance(entry, dict) or set(entry) != names:
        raise CheckpointError(f"{what} must be an object with fields {sorted(names)}, got {entry!r}")
    return entry


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_name(name: object, what: str) -> None:
    """A payload file name: one plain path component, not one the store itself uses."""
    if (not isinstance(name, str) or not name or name in (".", "..", MANIFEST_NAME)
            or "/" in name or "\\" in name or "\0" in name or name.endswith(TEMP_SUFFIX)):
        raise CheckpointError(
            f"{what} {name!r} is not a valid payload file name (one path component, not "
            f"{MANIFEST_NAME!r}, not ending in {TEMP_SUFFIX!r})"
        )


def _validate_manifest(m: Manifest) -> None:
    if m.format_version not in READABLE_VERSIONS or not _is_int(m.format_version):
        raise CheckpointError(f"format version {m.format_version!r}; this build knows versions {list(READABLE_VERSIONS)}")
    for name in ("step", "total"):
        value = getattr(m, name)
        if not _is_int(value) or value < 0:
            raise CheckpointError(f"{name} must be an integer >= 0, got {value!r}")
    if m.total < 1:
        raise CheckpointError(f"total must be >= 1, got {m.total}")
    for name in ("run_id", "config_hash"):
        if not isinstance(getattr(m, name), str):
            raise CheckpointError(f"{name} must be a string, got {getattr(m, name)!r}")
    if not isinstance(m.model_signature, tuple):
        raise CheckpointError("model_signature must be a tuple of (name, shape)")
    for index, entry in enumerate(m.model_signature):
        if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str)
                and isinstance(entry[1], tuple) and all(_is_int(d) and d >= 0 for d in entry[1])):
            raise CheckpointError(f"model_signature[{index}] must be (name, shape), got {entry!r}")
    if not isinstance(m.extra, dict) or not all(isinstance(k, str) for k in m.extra):
        raise CheckpointError("extra must be a dict with string keys")

    if not isinstance(m.files, tuple) or not all(isinstance(f, FileRecord) for f in m.files):
        raise CheckpointError("files must be a tuple of FileRecord")
    names: set[str] = set()
    for record in m.files:
        _check_name(record.name, "file")
        if record.name in names:
            raise CheckpointError(f"file {record.name!r} is listed twice")
        names.add(record.name)
        if not _is_int(record.nbytes) or record.nbytes < 0:
            raise CheckpointError(f"file {record.name!r}: nbytes must be an integer >= 0, got {record.nbytes!r}")
        if not _is_int(record.crc32c) or not 0 <= record.crc32c < 1 << 32:
            raise CheckpointError(f"file {record.name!r}: crc32c must be a 32-bit unsigned integer")
        allowed = FILE_FORMATS if m.format_version >= 2 else (SHARD_FILE,)
        if record.format not in allowed:
            raise CheckpointError(f"file {record.name!r}: format {record.format!r} is not one of {list(allowed)}")

    if not isinstance(m.shards, tuple) or not all(isinstance(s, ShardRecord) for s in m.shards):
        raise CheckpointError("shards must be a tuple of ShardRecord")
    for shard in m.shards:
        where = f"shard {shard.segment_id!r}"
        if not all(_is_int(v) for v in (shard.segment_id, shard.start, shard.stop, shard.step)):
            raise CheckpointError(f"{where}: segment_id, start, stop and step must be integers")
        if not 0 <= shard.start < shard.stop <= m.total:
            raise CheckpointError(f"{where}: range [{shard.start}, {shard.stop}) is empty or outside [0, {m.total})")
        if shard.step != m.step:
            raise CheckpointError(f"{where} is at step {shard.step}, the checkpoint at step {m.step}")
        if not isinstance(shard.file, str) or shard.file not in names:
            raise CheckpointError(f"{where}: its file {shard.file!r} is not listed in files")
    ordered = sorted(m.shards, key=lambda s: s.start)
    for left, right in zip(ordered, ordered[1:]):
        if right.start < left.stop:
            raise CheckpointError(
                f"shards {left.segment_id} [{left.start}, {left.stop}) and {right.segment_id} "
                f"[{right.start}, {right.stop}) overlap"
            )


def _gaps(shards: Iterable[ShardRecord], start: int, stop: int) -> list[tuple[int, int]]:
    """The parts of ``[start, stop)`` no shard covers (shards do not overlap)."""
    gaps, cursor = [], start
    for shard in sorted(shards, key=lambda s: s.start):
        if shard.stop <= cursor or shard.start >= stop:
            continue
        if shard.start > cursor:
            gaps.append((cursor, shard.start))
        cursor = shard.stop
    if cursor < stop:
        gaps.append((cursor, stop))
    return gaps


def check_compatible(
    manifest: Manifest,
    *,
    model_signature: Sequence[tuple[str, Sequence[int]]],
    align: int,
) -> None:
    """Refuse a checkpoint of another model, naming the first parameter that differs.

    Parameters are matched by name: the checkpoint may list them in another order (its
    layout grouped them otherwise), and any worker or server count restores. The
    alignment recorded in ``manifest.extra["align"]`` must be ``align``.
    """
    theirs = _shape_map(manifest.model_signature, "the checkpoint")
    ours = _shape_map(model_signature, "this model")
    for name, shape in theirs.items():
        if name not in ours:
            raise CheckpointError(
                f"checkpoint is of another model: only the checkpoint has parameter {name!r} of shape "
                f"{shape} ({len(theirs)} parameters in the checkpoint, {len(ours)} in this model)"
            )
        if ours[name] != shape:
            raise CheckpointError(
                f"checkpoint is of another model: parameter {name!r} has shape {shape} in the "
                f"checkpoint but {ours[name]} in this model"
            )
    for name, shape in ours.items():
        if name not in theirs:
            raise CheckpointError(
                f"checkpoint is of another model: only this model has parameter {name!r} of shape "
                f"{shape} ({len(theirs)} parameters in the checkpoint, {len(ours)} in this model)"
            )
    saved_align = manifest.extra.get("align")
    if saved_align != align:
        raise CheckpointError(
            f"checkpoint is of another layout: it was saved with align {saved_align}, this run uses {align}"
        )


def _shape_map(signature: Iterable[tuple[str, Sequence[int]]], whose: str) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for name, shape in signature:
        if name in shapes:
            raise CheckpointError(f"{whose} lists parameter {name!r} twice")
        shapes[str(name)] = tuple(int(d) for d in shape)
    return shapes


# --------------------------------------------------------------------------- payload files


def free_space_hint(error: OSError) -> str:
    """What to do, appended to the message of a write that ran out of space."""
    return ("; free space there or lower the number of checkpoints kept"
            if error.errno in (errno.ENOSPC, errno.EDQUOT) else "")


def _os_error(action: str, path: Path, error: OSError) -> CheckpointError:
    reason = error.strerror or str(error)
    return CheckpointError(f"{action} {path} failed: {reason}{free_space_hint(error)}")


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _write_durably(target: Path, chunks: Iterable[bytes]) -> int:
    """Write ``chunks`` to ``target`` with :func:`replace_durably`; returns the CRC-32C of
    the content. An OSError becomes a CheckpointError naming ``target``."""
    try:
        with replace_durably(target) as temporary:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                crc = 0
                for chunk in chunks:
                    crc = google_crc32c.extend(crc, chunk)
                    _write_all(fd, chunk)
            finally:
                os.close(fd)
        return crc
    except OSError as error:
        raise _os_error("writing checkpoint file", target, error) from error


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    array = tensor.numpy()
    if array.dtype.byteorder == ">":  # the format is little-endian
        array = array.astype("<f4")
    return memoryview(array).cast("B")


def shard_file_bytes(numel: int) -> int:
    """Size of the shard file of ``numel`` elements: header and three fp32 arrays."""
    return _HEADER_BYTES + len(ARRAYS) * 4 * numel


def write_shard_file(
    directory: Path, name: str, *, step: int, start: int, tensors: Mapping[str, torch.Tensor]
) -> FileRecord:
    """Write master/exp_avg/exp_avg_sq of the flat range starting at ``start`` durably to
    ``directory/name`` and return its manifest record.

    The tensors must be fp32, 1-D and of equal length. An OSError (a full disk, an
    unwritable directory) becomes a CheckpointError naming the file and the reason, and
    leaves no file behind.
    """
    _check_name(name, "payload file")
    target = Path(directory) / name
    if set(tensors) != set(ARRAYS):
        raise CheckpointError(f"{target}: tensors must be exactly {list(ARRAYS)}, got {sorted(tensors)}")
    if not (_is_int(step) and step >= 0 and _is_int(start) and start >= 0):
        raise CheckpointError(f"{target}: step and start must be integers >= 0, got {step!r}, {start!r}")
    arrays = [tensors[a].detach().to("cpu").contiguous() for a in ARRAYS]
    numel = arrays[0].numel()
    for array_name, array in zip(ARRAYS, arrays):
        if array.dtype != torch.float32 or array.dim() != 1 or array.numel() != numel or numel == 0:
            raise CheckpointError(
                f"{target}: {array_name} must be a non-empty 1-D float32 tensor of the same length "
                f"as master ({numel}), got {array.dtype} of shape {tuple(array.shape)}"
            )
    views = [_as_bytes(a) for a in arrays]
    header = _HEADER.pack(MAGIC, SHARD_FILE_VERSION, _HEADER_BYTES, step, start, numel, DTYPE_FLOAT32, len(ARRAYS))
    for array_name, view in zip(ARRAYS, views):
        header += _ARRAY.pack(array_name.encode(), tier_format.crc32c(view))
    header += _CRC.pack(google_crc32c.value(header))

    def chunks() -> Iterable[bytes]:
        yield header
        for view in views:
            for offset in range(0, len(view), _CHUNK):
                yield bytes(view[offset : offset + _CHUNK])

    crc = _write_durably(target, chunks())
    return FileRecord(name=name, nbytes=shard_file_bytes(numel), crc32c=crc)


@dataclass(frozen=True, slots=True)
class _Payload:
    """A verified payload file: the flat range it holds and where its arrays lie."""

    path: Path
    step: int
    """What its header says: the data step (shard file) or update count (tier file)."""
    start: int
    numel: int
    offsets: tuple[int, ...]
    """Byte offset of master, exp_avg and exp_avg_sq."""


def _corrupt(path: Path, reason: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"checkpoint file {path} is corrupt: {reason}")


def _open_sized(path: Path, record: FileRecord | None) -> tuple[int, int]:
    """An open descriptor and the size, checked against ``record``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError as error:
        raise _corrupt(path, "the file is missing") from error
    except OSError as error:
        raise _os_error("reading checkpoint file", path, error) from error
    size = os.fstat(fd).st_size
    if record is not None and size != record.nbytes:
        os.close(fd)
        raise _corrupt(path, f"it is {size} bytes, the manifest records {record.nbytes} (a torn write?)")
    return fd, size


def _pread_exact(fd: int, path: Path, nbytes: int, offset: int) -> bytes:
    try:
        data = os.pread(fd, nbytes, offset)
    except OSError as error:
        raise _os_error("reading checkpoint file", path, error) from error
    if len(data) != nbytes:
        raise _corrupt(path, f"read {len(data)} of {nbytes} bytes at offset {offset} (truncated while reading)")
    return data


def _stream_crc(fd: int, path: Path, offset: int, nbytes: int, buffer: memoryview,
                also: int | None = None) -> tuple[int, int | None]:
    """CRC-32C of ``nbytes`` at ``offset``, read in pieces the size of ``buffer`` (a
    reused one: no allocation per piece, so verifying large files leaves no allocator
    slack behind); with ``also``, that running checksum extended by the same bytes too."""
    crc = 0
    for at in range(offset, offset + nbytes, len(buffer)):
        piece = buffer[: min(len(buffer), offset + nbytes - at)]
        try:
            got = os.preadv(fd, [piece], at)
        except OSError as error:
            raise _os_error("reading checkpoint file", path, error) from error
        if got != len(piece):
            raise _corrupt(path, f"read {got} of {len(piece)} bytes at offset {at} (truncated while reading)")
        crc = tier_format.crc32c(piece, crc)
        if also is not None:
            also = tier_format.crc32c(piece, also)
    return crc, also


def _verify_shard_file(fd: int, path: Path, size: int, record: FileRecord | None, buffer: memoryview) -> _Payload:
    """Check a shard file's header, size and every checksum in one streamed pass."""
    if size < _HEADER_BYTES:
        raise _corrupt(path, f"it is {size} bytes, shorter than the {_HEADER_BYTES}-byte header (truncated)")
    header = _pread_exact(fd, path, _HEADER_BYTES, 0)
    magic, version, header_bytes, step, start, numel, dtype, count = _HEADER.unpack_from(header)
    if magic != MAGIC:
        raise _corrupt(path, f"bad magic {magic!r}, not a cargohold checkpoint file")
    (stored,) = _CRC.unpack_from(header, _HEADER_BYTES - _CRC.size)
    if google_crc32c.value(header[: _HEADER_BYTES - _CRC.size]) != stored:
        raise _corrupt(path, "header checksum mismatch")
    if version != SHARD_FILE_VERSION:
        raise _corrupt(path, f"format version {version}; this build reads version {SHARD_FILE_VERSION}")
    if header_bytes != _HEADER_BYTES or dtype != DTYPE_FLOAT32 or count != len(ARRAYS):
        raise _corrupt(path, f"unsupported layout (header {header_bytes} bytes, dtype {dtype}, {count} arrays)")
    expected = _HEADER_BYTES + len(ARRAYS) * 4 * numel
    if size != expected:
        raise _corrupt(path, f"it is {size} bytes, its header says {expected} ({numel} elements; truncated?)")
    whole = google_crc32c.value(header)
    offsets = tuple(_HEADER_BYTES + index * 4 * numel for index in range(len(ARRAYS)))
    failed = None
    for index, array_name in enumerate(ARRAYS):
        name, crc = _ARRAY.unpack_from(header, _HEADER.size + index * _ARRAY.size)
        if name.rstrip(b"\0") != array_name.encode():
            raise _corrupt(path, f"array {index} is {name!r}, expected {array_name!r}")
        got, whole = _stream_crc(fd, path, offsets[index], 4 * numel, buffer, whole)
        if got != crc and failed is None:
            failed = f"{array_name} checksum mismatch"
    if record is not None and whole != record.crc32c:
        raise _corrupt(path, "whole-file checksum differs from the manifest's")
    if failed is not None:
        raise _corrupt(path, failed)
    return _Payload(path, step, start, numel, offsets)


def _verify_tier_file(fd: int, path: Path, size: int, record: FileRecord, shard: ShardRecord,
                      run_id: str, buffer: memoryview) -> _Payload:
    """Check a partition file against its manifest record and shard record: the header
    (its checksum is the one the manifest recorded), the identity, the size and each
    array's checksum, streamed."""
    if size < tier_format.HEADER_BYTES:
        raise _corrupt(path, f"it is {size} bytes, shorter than a partition file header (truncated)")
    try:
        header = tier_format.parse_header(_pread_exact(fd, path, tier_format.HEADER_BYTES, 0), path=str(path))
    except CorruptPartitionError as error:
        raise _corrupt(path, str(error)) from None
    if header.checksum() != record.crc32c:
        raise _corrupt(path, "header checksum differs from the manifest's")
    layout = tier_format.FileLayout(header.numel)
    if size != layout.file_bytes:
        raise _corrupt(path, f"it is {size} bytes, its header says {layout.file_bytes} (truncated?)")
    if (header.key.run_id, header.key.shard_id) != (run_id, shard.segment_id) or header.numel != shard.stop - shard.start:
        raise _corrupt(path, f"it holds {header.key} of {header.numel} elements, the manifest puts shard "
                             f"{shard.segment_id} [{shard.start}, {shard.stop}) of run {run_id!r} in it")
    offsets = tuple(layout.offset(index) for index in range(len(ARRAYS)))
    for index, array_name in enumerate(ARRAYS):
        if _stream_crc(fd, path, offsets[index], layout.region_bytes, buffer)[0] != header.checksums[index]:
            raise _corrupt(path, f"{array_name} checksum mismatch")
    return _Payload(path, header.step, shard.start, header.numel, offsets)


def _read_into(fd: int, payload: _Payload, lo: int, hi: int, out: Mapping[str, torch.Tensor], at: int) -> None:
    """Elements ``[lo, hi)`` (flat) of each array into ``out[name][at : at + hi - lo]``."""
    for index, array_name in enumerate(ARRAYS):
        target = memoryview(out[array_name][at : at + hi - lo].numpy()).cast("B")
        offset = payload.offsets[index] + 4 * (lo - payload.start)
        got = 0
        while got < len(target):
            try:
                n = os.preadv(fd, [target[got:]], offset + got)
            except OSError as error:
                raise _os_error("reading checkpoint file", payload.path, error) from error
            if n == 0:
                raise _corrupt(payload.path, "it ended early while being read (truncated?)")
            got += n


def read_shard_file(
    path: Path, record: FileRecord | None = None
) -> tuple[int, int, dict[str, torch.Tensor]]:
    """Read and verify a shard payload file; returns ``(step, start, tensors)``.

    Checks the magic, version, header checksum, size and each array's checksum, and with
    ``record`` the size and whole-file checksum the manifest recorded. Any mismatch or a
    truncated file raises CorruptCheckpointError naming the file.
    """
    path = Path(path)
    fd, size = _open_sized(path, record)
    try:
        payload = _verify_shard_file(fd, path, size, record, memoryview(bytearray(_CHUNK)))
        out = {name: torch.empty(payload.numel, dtype=torch.float32) for name in ARRAYS}
        _read_into(fd, payload, payload.start, payload.start + payload.numel, out, 0)
    finally:
        os.close(fd)
    return payload.step, payload.start, out


class CheckpointReader:
    """Flat ranges of one checkpoint's state — however the saving layout cut them: the
    resharding read.

    Memory stays bounded by the range asked for: each file is verified once, in a
    streamed pass of 1 MiB pieces, before its first use, and a range then reads only its
    own bytes. A restore into an NVMe tier asks for one partition at a time, so a state
    larger than RAM comes back through a buffer of one partition.
    """

    def __init__(self, directory: Path, manifest: Manifest) -> None:
        self.directory = Path(directory)
        self.manifest = manifest
        self._records = {f.name: f for f in manifest.files}
        self._shards = sorted(manifest.shards, key=lambda s: s.start)
        self._stops = [s.stop for s in self._shards]
        self._verified: dict[str, _Payload] = {}
        self._buffer = memoryview(bytearray(_CHUNK))

    def read(self, start: int, stop: int, out: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """master/exp_avg/exp_avg_sq of flat elements ``[start, stop)``: new tensors, or
        views of the first ``stop - start`` elements of ``out``'s fp32 tensors (scratch
        reused across calls, so a long restore allocates nothing per partition).

        The range must lie inside the checkpoint's ``[0, total)`` and every element of it
        be covered by a shard, else CheckpointError names the range or the gap.
        """
        manifest = self.manifest
        if not (_is_int(start) and _is_int(stop) and 0 <= start <= stop <= manifest.total):
            raise CheckpointError(
                f"flat range [{start}, {stop}) is not a range inside checkpoint {self.directory}'s "
                f"[0, {manifest.total})"
            )
        # shards are sorted and do not overlap: the first that may overlap ends past start
        shards = self._shards[bisect.bisect_right(self._stops, start):]
        shards = list(itertools.takewhile(lambda s: s.start < stop, shards))
        gaps = _gaps(shards, start, stop)
        if gaps:
            lo, hi = gaps[0]
            raise CheckpointError(
                f"checkpoint {self.directory} (step {manifest.step}) holds no file for flat elements "
                f"[{lo}, {hi}) of the requested [{start}, {stop})"
            )
        if out is None:
            out = {name: torch.empty(stop - start, dtype=torch.float32) for name in ARRAYS}
        else:
            out = {name: out[name][: stop - start] for name in ARRAYS}
        for shard in shards:
            lo, hi = max(shard.start, start), min(shard.stop, stop)
            path = self.directory / shard.file
            fd, size = _open_sized(path, self._records[shard.file])
            try:
                payload = self._verified.get(shard.file) or self._verify(fd, path, size, shard)
                _read_into(fd, payload, lo, hi, out, lo - start)
            finally:
                os.close(fd)
        return out

    def _verify(self, fd: int, path: Path, size: int, shard: ShardRecord) -> _Payload:
        record = self._records[shard.file]
        if record.format == TIER_PARTITION_FILE:
            holders = [s for s in self.manifest.shards if s.file == shard.file]
            if len(holders) != 1:
                raise CheckpointError(f"{path}: a partition file holds one shard, the manifest puts {len(holders)} in it")
            payload = _verify_tier_file(fd, path, size, record, shard, self.manifest.run_id, self._buffer)
        else:
            payload = _verify_shard_file(fd, path, size, record, self._buffer)
            if payload.step != self.manifest.step:
                raise _corrupt(path, f"it holds step {payload.step}, the manifest step {self.manifest.step}")
        for held in (s for s in self.manifest.shards if s.file == shard.file):
            if held.start < payload.start or held.stop > payload.start + payload.numel:
                raise _corrupt(path, f"it holds [{payload.start}, {payload.start + payload.numel}), the manifest "
                                     f"puts shard {held.segment_id} [{held.start}, {held.stop}) in it")
        self._verified[shard.file] = payload
        return payload


def read_flat_range(directory: Path, manifest: Manifest, start: int, stop: int) -> dict[str, torch.Tensor]:
    """:meth:`CheckpointReader.read` of one range (each file is verified once)."""
    return CheckpointReader(directory, manifest).read(start, stop)


# ---------------------------------------------------------------------------------- store


class CheckpointStore:
    """The checkpoints under one root: build, commit, prune, find.

    ``keep_last`` complete checkpoints are kept; the one just committed always is.
    """

    def __init__(self, root: Path, *, keep_last: int = 3) -> None:
        if not _is_int(keep_last) or keep_last < 1:
            raise ValueError(f"keep_last must be an integer >= 1, got {keep_last!r}")
        self.root = Path(root)
        self.keep_last = keep_last

    def final_dir(self, step: int) -> Path:
        return self.root / f"step-{step:010d}"

    def partial_dir(self, step: int) -> Path:
        return self.root / f"step-{step:010d}.partial"

    def begin(self, step: int) -> Path:
        """Create a fresh ``step-<step>.partial`` directory (removing a stale one, e.g.
        from a crashed save) for the payload files of ``step``."""
        if not _is_int(step) or step < 0:
            raise CheckpointError(f"step must be an integer >= 0, got {step!r}")
        partial = self.partial_dir(step)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            if partial.exists():
                shutil.rmtree(partial)
            partial.mkdir()
        except OSError as error:
            raise _os_error("creating checkpoint directory", partial, error) from error
        return partial

    def commit(self, step: int, manifest: Manifest) -> Path:
        """Make the partial checkpoint of ``step`` complete: check its files, write the
        manifest, rename the directory to its final name, then prune.

        On failure the partial directory is removed (it cannot become a checkpoint),
        earlier checkpoints are untouched, and CheckpointError says why. A complete
        checkpoint of the same step is replaced.
        """
        partial, final = self.partial_dir(step), self.final_dir(step)
        replaced: Path | None = None
        try:
            if manifest.step != step:
                raise CheckpointError(f"commit of step {step} got a manifest of step {manifest.step}")
            if not partial.is_dir():
                raise CheckpointError(f"{partial} does not exist; call begin({step}) before commit")
            gaps = _gaps(manifest.shards, 0, manifest.total)
            if gaps:
                raise CheckpointError(
                    f"the manifest of step {step} covers no shard for flat elements {gaps[0]} "
                    f"of [0, {manifest.total}); a state server's files are missing from it"
                )
            _check_files(partial, manifest)
            _write_durably(partial / MANIFEST_NAME, [manifest.to_json().encode()])
            if final.exists():
                replaced = final.with_name(final.name + ".replaced")
                _remove_tree(replaced)
                os.rename(final, replaced)
            os.rename(partial, final)
            fsync_directory(self.root)
        except (OSError, CheckpointError) as error:
            _remove_tree(partial)
            if replaced is not None and replaced.exists() and not final.exists():
                try:  # put the checkpoint being replaced back under its name
                    os.rename(replaced, final)
                except OSError:
                    logger.warning("could not restore %s from %s", final, replaced)
            if isinstance(error, CheckpointError):
                raise
            raise _os_error("committing checkpoint", final, error) from error
        if replaced is not None:
            _remove_tree(replaced)
        self._prune(step)
        return final

    def abort(self, step: int) -> None:
        """Remove the partial directory of ``step`` (a save that will not be committed)."""
        try:
            if self.partial_dir(step).exists():
                shutil.rmtree(self.partial_dir(step))
        except OSError as error:
            raise _os_error("removing partial checkpoint", self.partial_dir(step), error) from error

    def complete_steps(self) -> list[int]:
        """Steps with a directory of the final name, oldest first (not verified)."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        except OSError as error:
            raise _os_error("listing checkpoint root", self.root, error) from error
        return sorted(int(m.group(1)) for m in map(_STEP_DIR.fullmatch, names) if m)

    def latest(self) -> Path | None:
        """The newest checkpoint whose manifest parses and whose files exist with the
        recorded sizes. Checksums are verified when the payload is read, not here."""
        for step in reversed(self.complete_steps()):
            path = self.final_dir(step)
            try:
                self._verify(path, step)
            except CheckpointError as error:
                logger.warning("skipping checkpoint %s: %s", path, error)
                continue
            return path
        return None

    def resolve(self, spec: str) -> Path:
        """``"latest"`` or a path (a checkpoint directory or a root) -> a complete
        checkpoint directory."""
        if spec == "latest":
            found = self.latest()
            if found is None:
                raise CheckpointError(f"no complete checkpoint under {self.root} to resume from")
            return found
        path = Path(spec).expanduser()
        if not path.is_dir():
            raise CheckpointError(f"checkpoint {path} does not exist or is not a directory")
        if _PARTIAL_DIR.fullmatch(path.name):
            raise CheckpointError(f"{path} is an unfinished checkpoint (its save never committed)")
        if (path / MANIFEST_NAME).exists() or _STEP_DIR.fullmatch(path.name):
            match = _STEP_DIR.fullmatch(path.name)
            self._verify(path, int(match.group(1)) if match else None)
            return path
        found = CheckpointStore(path, keep_last=self.keep_last).latest()
        if found is None:
            raise CheckpointError(
                f"{path} is neither a checkpoint directory (no {MANIFEST_NAME}) nor a root "
                "holding a complete checkpoint"
            )
        return found

    def load(self, path: Path) -> Manifest:
        """Parse and validate the manifest of the checkpoint at ``path``."""
        source = Path(path) / MANIFEST_NAME
        try:
            text = source.read_text(encoding="utf-8")
        except FileNotFoundError as error:
            raise CheckpointError(f"{source} is missing: not a complete checkpoint") from error
        except (OSError, UnicodeDecodeError) as error:
            raise CheckpointError(f"{source}: cannot be read ({error})") from error
        return Manifest.from_json(text, source=str(source))

    def _verify(self, path: Path, step: int | None) -> Manifest:
        manifest = self.load(path)
        if step is not None and manifest.step != step:
            raise CheckpointError(f"{path / MANIFEST_NAME}: it is of step {manifest.step}, its directory of step {step}")
        _check_files(path, manifest)
        return manifest

    def _prune(self, committed: int) -> None:
        """Keep ``committed`` and the newest ``keep_last - 1`` others; drop partials of
        older steps and leftovers of interrupted removals. Failures only warn: the
        checkpoint is committed."""
        others = [s for s in self.complete_steps() if s != committed]
        doomed = [self.final_dir(s) for s in others[: max(0, len(others) - (self.keep_last - 1))]]
        try:
            names = os.listdir(self.root)
        except OSError as error:
            logger.warning("cannot list %s to prune old checkpoints: %s", self.root, error)
            names = []
        for name in sorted(names):
            partial = _PARTIAL_DIR.fullmatch(name)
            if (partial and int(partial.group(1)) < committed) or (
                    name.startswith("step-") and name.endswith(_TRASH_SUFFIXES)):
                doomed.append(self.root / name)
        for path in doomed:
            try:
                if _STEP_DIR.fullmatch(path.name):
                    # out of the complete namespace first, so a crash mid-delete leaves no
                    # half-deleted directory under a complete checkpoint's name
                    trash = path.with_name(path.name + ".deleting")
                    _remove_tree(trash)
                    os.rename(path, trash)
                    path = trash
                shutil.rmtree(path)
            except OSError as error:
                logger.warning("could not remove %s while pruning checkpoints: %s", path, error)


def _check_files(directory: Path, manifest: Manifest) -> None:
    for record in manifest.files:
        path = directory / record.name
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint file {path} named in the manifest is missing") from None
        except OSError as error:
            raise _os_error("checking checkpoint file", path, error) from error
        if size != record.nbytes:
            raise CheckpointError(f"checkpoint file {path} is {size} bytes, the manifest records {record.nbytes}")


def _remove_tree(path: Path) -> None:
    """Remove a directory tree if it exists; best effort (used on paths being discarded)."""
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        pass
    except OSError as error:
        logger.warning("could not remove %s: %s", path, error)
