"""Gradients staged until the step's global norm is known, kept where their partition's
state is: in RAM beside a resident partition, in a scratch file beside a disk partition.

With clipping (or the non-finite check) no update may start before every segment's
contribution to the global norm has arrived, so each pushed gradient waits for its
commit. Held whole in RAM, the waiting gradients of a server are a copy of its range of
the model in the wire dtype; here they cost RAM only for the resident partitions (the
tier planner counts those bytes in the budget) and a ``.grad`` file beside each disk
partition's state file (2-4 bytes per element written at the push and read back by the
update, against the 24 the state itself moves).

A ``.grad`` file is scratch: written whole (no rename, no fsync: a crash loses the step,
which the run redoes from its checkpoint), checked against the CRC-32C kept in memory
when read back, and never part of a checkpoint. The files are removed with the server's
folder.
"""

from __future__ import annotations

import errno
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from cargohold.services.errors import TierError, TierSpaceError
from cargohold.services.tiers.fileformat import corrupt_error, crc32c, gradient_file_bytes
from cargohold.services.tiers.io_pool import AlignedBuffer, BufferPool, IoPool
from cargohold.services.tiers.nvme import NvmeTier, read_file_into, write_file
from cargohold.services.tiers.residency import PartitionKey, Residency
from cargohold.services.tiers.tier import Partition

GRADIENT_SUFFIX = ".grad"


def gradient_file_of(partition: Partition) -> str:
    """The scratch file beside the partition's state file."""
    return partition.path.removesuffix(".bin") + GRADIENT_SUFFIX


@dataclass(slots=True)
class _Piece:
    """One partition's staged gradient for ``update``: in RAM, or in its file with the CRC."""

    update: int
    dtype: torch.dtype
    numel: int
    ram: torch.Tensor | None = None
    crc: int = 0


class StagedGradients:
    """The staged gradient piece of every partition, for one server's tiered storage.

    ``nvme`` is None without a disk tier: every piece then stays in RAM.
    """

    def __init__(self, nvme: NvmeTier | None, io: IoPool | None, buffers: BufferPool | None) -> None:
        self._nvme = nvme
        self._io = io
        self._buffers = buffers
        """Aligned buffers a piece moves to and from its file through."""
        self._lock = threading.Lock()
        self._pieces: dict[PartitionKey, _Piece] = {}
        self._ram: dict[PartitionKey, AlignedBuffer] = {}
        """Each resident partition's piece buffer (4 KiB aligned, as the plan counts it),
        kept from step to step: the budget pays for it, and a fresh allocation's page
        faults would cost as much as the copy."""

    def stage(self, parts: Sequence[Partition], update: int, gradient: torch.Tensor) -> None:
        """Keep ``gradient``'s piece of each partition in ``parts`` for ``update``: resident
        partitions' in RAM, the others' in their files. Returns once every piece is kept, so
        the caller may reuse ``gradient``. Raises TierError (a failed write) with the pieces
        already kept still staged; staging again replaces them."""
        writes: list[Future[None]] = []
        try:
            for part in parts:
                piece = gradient[part.span.start : part.span.stop]
                if part.residency is Residency.RAM or self._nvme is None:
                    self._stage_in_ram(part, update, piece)
                else:
                    writes.append(self._stage_on_disk(part, update, piece))
        finally:
            errors = [w.exception() for w in writes]  # waits for every write
        failed = next((e for e in errors if e is not None), None)
        if failed is not None:
            raise failed

    def _stage_in_ram(self, part: Partition, update: int, piece: torch.Tensor) -> None:
        key = part.key
        nbytes = gradient_file_bytes(piece.numel(), piece.element_size())
        with self._lock:
            buffer = self._ram.get(key)
        if buffer is None or buffer.nbytes != nbytes:
            buffer = AlignedBuffer(nbytes)
        held = buffer.tensor[: piece.numel() * piece.element_size()].view(piece.dtype)
        held.copy_(piece)
        with self._lock:
            self._ram[key] = buffer
            self._pieces[key] = _Piece(update, piece.dtype, piece.numel(), ram=held)

    def _stage_on_disk(self, part: Partition, update: int, piece: torch.Tensor) -> Future[None]:
        assert self._nvme is not None and self._io is not None and self._buffers is not None
        nvme, buffers = self._nvme, self._buffers
        nbytes = gradient_file_bytes(piece.numel(), piece.element_size())
        buffer, _ = buffers.acquire(None, block=True)
        data = buffer.tensor[: piece.numel() * piece.element_size()]
        data.copy_(piece.contiguous().view(torch.uint8))
        buffer.tensor[data.numel() : nbytes].zero_()
        path = gradient_file_of(part)
        tier_path = nvme.paths[part.path_index]
        with self._lock:  # an earlier version of this piece in RAM is superseded
            self._pieces.pop(part.key, None)
            self._ram.pop(part.key, None)

        def job() -> None:
            try:
                crc = crc32c(buffer.view[:nbytes])
                try:
                    write_file(path, buffer.view[:nbytes], tier_path.direct)
                except OSError as error:
                    kind = TierSpaceError if error.errno in (errno.ENOSPC, errno.EDQUOT) else TierError
                    raise kind(f"writing the staged gradient {path} ({part.key}) failed: {error.strerror}") from error
                with self._lock:
                    self._pieces[part.key] = _Piece(update, piece.dtype, piece.numel(), crc=crc)
            finally:
                buffers.release(buffer)

        return self._io.submit(job)

    def reader(self, order: Sequence[Partition], update: int) -> PieceReader:
        """Reads the staged pieces of ``order``'s partitions, in that order, ahead of need.
        Raises TierError when one has no piece for ``update``."""
        with self._lock:
            entries = [(p, self._pieces.get(p.key)) for p in order]
        found = [(p, piece) for p, piece in entries if piece is not None and piece.update == update]
        if len(found) < len(entries):
            missing = [str(p.key) for p, piece in entries if piece is None or piece.update != update]
            raise TierError(
                f"no gradient is staged for update {update} of {', '.join(missing[:3])}"
                + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
                + "; push it with defer_update first"
            )
        return PieceReader(self, found)

    def consumed(self, parts: Sequence[Partition], update: int) -> None:
        """Forget the pieces of ``update`` (applied); the resident ones' buffers stay for the
        next step while their partition is resident."""
        with self._lock:
            for part in parts:
                piece = self._pieces.get(part.key)
                if piece is not None and piece.update == update:
                    del self._pieces[part.key]
                if part.residency is not Residency.RAM:
                    self._ram.pop(part.key, None)

    @property
    def ram_bytes(self) -> int:
        """Memory the resident partitions' pieces and the piece buffers hold."""
        with self._lock:
            pieces = sum(buffer.nbytes for buffer in self._ram.values())
        return pieces + (self._buffers.allocated_bytes if self._buffers is not None else 0)

    # --- reading back (used by PieceReader) -------------------------------------------
    def _read(self, part: Partition, piece: _Piece, buffer: AlignedBuffer) -> None:
        assert self._nvme is not None
        path = gradient_file_of(part)
        nbytes = gradient_file_bytes(piece.numel, piece.dtype.itemsize)
        tier_path = self._nvme.paths[part.path_index]
        try:
            got = read_file_into(path, buffer.view[:nbytes], tier_path.direct)
        except FileNotFoundError as error:
            raise corrupt_error(path, part.key, "the staged gradient file is missing") from error
        except OSError as error:
            raise TierError(f"reading the staged gradient {path} ({part.key}) failed: {error.strerror}") from error
        if got != nbytes:
            raise corrupt_error(path, part.key, f"read {got} of {nbytes} staged gradient bytes (truncated)")
        if crc32c(buffer.view[:nbytes]) != piece.crc:
            raise corrupt_error(path, part.key, "staged gradient checksum mismatch; push the gradient again")


class PieceReader:
    """The staged pieces of one update's partitions, read from disk as far ahead as the
    piece buffers allow; each is used once, then released (:meth:`release`)."""

    def __init__(self, staged: StagedGradients, order: list[tuple[Partition, _Piece]]) -> None:
        self._staged = staged
        self._disk = [(part, piece) for part, piece in order if piece.ram is None]
        self._ram = {part.key: piece for part, piece in order if piece.ram is not None}
        self._reads: dict[PartitionKey, tuple[AlignedBuffer, Future[None], _Piece]] = {}
        self._issued = 0
        self._issue()

    def _read(self, block: bool) -> bool:
        """Start reading the next disk piece; False when no buffer is free (``block`` False)."""
        staged = self._staged
        assert staged._buffers is not None and staged._io is not None
        got = staged._buffers.acquire(None, block=block)
        if got is None:
            return False
        part, piece = self._disk[self._issued]
        buffer = got[0]
        self._reads[part.key] = (buffer, staged._io.submit(lambda: staged._read(part, piece, buffer)), piece)
        self._issued += 1
        return True

    def _issue(self) -> None:
        while self._issued < len(self._disk) and self._read(block=False):
            pass

    def take(self, part: Partition) -> tuple[torch.Tensor, bool]:
        """The piece of ``part`` (taken in the order given) and whether the caller may
        change it (a read buffer) or not (the RAM piece, which a retried update uses again)."""
        piece = self._ram.get(part.key)
        if piece is not None:
            assert piece.ram is not None
            return piece.ram, False
        while part.key not in self._reads:  # every buffer was busy when its turn came
            self._read(block=True)
        buffer, future, disk_piece = self._reads[part.key]
        future.result()
        nbytes = disk_piece.numel * disk_piece.dtype.itemsize
        return buffer.tensor[:nbytes].view(disk_piece.dtype), True

    def release(self, part: Partition) -> None:
        """Give back the read buffer of ``part`` (after its update) and read further ahead."""
        held = self._reads.pop(part.key, None)
        if held is not None:
            assert self._staged._buffers is not None
            held[1].exception()  # never hand back a buffer a read still fills
            self._staged._buffers.release(held[0])
            self._issue()

    def close(self) -> None:
        """Release every buffer still held (after a failure part-way)."""
        for key in list(self._reads):
            buffer, future, _ = self._reads.pop(key)
            future.exception()
            assert self._staged._buffers is not None
            self._staged._buffers.release(buffer)
