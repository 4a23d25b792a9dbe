"""Payload files and their verification against the manifest.

A checkpoint holds the optimizer state in partition files, the NVMe tier's own format
(:mod:`cargohold.services.tiers.fileformat`: a 4 KiB header naming the run, segment,
partition and update count, with a CRC-32C per array and one of its own, then master,
exp_avg and exp_avg_sq, each padded to 4 KiB), whether the tier hard-linked them or they
were written from RAM. A file holds the flat range of exactly one segment record.

The manifest records each file's size and its header's CRC-32C. The header covers the
identity, the update count and the arrays' checksums, so recording it ties the whole
file to the manifest for a 4 KiB read, where a whole-file checksum would read every byte
of a linked file. :func:`verify` checks all of it in one streamed pass before a file is
first used: the header checksum catches a flipped byte in the header, the per-array
checksums one in the data, the size check a torn file.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from cargohold.services.checkpoint.errors import corrupt, os_error
from cargohold.services.checkpoint.files import open_regular
from cargohold.services.checkpoint.manifest import FileRecord, Manifest, SegmentRecord
from cargohold.services.core.checksum import crc32c
from cargohold.services.core.errors import CorruptPartitionError
from cargohold.services.core.state_precision import BLOCK_ELEMENTS, STORED_TORCH_DTYPES, StoredMoment, decode_range
from cargohold.services.tiers.fileformat import ARRAYS, HEADER_BYTES, FileLayout, parse_header

CHUNK = 1 << 20
"""Files are verified by reading 1 MiB pieces into one reused buffer."""


@dataclass(frozen=True, slots=True)
class Payload:
    """A verified payload file: the flat range it holds and where its arrays lie."""

    path: Path
    start: int
    numel: int
    layout: FileLayout


def open_sized(path: Path, record: FileRecord) -> tuple[int, int]:
    """An open descriptor of the regular file ``path`` (:func:`.files.open_regular`) and
    its size, checked against ``record``."""
    try:
        fd = open_regular(path)
    except FileNotFoundError as error:
        raise corrupt(path, "the file is missing") from error
    except OSError as error:
        raise os_error("reading checkpoint file", path, error) from error
    size = os.fstat(fd).st_size
    if size != record.nbytes:
        os.close(fd)
        raise corrupt(path, f"it is {size} bytes, the manifest records {record.nbytes} (a torn write?)")
    return fd, size


def verify(
    fd: int, path: Path, size: int, record: FileRecord, segment: SegmentRecord, manifest: Manifest, buffer: memoryview
) -> Payload:
    """Check the partition file of ``segment`` against its manifest: the header (its
    checksum is the one ``record`` holds), the identity, the update count, the size and
    each array's checksum, streamed through ``buffer``. Raises CorruptCheckpointError
    naming the file."""
    if size < HEADER_BYTES:
        raise corrupt(path, f"it is {size} bytes, shorter than a partition file header (truncated)")
    try:
        header = parse_header(_pread_exact(fd, path, HEADER_BYTES, 0), path=str(path))
    except CorruptPartitionError as error:
        raise corrupt(path, str(error)) from None
    if header.checksum() != record.crc32c:
        raise corrupt(path, "header checksum differs from the manifest's")
    layout = FileLayout(header.numel, header.dtype)
    if size != layout.file_bytes:
        raise corrupt(path, f"it is {size} bytes, its header says {layout.file_bytes} (truncated?)")
    if (header.key.run_id, header.key.segment_id) != (
        manifest.run_id,
        segment.segment_id,
    ) or header.numel != segment.stop - segment.start:
        raise corrupt(
            path,
            f"it holds {header.key} of {header.numel} elements, the manifest puts segment "
            f"{segment.segment_id} [{segment.start}, {segment.stop}) of run {manifest.run_id!r} in it",
        )
    if header.updates != manifest.updates:
        raise corrupt(
            path, f"it holds the state after {header.updates} updates, the manifest's after {manifest.updates}"
        )
    for index, array_name in enumerate(ARRAYS):
        if (
            _stream_crc(fd, path, layout.offset(index), layout.region_bytes_of(index), buffer)
            != header.checksums[index]
        ):
            raise corrupt(path, f"{array_name} checksum mismatch")
    return Payload(path, segment.start, header.numel, layout)


def read_into(
    fd: int, payload: Payload, lo: int, hi: int, out: Mapping[str, torch.Tensor], at: int, *, arrays: int = 3
) -> None:
    """Elements ``[lo, hi)`` (flat) of the first ``arrays`` arrays into
    ``out[name][at : at + hi - lo]``, fp32: moments stored in another kind are decoded
    (the blocks around the range read)."""
    layout = payload.layout
    for index, array_name in enumerate(ARRAYS[:arrays]):
        target = out[array_name][at : at + hi - lo]
        if index == 0 or layout.dtype == "float32":
            _pread_into(fd, payload.path, target, payload.layout.offset(index) + 4 * (lo - payload.start))
            continue
        first, stop = lo - payload.start, hi - payload.start
        stored = read_stored(fd, payload, index, first // BLOCK_ELEMENTS * BLOCK_ELEMENTS, stop)
        decoded = torch.empty(stored.numel, dtype=torch.float32)
        decode_range(stored, 0, decoded)
        target.copy_(decoded[first % BLOCK_ELEMENTS : first % BLOCK_ELEMENTS + stop - first])


def read_stored(fd: int, payload: Payload, index: int, first: int, stop: int) -> StoredMoment:
    """Elements ``[first, stop)`` of the file's moment ``index`` (1 or 2) in their stored
    form; for ``blockwise8`` ``first`` is a multiple of the block size and the range is
    widened to whole blocks."""
    layout = payload.layout
    if layout.dtype == "blockwise8":
        stop = min(payload.numel, -(-stop // BLOCK_ELEMENTS) * BLOCK_ELEMENTS)
    within = FileLayout(stop - first, layout.dtype)
    values = torch.empty(stop - first, dtype=STORED_TORCH_DTYPES[layout.dtype])
    region = layout.offset(index)
    _pread_into(fd, payload.path, values, region + values.element_size() * first)
    scales = torch.empty(within.blocks, dtype=torch.float32)
    _pread_into(fd, payload.path, scales, region + layout.scales_offset + 4 * (first // BLOCK_ELEMENTS))
    return StoredMoment(layout.dtype, ARRAYS[index], values, scales)  # type: ignore[arg-type]


def _pread_into(fd: int, path: Path, tensor: torch.Tensor, offset: int) -> None:
    target = tensor.view(torch.uint8).numpy().data.cast("B")
    got = 0
    while got < len(target):
        try:
            n = os.preadv(fd, [target[got:]], offset + got)
        except OSError as error:
            raise os_error("reading checkpoint file", path, error) from error
        if n == 0:
            raise corrupt(path, "it ended early while being read (truncated?)")
        got += n


def _pread_exact(fd: int, path: Path, nbytes: int, offset: int) -> bytes:
    try:
        data = os.pread(fd, nbytes, offset)
    except OSError as error:
        raise os_error("reading checkpoint file", path, error) from error
    if len(data) != nbytes:
        raise corrupt(path, f"read {len(data)} of {nbytes} bytes at offset {offset} (truncated while reading)")
    return data


def _stream_crc(fd: int, path: Path, offset: int, nbytes: int, buffer: memoryview) -> int:
    """CRC-32C of ``nbytes`` at ``offset``, read in pieces the size of ``buffer`` (a
    reused one: no allocation per piece, so verifying large files leaves no allocator
    slack behind)."""
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
    return crc
