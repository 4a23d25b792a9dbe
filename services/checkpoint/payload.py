"""Payload files: the flat ranges of optimizer state a checkpoint holds, and their
verification against the manifest.

A shard file is a fixed little-endian header, then the raw fp32 arrays::

    magic "CHOLDCKP" | version u32 | header bytes u32 | step u64 | start u64 | numel u64
    | dtype u32 | arrays u32 | per array: name (16 bytes, NUL-padded), CRC-32C u32
    | CRC-32C of the header so far u32
    master, exp_avg, exp_avg_sq: numel x float32 each

The header checksum catches a flipped byte in the header, the per-array checksums one in
the data, the size check a torn file; the manifest's whole-file checksum ties the file to
the manifest that names it. A tier partition file ties itself by its header's checksum,
which covers its identity, update count and per-array checksums: recording it costs a
4 KiB read where a whole-file checksum would read every byte of a linked file.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import google_crc32c
import torch

from cargohold.services.checkpoint.errors import corrupt, os_error
from cargohold.services.checkpoint.manifest import FileRecord, ShardRecord, check_name, is_int
from cargohold.services.durable import replace_durably
from cargohold.services.errors import CheckpointError, CorruptPartitionError
from cargohold.services.tiers import fileformat as tier_format
from cargohold.services.tiers.fileformat import ARRAYS, DTYPE_FLOAT32, crc32c

SHARD_FILE_VERSION = 1
"""Of a shard payload file's header."""
MAGIC = b"CHOLDCKP"

_HEADER = struct.Struct("<8sIIQQQII")
_ARRAY = struct.Struct("<16sI")
_CRC = struct.Struct("<I")
_HEADER_BYTES = _HEADER.size + len(ARRAYS) * _ARRAY.size + _CRC.size
CHUNK = 1 << 20
"""Files are written from 1 MiB copies (the whole-file checksum runs over them as they go)
and verified by reading 1 MiB pieces into one reused buffer."""


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
        raise os_error("writing checkpoint file", target, error) from error


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
    check_name(name, "payload file")
    target = Path(directory) / name
    if set(tensors) != set(ARRAYS):
        raise CheckpointError(f"{target}: tensors must be exactly {list(ARRAYS)}, got {sorted(tensors)}")
    if not (is_int(step) and step >= 0 and is_int(start) and start >= 0):
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
        header += _ARRAY.pack(array_name.encode(), crc32c(view))
    header += _CRC.pack(google_crc32c.value(header))

    def chunks() -> Iterable[bytes]:
        yield header
        for view in views:
            for offset in range(0, len(view), CHUNK):
                yield bytes(view[offset : offset + CHUNK])

    crc = _write_durably(target, chunks())
    return FileRecord(name=name, nbytes=shard_file_bytes(numel), crc32c=crc)


@dataclass(frozen=True, slots=True)
class Payload:
    """A verified payload file: the flat range it holds and where its arrays lie."""

    path: Path
    step: int
    """What its header says: the data step (shard file) or update count (tier file)."""
    start: int
    numel: int
    offsets: tuple[int, ...]
    """Byte offset of master, exp_avg and exp_avg_sq."""


def open_sized(path: Path, record: FileRecord | None) -> tuple[int, int]:
    """An open descriptor and the size, checked against ``record``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError as error:
        raise corrupt(path, "the file is missing") from error
    except OSError as error:
        raise os_error("reading checkpoint file", path, error) from error
    size = os.fstat(fd).st_size
    if record is not None and size != record.nbytes:
        os.close(fd)
        raise corrupt(path, f"it is {size} bytes, the manifest records {record.nbytes} (a torn write?)")
    return fd, size


def _pread_exact(fd: int, path: Path, nbytes: int, offset: int) -> bytes:
    try:
        data = os.pread(fd, nbytes, offset)
    except OSError as error:
        raise os_error("reading checkpoint file", path, error) from error
    if len(data) != nbytes:
        raise corrupt(path, f"read {len(data)} of {nbytes} bytes at offset {offset} (truncated while reading)")
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
            raise os_error("reading checkpoint file", path, error) from error
        if got != len(piece):
            raise corrupt(path, f"read {got} of {len(piece)} bytes at offset {at} (truncated while reading)")
        crc = crc32c(piece, crc)
        if also is not None:
            also = crc32c(piece, also)
    return crc, also


def verify_shard_file(fd: int, path: Path, size: int, record: FileRecord | None, buffer: memoryview) -> Payload:
    """Check a shard file's header, size and every checksum in one streamed pass."""
    if size < _HEADER_BYTES:
        raise corrupt(path, f"it is {size} bytes, shorter than the {_HEADER_BYTES}-byte header (truncated)")
    header = _pread_exact(fd, path, _HEADER_BYTES, 0)
    magic, version, header_bytes, step, start, numel, dtype, count = _HEADER.unpack_from(header)
    if magic != MAGIC:
        raise corrupt(path, f"bad magic {magic!r}, not a cargohold checkpoint file")
    (stored,) = _CRC.unpack_from(header, _HEADER_BYTES - _CRC.size)
    if google_crc32c.value(header[: _HEADER_BYTES - _CRC.size]) != stored:
        raise corrupt(path, "header checksum mismatch")
    if version != SHARD_FILE_VERSION:
        raise corrupt(path, f"format version {version}; this build reads version {SHARD_FILE_VERSION}")
    if header_bytes != _HEADER_BYTES or dtype != DTYPE_FLOAT32 or count != len(ARRAYS):
        raise corrupt(path, f"unsupported layout (header {header_bytes} bytes, dtype {dtype}, {count} arrays)")
    expected = _HEADER_BYTES + len(ARRAYS) * 4 * numel
    if size != expected:
        raise corrupt(path, f"it is {size} bytes, its header says {expected} ({numel} elements; truncated?)")
    whole = google_crc32c.value(header)
    offsets = tuple(_HEADER_BYTES + index * 4 * numel for index in range(len(ARRAYS)))
    failed = None
    for index, array_name in enumerate(ARRAYS):
        name, crc = _ARRAY.unpack_from(header, _HEADER.size + index * _ARRAY.size)
        if name.rstrip(b"\0") != array_name.encode():
            raise corrupt(path, f"array {index} is {name!r}, expected {array_name!r}")
        got, whole = _stream_crc(fd, path, offsets[index], 4 * numel, buffer, whole)
        if got != crc and failed is None:
            failed = f"{array_name} checksum mismatch"
    if record is not None and whole != record.crc32c:
        raise corrupt(path, "whole-file checksum differs from the manifest's")
    if failed is not None:
        raise corrupt(path, failed)
    return Payload(path, step, start, numel, offsets)


def verify_tier_file(fd: int, path: Path, size: int, record: FileRecord, shard: ShardRecord,
                      run_id: str, buffer: memoryview) -> Payload:
    """Check a partition file against its manifest record and shard record: the header
    (its checksum is the one the manifest recorded), the identity, the size and each
    array's checksum, streamed."""
    if size < tier_format.HEADER_BYTES:
        raise corrupt(path, f"it is {size} bytes, shorter than a partition file header (truncated)")
    try:
        header = tier_format.parse_header(_pread_exact(fd, path, tier_format.HEADER_BYTES, 0), path=str(path))
    except CorruptPartitionError as error:
        raise corrupt(path, str(error)) from None
    if header.checksum() != record.crc32c:
        raise corrupt(path, "header checksum differs from the manifest's")
    layout = tier_format.FileLayout(header.numel)
    if size != layout.file_bytes:
        raise corrupt(path, f"it is {size} bytes, its header says {layout.file_bytes} (truncated?)")
    if ((header.key.run_id, header.key.shard_id) != (run_id, shard.segment_id)
            or header.numel != shard.stop - shard.start):
        raise corrupt(path, f"it holds {header.key} of {header.numel} elements, the manifest puts shard "
                             f"{shard.segment_id} [{shard.start}, {shard.stop}) of run {run_id!r} in it")
    offsets = tuple(layout.offset(index) for index in range(len(ARRAYS)))
    for index, array_name in enumerate(ARRAYS):
        if _stream_crc(fd, path, offsets[index], layout.region_bytes, buffer)[0] != header.checksums[index]:
            raise corrupt(path, f"{array_name} checksum mismatch")
    return Payload(path, header.step, shard.start, header.numel, offsets)


def read_into(fd: int, payload: Payload, lo: int, hi: int, out: Mapping[str, torch.Tensor], at: int) -> None:
    """Elements ``[lo, hi)`` (flat) of each array into ``out[name][at : at + hi - lo]``."""
    for index, array_name in enumerate(ARRAYS):
        target = memoryview(out[array_name][at : at + hi - lo].numpy()).cast("B")
        offset = payload.offsets[index] + 4 * (lo - payload.start)
        got = 0
        while got < len(target):
            try:
                n = os.preadv(fd, [target[got:]], offset + got)
            except OSError as error:
                raise os_error("reading checkpoint file", payload.path, error) from error
            if n == 0:
                raise corrupt(payload.path, "it ended early while being read (truncated?)")
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
    fd, size = open_sized(path, record)
    try:
        payload = verify_shard_file(fd, path, size, record, memoryview(bytearray(CHUNK)))
        out = {name: torch.empty(payload.numel, dtype=torch.float32) for name in ARRAYS}
        read_into(fd, payload, payload.start, payload.start + payload.numel, out, 0)
    finally:
        os.close(fd)
    return payload.step, payload.start, out
