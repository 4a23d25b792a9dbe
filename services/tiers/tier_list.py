"""The tiers of one storage as an ordered list, fastest first (RAM; then NVMe files when a
RAM budget is set), and what works across them: building them from the config, placing a
new segment's partitions, and moving a partition from one tier to another. Nothing here
names a tier: what is particular to one is a property or method of its class
(:class:`~.tier.Tier`), so another tier is its class, its config and its place in the
list :func:`build_tiers` makes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future

import torch

from cargohold.cluster.schema.server import TierConfig
from cargohold.services.core.errors import TierError
from cargohold.services.tiers.fileformat import FileLayout, gradient_file_bytes
from cargohold.services.tiers.gradients import StagedGradients
from cargohold.services.tiers.io_pool import BufferPool, IoPool
from cargohold.services.tiers.nvme import PROBE_BYTES, NvmeTier, TierPath, probe_path
from cargohold.services.tiers.partitions import elements_per_partition
from cargohold.services.tiers.ram import RamTier
from cargohold.services.tiers.residency import PartitionKey, Residency
from cargohold.services.tiers.source import StateSource, source_piece
from cargohold.services.tiers.tier import Partition, Staged, Tier, TierObserver

logger = logging.getLogger(__name__)


class TierList:
    """A storage's tiers, fastest first, with what they share: the staged gradients kept
    beside their partitions and the I/O threads."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        gradients: StagedGradients,
        *,
        io: IoPool | None = None,
        staging_bytes: int = 0,
        buffer_count: int = 0,
    ) -> None:
        self.tiers = list(tiers)
        self.of: Mapping[Residency, Tier] = {tier.residency: tier for tier in self.tiers}
        """Each tier by its residency."""
        self.gradients = gradients
        self.staging_bytes = staging_bytes
        """Memory the tiers below RAM stream through (their staging buffers), paid from the budget."""
        self.buffer_count = buffer_count
        self._io = io

    @property
    def memory_bytes(self) -> int:
        """Memory held now: every tier's, and the staged gradients' kept in memory."""
        return sum(tier.memory_bytes for tier in self.tiers) + self.gradients.ram_bytes

    @property
    def paths(self) -> list[TierPath]:
        """Every disk path of every tier, in tier order."""
        return [path for tier in self.tiers for path in tier.paths]

    # --- registration -------------------------------------------------------------------
    def fill(
        self,
        parts: Sequence[Partition],
        source: StateSource,
        *,
        segment_id: int,
        gradient_itemsize: int,
        path_index: Mapping[PartitionKey, int],
    ) -> None:
        """Place a new segment's partitions, each in its planned tier or, where that has no
        room now, the next slower one with room (it moves in later), and write their first
        state from ``source``, a partition at a time. All or nothing: on any failure every
        partition is dropped again and the error raised."""
        run_id = parts[0].key.run_id
        what = f"segment {segment_id} of run {run_id!r}"
        for tier in self.tiers:
            tier.prepare(run_id, parts, path_index)
        placed: list[Partition] = []
        try:
            for part in parts:
                part.residency = self._reserve(part)
                placed.append(part)
            for tier in self.tiers:
                tier.check_room([p for p in parts if p.residency is tier.residency], gradient_itemsize, what)
            loads: list[Future[None]] = []
            try:
                for part in parts:
                    master, moments = source_piece(source, part, segment_id)
                    loads.append(self.of[part.residency].load(part, master, moments))
            finally:
                errors = [load.exception() for load in loads]  # waits for every write
            first = next((e for e in errors if e is not None), None)
            if first is not None:
                raise first
        except BaseException:
            for part in placed:
                self.of[part.residency].drop(part)
            raise

    def _reserve(self, part: Partition) -> Residency:
        """The first tier, from the planned one down, with room for ``part`` now."""
        start = self.tiers.index(self.of[part.planned])
        for tier in self.tiers[start:]:
            if tier.reserve(part):
                return tier.residency
        raise TierError(f"no tier has room for {part.key}")  # pragma: no cover - the last has no limit

    # --- moves between tiers ------------------------------------------------------------
    def stage_now(self, tier: Tier, part: Partition) -> Staged:
        """``part`` staged from ``tier`` and read in (waiting for a buffer and the read);
        raises the read's error with the staging released."""
        staged = tier.stage(part, block=True)
        assert staged is not None, "stage(block=True) waits for a buffer"
        try:
            staged.ready.result()
        except BaseException:
            tier.discard(staged, intact=False)
            raise
        return staged

    def move(self, part: Partition, staged: Staged, update: int) -> Future[None] | None:
        """Move ``part``, staged from its tier and holding the state after ``update``, into
        the tier the plan wants it in; None, with nothing changed, when that tier has no
        room now. Once the future completes without error the partition is kept after
        ``update``: in the new tier (its old one has let it go) or, where the new tier
        could not keep it (a failed write, logged), committed where it was."""
        source, target = self.of[part.residency], self.of[part.planned]
        arriving = target.receive(part, staged, update)
        if arriving is None:
            return None
        moved: Future[None] = Future()

        def arrived(done: Future[None]) -> None:
            error = done.exception()
            if error is None:
                part.residency = target.residency
                part.updates = update
                source.discard(staged, intact=False)
                source.drop(part)
                self.gradients.left_ram(part.key)
                moved.set_result(None)
                return
            logger.warning("could not move %s to the %s tier: %s", part.key, target.residency.value, error)
            _forward(kept_after(part, source.commit(staged, update), update), moved)

        arriving.add_done_callback(arrived)
        return moved

    def close(self) -> None:
        """Stop the I/O threads, then let each tier delete what it keeps outside this process."""
        if self._io is not None:
            self._io.shutdown()
        for tier in self.tiers:
            tier.close()


def build_tiers(
    config: TierConfig, *, server_index: int, observer: TierObserver, device: torch.device | None
) -> TierList:
    """The tiers ``config`` asks for, fastest first: RAM alone without a budget (on
    ``device`` if given), else RAM with the budget less the staging buffers, then NVMe."""
    budget = config.ram_budget_bytes
    if budget is None:
        return TierList([RamTier(None, device)], StagedGradients(None, None, None, device=device))
    max_elements = elements_per_partition(config.partition_size())
    # A staging buffer holds a partition in its file layout and, after it, the
    # partition's staged gradient (fp32 at most): read in with the state.
    buffer_bytes = FileLayout(max_elements).file_bytes + gradient_file_bytes(max_elements, 4)
    staging_bytes = config.staging_bytes()
    ram = RamTier(budget - staging_bytes)
    paths = [probe_path(p, config.direct_io, min(PROBE_BYTES, buffer_bytes)) for p in config.nvme_paths]
    io = IoPool(config.io_threads, observer)
    buffers = BufferPool(config.buffer_count, buffer_bytes)
    nvme = NvmeTier(paths, server_index=server_index, io=io, buffers=buffers, observer=observer)
    tiers: list[Tier] = [ram, nvme]
    in_files = [tier.residency for tier in tiers if tier.keeps_files]
    gradients = StagedGradients(nvme, io, buffers, observer, in_files=in_files)
    return TierList(tiers, gradients, io=io, staging_bytes=staging_bytes, buffer_count=config.buffer_count)


def kept_after(part: Partition, future: Future[None], update: int) -> Future[None]:
    """``future`` (a tier keeping ``part``), and once it succeeds ``part`` is after ``update``."""

    def kept(error: BaseException | None) -> None:
        if error is None:
            part.updates = update

    return then(future, kept)


def then(future: Future[None], callback: Callable[[BaseException | None], None]) -> Future[None]:
    """A future that completes after ``callback`` has seen the outcome of ``future`` (a done
    callback alone could run after a waiter of ``future`` has woken)."""
    chained: Future[None] = Future()

    def settle(done: Future[None]) -> None:
        error = done.exception()
        try:
            callback(error)
        except BaseException as failure:  # pragma: no cover - bookkeeping bug
            chained.set_exception(failure)
            return
        if error is not None:
            chained.set_exception(error)
        else:
            chained.set_result(None)

    future.add_done_callback(settle)
    return chained


def _forward(source: Future[None], target: Future[None]) -> None:
    """Complete ``target`` as ``source`` completes."""

    def copy(done: Future[None]) -> None:
        error = done.exception()
        if error is not None:
            target.set_exception(error)
        else:
            target.set_result(None)

    source.add_done_callback(copy)
