"""The partition file format: a 4 KiB header, then the three arrays, each padded to
4 KiB so that the whole file, and each array alone, can move with O_DIRECT. Pure byte
layout and checks; the reading and writing is in :mod:`.nvme`.

    offset 0        header (HEADER_BYTES): magic, format version, dtype (the moments'
                    stored kind), numel, the moments' region size, update count, identity (run,
                    segment, partition), CRC-32C of each array, CRC-32C of the header itself
    HEADER_BYTES    master       numel x float32, zero-padded to a multiple of BLOCK
    + master region exp_avg      the moment in its stored form (``optim.state_dtype``,
                                 :mod:`cargohold.services.core.state_precision`), zero-padded
    + moment region exp_avg_sq   likewise

A moment's stored form: ``float32`` numel x float32 (the whole file then is byte for byte
the format before stored kinds existed, dtype 1); ``bfloat16`` numel x bfloat16;
``blockwise8`` numel uint8 codes, then (from the next multiple of 64 bytes) one float32
scale per block of 256 elements. Each array, codes and scales together, has one checksum.

Checksums are CRC-32C (google-crc32c) over each whole padded region, so a flipped byte
anywhere in the file is caught: in the header by the header's checksum, elsewhere by
its region's. A file shorter than its layout is torn. The identity and the update count
in the header catch a file that belongs to another partition or to another update.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import google_crc32c
import torch

from cargohold.services.core.errors import CorruptPartitionError
from cargohold.services.core.state_precision import BLOCK_ELEMENTS, STORED_TORCH_DTYPES, StateDtype, StoredMoment
from cargohold.services.tiers.residency import PartitionKey

MAGIC = b"CGHTIER\0"
FORMAT_VERSION = 1
BLOCK = 4096
"""Alignment of every offset and length in a partition file (O_DIRECT's strictest)."""
HEADER_BYTES = BLOCK
ARRAYS = ("master", "exp_avg", "exp_avg_sq")
DTYPE_FLOAT32 = 1
DTYPE_CODES: dict[str, int] = {"float32": DTYPE_FLOAT32, "bfloat16": 2, "blockwise8": 3}
"""The header's dtype field: how the file stores the moments."""
_DTYPE_OF_CODE = {code: name for name, code in DTYPE_CODES.items()}
_MOMENT_ITEMSIZE = {name: dtype.itemsize for name, dtype in STORED_TORCH_DTYPES.items()}
_MOMENT_TORCH = STORED_TORCH_DTYPES
_SCALES_ALIGN = 64
MAX_RUN_ID_BYTES = 1024
_FIXED = struct.Struct("<8sIIIIQQQQIIIIH")
_CRC = struct.Struct("<I")


def round_up(value: int, multiple: int = BLOCK) -> int:
    return -(-value // multiple) * multiple


def gradient_file_bytes(numel: int, itemsize: int) -> int:
    """Bytes of one partition's staged gradient (``numel`` elements of ``itemsize`` bytes)
    in memory or in its scratch file, 4 KiB aligned for O_DIRECT (:mod:`.gradients`)."""
    return round_up(numel * itemsize)


@dataclass(frozen=True, slots=True)
class FileLayout:
    """Byte offsets of a partition of ``numel`` elements whose moments are stored as
    ``dtype``, in its file and its buffer."""

    numel: int
    dtype: StateDtype = "float32"

    @property
    def array_bytes(self) -> int:
        """Bytes of the fp32 master weights."""
        return 4 * self.numel

    @property
    def region_bytes(self) -> int:
        """Bytes of the master weights' region."""
        return round_up(self.array_bytes)

    @property
    def blocks(self) -> int:
        """Block scales per moment (``blockwise8``; 0 for the other kinds)."""
        return -(-self.numel // BLOCK_ELEMENTS) if self.dtype == "blockwise8" else 0

    @property
    def scales_offset(self) -> int:
        """Where a moment's block scales start inside its region."""
        return round_up(self.numel * _MOMENT_ITEMSIZE[self.dtype], _SCALES_ALIGN)

    @property
    def moment_region_bytes(self) -> int:
        """Bytes of each moment's region (values, then block scales)."""
        return round_up(self.scales_offset + 4 * self.blocks)

    def region_bytes_of(self, array: int) -> int:
        return self.region_bytes if array == 0 else self.moment_region_bytes

    @property
    def file_bytes(self) -> int:
        return HEADER_BYTES + self.region_bytes + 2 * self.moment_region_bytes

    def offset(self, array: int) -> int:
        """Byte offset of array ``array`` (0 master, 1 exp_avg, 2 exp_avg_sq)."""
        return HEADER_BYTES + (0 if array == 0 else self.region_bytes + (array - 1) * self.moment_region_bytes)

    def moment(self, data: torch.Tensor, array: int) -> StoredMoment:
        """Views of moment ``array`` (1 or 2) in ``data``, a uint8 tensor of the file's bytes."""
        start = self.offset(array)
        values = data[start : start + self.numel * _MOMENT_ITEMSIZE[self.dtype]].view(_MOMENT_TORCH[self.dtype])
        scales = data[start + self.scales_offset : start + self.scales_offset + 4 * self.blocks].view(torch.float32)
        return StoredMoment(self.dtype, ARRAYS[array], values, scales)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class PartitionHeader:
    key: PartitionKey
    numel: int
    updates: int
    """The number of updates its state includes."""
    checksums: tuple[int, int, int]
    """CRC-32C of the master, exp_avg and exp_avg_sq regions (padding included)."""
    version: int = FORMAT_VERSION
    dtype: StateDtype = "float32"
    """How the file stores the moments."""

    def pack(self) -> bytes:
        """The header block: HEADER_BYTES long, zero-padded, its own checksum last."""
        run = self.key.run_id.encode()
        if len(run) > MAX_RUN_ID_BYTES:
            raise ValueError(f"run id is {len(run)} bytes; at most {MAX_RUN_ID_BYTES} fit a header")
        body = (
            _FIXED.pack(
                MAGIC,
                self.version,
                HEADER_BYTES,
                DTYPE_CODES[self.dtype],
                len(ARRAYS),
                self.numel,
                FileLayout(self.numel, self.dtype).moment_region_bytes,
                self.updates,
                self.key.segment_id,
                self.key.index,
                *self.checksums,
                len(run),
            )
            + run
        )
        body += _CRC.pack(google_crc32c.value(body))
        return body + bytes(HEADER_BYTES - len(body))

    def checksum(self) -> int:
        """The CRC-32C the packed header stores: it covers the identity, the update count and the
        arrays' checksums, so it stands for the whole file (a checkpoint's manifest
        records it for a partition file instead of a whole-file checksum)."""
        packed = self.pack()
        end = _FIXED.size + len(self.key.run_id.encode())
        return _CRC.unpack_from(packed, end)[0]


def parse_header(raw: bytes | memoryview, *, path: str, expected: PartitionKey | None = None) -> PartitionHeader:
    """Parse and check a header block whatever partition it names (a checkpoint's reader
    takes the identity from it); raises CorruptPartitionError naming the file, and the
    ``expected`` partition when given."""

    def corrupt(reason: str) -> CorruptPartitionError:
        return corrupt_error(path, expected, reason)

    raw = bytes(raw[:HEADER_BYTES])
    if len(raw) < HEADER_BYTES:
        raise corrupt(f"header is {len(raw)} bytes, shorter than a header")
    (
        magic,
        version,
        header_bytes,
        dtype,
        arrays,
        numel,
        region,
        updates,
        segment_id,
        index,
        crc0,
        crc1,
        crc2,
        run_len,
    ) = _FIXED.unpack_from(raw)
    if magic != MAGIC:
        raise corrupt(f"bad magic {magic!r}, not a cargohold partition file")
    end = _FIXED.size + run_len
    if run_len > MAX_RUN_ID_BYTES or end + _CRC.size > len(raw):
        raise corrupt("header checksum mismatch (run id length out of range)")
    (stored_crc,) = _CRC.unpack_from(raw, end)
    if google_crc32c.value(raw[:end]) != stored_crc:
        raise corrupt("header checksum mismatch")
    if version != FORMAT_VERSION:
        raise corrupt(f"format version {version}, this build reads version {FORMAT_VERSION}")
    if header_bytes != HEADER_BYTES or dtype not in _DTYPE_OF_CODE or arrays != len(ARRAYS):
        raise corrupt(f"unsupported layout (header {header_bytes} bytes, dtype {dtype}, {arrays} arrays)")
    kind = _DTYPE_OF_CODE[dtype]
    if region != FileLayout(numel, kind).moment_region_bytes:  # type: ignore[arg-type]
        raise corrupt(f"regions of {region} bytes do not fit {numel} {kind} elements")
    key = PartitionKey(raw[_FIXED.size : end].decode(errors="replace"), segment_id, index)
    return PartitionHeader(
        key=key,
        numel=numel,
        updates=updates,
        checksums=(crc0, crc1, crc2),
        version=version,
        dtype=kind,  # type: ignore[arg-type]
    )


def unpack_header(
    raw: bytes | memoryview, *, path: str, key: PartitionKey, numel: int, dtype: StateDtype = "float32"
) -> PartitionHeader:
    """Parse and check the header of the file of partition ``key`` (``numel`` elements,
    moments stored as ``dtype``); raises CorruptPartitionError naming file and partition."""
    header = parse_header(raw, path=path, expected=key)
    if header.key != key:
        raise corrupt_error(path, key, f"the file holds {header.key}")
    if header.numel != numel:
        raise corrupt_error(path, key, f"shape is {header.numel} elements, expected {numel}")
    if header.dtype != dtype:
        raise corrupt_error(path, key, f"it stores the moments as {header.dtype}, expected {dtype}")
    return header


def check_size(size: int, *, path: str, key: PartitionKey, numel: int, dtype: StateDtype = "float32") -> None:
    """Refuse a file of partition ``key`` whose size is not its layout's (torn)."""
    expected = FileLayout(numel, dtype).file_bytes
    if size != expected:
        raise corrupt_error(path, key, f"it is {size} bytes, expected {expected} (a torn write?)")


def check_updates(header: PartitionHeader, updates: int, *, path: str) -> None:
    """Refuse a file of another version than the one after ``updates`` updates."""
    if header.updates != updates:
        raise corrupt_error(
            path, header.key, f"it holds the state after {header.updates} updates, expected after {updates}"
        )


def corrupt_error(path: str, key: PartitionKey | None, reason: str) -> CorruptPartitionError:
    what = f"partition file {path}" + (f" ({key})" if key is not None else "")
    return CorruptPartitionError(
        f"{what} is corrupt: {reason}; it was not used", path=path, partition=str(key) if key is not None else ""
    )
