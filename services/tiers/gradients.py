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

import threading
import time
from collections.abc import Collection, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from cargohold.services.core.checksum import crc32c
from cargohold.services.core.errors import TierError, TierSpaceError
from cargohold.services.tiers.fileformat import corrupt_error, gradient_file_bytes
from cargohold.services.tiers.io_pool import AlignedBuffer, BufferPool, IoPool
from cargohold.services.tiers.nvme import SPACE_ERRNOS, NvmeTier
from cargohold.services.tiers.residency import PartitionKey, Residency
from cargohold.services.tiers.tier import NullObserver, Partition, Staged, StagingTier, TierObserver

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

    def __init__(
        self,
        nvme: NvmeTier | None,
        io: IoPool | None,
        buffers: BufferPool | None,
        observer: TierObserver | None = None,
        device: torch.device | None = None,
        *,
        in_files: Collection[Residency] = (),
    ) -> None:
        """``device``: where the pieces kept in memory are (host memory when None).
        ``in_files``: the tiers that keep files (:attr:`.tier.Tier.keeps_files`), whose
        partitions' pieces go to a file beside theirs; the others' stay in memory."""
        self._nvme = nvme
        self._in_files = frozenset(in_files) if nvme is not None else frozenset()
        self._device = device
        self._observer = observer or NullObserver()
        """Where the files' reads and writes are counted, with the state's."""
        self._io = io
        self._buffers = buffers
        """The NVMe tier's staging buffers (each with room for a piece after the state): a
        piece is written to its file through one."""
        self._lock = threading.Lock()
        self._pieces: dict[PartitionKey, _Piece] = {}
        self._ram: dict[PartitionKey, tuple[AlignedBuffer, torch.Tensor]] = {}
        """Each resident partition's piece buffer (4 KiB aligned, as the plan counts it)
        and the piece's view of it, kept from step to step: the budget pays for it, and a
        fresh allocation's page faults would cost as much as the copy."""

    def stage(self, parts: Sequence[Partition], update: int, gradient: torch.Tensor) -> None:
        """Keep ``gradient``'s piece of each partition in ``parts`` for ``update``: resident
        partitions' in RAM, the others' in their files. Returns once every piece is kept, so
        the caller may reuse ``gradient``. Raises TierError (a failed write) with the pieces
        already kept still staged; staging again replaces them."""
        writes: list[Future[None]] = []
        try:
            for part in parts:
                piece = gradient[part.span.start : part.span.stop]
                if part.residency not in self._in_files:
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
        with self._lock:
            kept = self._ram.get(key)
        if kept is None or kept[1].dtype != piece.dtype or kept[1].numel() != piece.numel():
            buffer = AlignedBuffer(gradient_file_bytes(piece.numel(), piece.element_size()), self._device)
            kept = (buffer, buffer.tensor[: piece.numel() * piece.element_size()].view(piece.dtype))
        kept[1].copy_(piece)
        with self._lock:
            self._ram[key] = kept
            self._pieces[key] = _Piece(update, piece.dtype, piece.numel(), ram=kept[1])

    def _stage_on_disk(self, part: Partition, update: int, piece: torch.Tensor) -> Future[None]:
        assert self._nvme is not None and self._io is not None and self._buffers is not None
        nvme, buffers = self._nvme, self._buffers
        nbytes = gradient_file_bytes(piece.numel(), piece.element_size())
        buffer, _ = buffers.acquire(None, block=True)
        data = buffer.tensor[: piece.numel() * piece.element_size()]
        data.copy_(piece.contiguous().view(torch.uint8))
        buffer.tensor[data.numel() : nbytes].zero_()
        path = gradient_file_of(part)
        with self._lock:  # an earlier version of this piece in RAM is superseded
            self._pieces.pop(part.key, None)
            self._ram.pop(part.key, None)

        def job() -> None:
            try:
                crc = crc32c(buffer.view[:nbytes])
                started = time.perf_counter()
                try:
                    nvme.paths[part.path_index].write_whole(path, buffer.view[:nbytes])
                except OSError as error:
                    kind = TierSpaceError if error.errno in SPACE_ERRNOS else TierError
                    raise kind(f"writing the staged gradient {path} ({part.key}) failed: {error.strerror}") from error
                self._observer.record_tier_io("write", nbytes, time.perf_counter() - started)
                with self._lock:
                    self._pieces[part.key] = _Piece(update, piece.dtype, piece.numel(), crc=crc)
            finally:
                buffers.release(buffer)

        return self._io.submit(job)

    def pieces(self, parts: Sequence[Partition], update: int) -> GradientReads:
        """The staged pieces of ``parts`` for the update that applies them; raises TierError
        when one has no piece for ``update``."""
        with self._lock:
            entries = [(p, self._pieces.get(p.key)) for p in parts]
        found = {p.key: piece for p, piece in entries if piece is not None and piece.update == update}
        if len(found) < len(entries):
            missing = [str(p.key) for p, _ in entries if p.key not in found]
            raise TierError(
                f"no gradient is staged for update {update} of {', '.join(missing[:3])}"
                + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
                + "; push it with defer_update first"
            )
        return GradientReads(self, found)

    def consumed(self, parts: Sequence[Partition], update: int) -> None:
        """Forget the pieces of ``update`` (applied); the resident ones' buffers stay for the
        next step while their partition is resident."""
        with self._lock:
            for part in parts:
                piece = self._pieces.get(part.key)
                if piece is not None and piece.update == update:
                    del self._pieces[part.key]
                if part.residency in self._in_files:
                    self._ram.pop(part.key, None)

    def holds(self, key: PartitionKey) -> bool:
        """Whether a gradient is staged for the partition and not yet consumed."""
        with self._lock:
            return key in self._pieces

    def left_ram(self, key: PartitionKey) -> None:
        """Free the piece buffer kept for a partition that is no longer resident."""
        with self._lock:
            self._ram.pop(key, None)

    @property
    def ram_bytes(self) -> int:
        """Memory the resident partitions' pieces hold."""
        with self._lock:
            return sum(buffer.nbytes for buffer, _ in self._ram.values())

    # --- reading back -------------------------------------------------------------------
    def read_later(self, part: Partition, piece: _Piece, view: memoryview) -> Future[None]:
        """:meth:`read` on the tier's I/O threads."""
        assert self._io is not None, "a piece on disk without a disk tier"
        return self._io.submit(lambda: self.read(part, piece, view))

    def read(self, part: Partition, piece: _Piece, view: memoryview) -> None:
        """Read ``part``'s piece from its file into ``view`` (page aligned) and check it."""
        assert self._nvme is not None
        path = gradient_file_of(part)
        nbytes = gradient_file_bytes(piece.numel, piece.dtype.itemsize)
        started = time.perf_counter()
        try:
            got = self._nvme.paths[part.path_index].read_into(path, view[:nbytes])
        except FileNotFoundError as error:
            raise corrupt_error(path, part.key, "the staged gradient file is missing") from error
        except OSError as error:
            raise TierError(f"reading the staged gradient {path} ({part.key}) failed: {error.strerror}") from error
        if got != nbytes:
            raise corrupt_error(path, part.key, f"read {got} of {nbytes} staged gradient bytes (truncated)")
        if crc32c(view[:nbytes]) != piece.crc:
            raise corrupt_error(path, part.key, "staged gradient checksum mismatch; push the gradient again")
        self._observer.record_tier_io("read", nbytes, time.perf_counter() - started)


class GradientReads:
    """One update's staged pieces. A disk partition's piece is read into the tail of the
    staging buffer its state is read into, in the same prefetch (:meth:`stage`, wrapping
    the NVMe tier's): no buffer is ever held for a piece apart from its partition's, so a
    stream waiting for a staging buffer holds nothing another one waits for."""

    def __init__(self, staged: StagedGradients, pieces: dict[PartitionKey, _Piece]) -> None:
        self._staged = staged
        self._pieces = pieces
        self._views: dict[PartitionKey, torch.Tensor] = {}
        """Pieces read into their partition's staging buffer, until taken."""

    def stage(self, tier: StagingTier, partition: Partition, *, block: bool) -> Staged | None:
        """``tier.stage``, with the partition's piece read beside its state."""
        staged = tier.stage(partition, block=block)
        piece = self._pieces[partition.key]
        if staged is None or piece.ram is not None:
            return staged
        assert isinstance(staged.handle, AlignedBuffer)
        offset = partition.layout.file_bytes
        read = self._staged.read_later(partition, piece, staged.handle.view[offset:])
        nbytes = piece.numel * piece.dtype.itemsize
        self._views[partition.key] = staged.handle.tensor[offset : offset + nbytes].view(piece.dtype)
        staged.ready = _both(staged.ready, read)
        return staged

    def take(self, part: Partition) -> tuple[torch.Tensor, bool]:
        """The piece of ``part``, once its staging is ready, and whether the caller may
        change it (a staging buffer's copy) or not (a RAM piece, which a retried update
        uses again)."""
        piece = self._pieces[part.key]
        if piece.ram is not None:
            return piece.ram, False
        view = self._views.pop(part.key, None)
        if view is None:  # a resident partition whose piece went to disk: read it on its own
            buffer = AlignedBuffer(gradient_file_bytes(piece.numel, piece.dtype.itemsize))
            self._staged.read(part, piece, buffer.view)
            view = buffer.tensor[: piece.numel * piece.dtype.itemsize].view(piece.dtype)
        return view, True


class WithGradients:
    """A tier that keeps files as an update that applies staged gradients streams it: each
    partition's piece is read with its state (:meth:`GradientReads.stage`)."""

    def __init__(self, tier: StagingTier, reads: GradientReads) -> None:
        self._tier = tier
        self._reads = reads

    @property
    def keeps_files(self) -> bool:
        return self._tier.keeps_files

    def stage(self, partition: Partition, *, block: bool) -> Staged | None:
        return self._reads.stage(self._tier, partition, block=block)

    def commit(self, staged: Staged, update: int) -> Future[None]:
        return self._tier.commit(staged, update)

    def discard(self, staged: Staged, *, intact: bool) -> None:
        self._tier.discard(staged, intact=intact)


def _both(first: Future[None], second: Future[None]) -> Future[None]:
    """A future done when both are, failing with the first error of the two."""
    done: Future[None] = Future()
    remaining = [2]
    lock = threading.Lock()

    def settle(_: Future[None]) -> None:
        with lock:
            remaining[0] -= 1
            if remaining[0]:
                return
        error = first.exception() or second.exception()
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(None)

    first.add_done_callback(settle)
    second.add_done_callback(settle)
    return done
