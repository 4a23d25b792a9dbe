"""A state server's side of checkpoints: put its segments' state into a checkpoint's
partial directory as partition files (the one payload format,
:mod:`cargohold.services.tiers.fileformat`), and restore segments from a complete
checkpoint — cut the way the new layout needs, whatever layout wrote it.

``begin`` holds each segment still for a moment while its tiers preserve every partition
(:meth:`~cargohold.services.tiers.storage.TieredStorage.preserve`), then returns; a
background thread does the rest while training goes on:

* a partition file on the NVMe tier is hard-linked into the checkpoint (no bytes move;
  where the checkpoint is on another filesystem and a link is refused, the thread copies
  it from a descriptor opened at ``begin``, so it holds that step's version);
* a partition in RAM is written by the thread: all in RAM (no budget), from a copy taken
  at ``begin`` (the stall); under a RAM budget, where a copy would break it, in place,
  and the partition's next update waits until it has been written (the only stall: when
  training reaches it first).

Payload files are named ``server<i>-shard<segment>-part<index>.tier`` (``worker<w>-...``
for a worker's device segments); all in RAM a segment is one partition (index 0).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

from cargohold.services.checkpoint.errors import free_space_hint
from cargohold.services.checkpoint.manifest import FileRecord, Manifest, SegmentRecord
from cargohold.services.checkpoint.reader import CheckpointReader
from cargohold.services.checkpoint.reshard import Run
from cargohold.services.core.durable import fsync_directory, fsync_file
from cargohold.services.core.errors import CheckpointError, TierError
from cargohold.services.core.segment_spec import SegmentSpec
from cargohold.services.segments.segment_registry import SegmentRegistry
from cargohold.services.segments.segment_state import SegmentState
from cargohold.services.tiers.fileformat import ARRAYS
from cargohold.services.tiers.preserve import PendingWrite, PreservedPartition
from cargohold.services.tiers.residency import PartitionKey

logger = logging.getLogger(__name__)

Records = list[tuple[SegmentRecord, FileRecord]]


class SegmentCheckpointer:
    """Saves and restores the segments of one state server's registry."""

    def __init__(self, registry: SegmentRegistry, owner: str) -> None:
        """``owner``: what holds ``registry`` ("server0", or "worker1" for a worker's device
        segments): the first word of its payload files' names, unique in a checkpoint."""
        self._registry = registry
        self._owner = owner
        self._thread: threading.Thread | None = None
        self._result: Records | BaseException | None = None
        self.preserved: dict[str, int] = {}
        """Partition files of the last checkpoint by how they got there ("linked",
        "copied", "written"), for stats and tests."""
        self.linked_bytes = 0
        """Bytes of the last checkpoint's files that are hard links (nothing written)."""

    def begin(self, run_id: str, directory: str, step: int) -> int:
        """Start putting every segment of ``run_id`` into ``directory`` as of data step
        ``step``; returns the update count they are at (lower than ``step`` when steps
        were skipped). A failure, here or in the background, is raised by :meth:`wait`."""
        if self._thread is not None:
            raise CheckpointError("a checkpoint is still being written; wait for it first")
        segments = self._registry.segments(run_id)
        updates = {s.updates for s in segments}
        if len(updates) > 1:
            raise CheckpointError(f"segments of run {run_id!r} are at different updates {sorted(updates)}")
        update = updates.pop() if updates else 0
        self._result = None
        self.preserved, self.linked_bytes = {}, 0
        self._preserve(directory, step, update, segments)
        return update

    def wait(self) -> Records:
        """The records of the files written by the last ``begin``; raises its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        result, self._result = self._result, None
        if isinstance(result, BaseException):
            raise result
        if result is None:
            raise CheckpointError("no checkpoint was begun")
        return result

    def _background(self, work: Callable[[], Records]) -> None:
        def run() -> None:
            try:
                self._result = work()
            except BaseException as error:  # handed to wait(), which raises it in the caller
                self._result = error

        self._thread = threading.Thread(target=run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def _name_of(self, key: PartitionKey) -> str:
        return f"{self._owner}-shard{key.segment_id:06d}-part{key.index:05d}.tier"

    def _preserve(self, directory: str, step: int, update: int, segments: list[SegmentState]) -> None:
        """Link every disk partition file of the segments at ``update`` now; write the RAM
        partitions (first: an update may wait for them) and copy what could not be linked
        in the background."""
        preserved: list[tuple[SegmentState, PreservedPartition]] = []
        try:
            for segment in segments:
                held, parts = segment.preserve(directory, self._name_of)
                preserved += [(segment, part) for part in parts]
                if held != update:
                    raise TierError(
                        f"segment {segment.spec.segment_id} moved to update {held} while checkpointing "
                        f"update {update}; a push arrived during the save"
                    )
        except (OSError, TierError) as error:
            _cancel(part for _, part in preserved)
            self._result = _save_error(directory, error)
            return
        self.preserved = {how: sum(part.how == how for _, part in preserved) for how in ("linked", "copied", "written")}
        self.linked_bytes = sum(part.nbytes for _, part in preserved if part.how == "linked")
        logger.info(
            "checkpoint of step %d: %d partition files linked, %d to copy, %d to write from RAM",
            step,
            self.preserved["linked"],
            self.preserved["copied"],
            self.preserved["written"],
        )
        jobs = sorted(
            ((part, part.pending) for _, part in preserved if part.pending is not None),
            key=lambda job: not isinstance(job[1], PendingWrite),
        )

        def finish() -> Records:
            checksums = {}
            try:  # each job's OSError names its file
                for part, pending in jobs:
                    if isinstance(pending, PendingWrite):
                        checksums[part.name] = pending.run().checksum()
                    else:
                        pending.run()
                for _, part in preserved:  # the tier wrote them without fsync (O_DIRECT)
                    if part.how == "linked":
                        fsync_file(os.path.join(directory, part.name))
                fsync_directory(directory)
            except OSError as error:
                raise _save_error(directory, error) from error
            finally:
                _cancel(part for part, _ in jobs)  # whatever did not run: release the partitions waiting on it
            return [
                (
                    SegmentRecord(
                        segment_id=segment.spec.segment_id,
                        start=segment.spec.start + part.start,
                        stop=segment.spec.start + part.stop,
                        step=step,
                        file=part.name,
                    ),
                    FileRecord(name=part.name, nbytes=part.nbytes, crc32c=_checksum_of(part, checksums)),
                )
                for segment, part in preserved
            ]

        if jobs:
            self._background(finish)
        else:
            self._result = finish()

    def restore(
        self, directory: str, manifest: Manifest, segments: Sequence[tuple[SegmentSpec, Sequence[Run]]]
    ) -> None:
        """Register each spec with the state the checkpoint holds for it, at its update
        count (``manifest.updates``): its ``runs``
        (:func:`~cargohold.services.checkpoint.reshard.segment_runs`) say which saved flat elements
        fill which of its elements; the rest (padding) is zero. Read a partition at a
        time, so a restore stays within the tiers' memory."""
        reader = CheckpointReader(Path(directory), manifest)
        scratch: dict[str, torch.Tensor] = {}
        for spec, runs in segments:
            ordered = sorted(runs)
            for offset, _, length in ordered:
                if offset < 0 or length <= 0 or offset + length > spec.numel:
                    raise CheckpointError(
                        f"restoring segment {spec.segment_id}: the run of {length} elements at "
                        f"{offset} leaves its {spec.numel} elements"
                    )
            ends = [offset + length for offset, _, length in ordered]

            def source(
                lo: int, hi: int, ordered: list[Run] = ordered, ends: list[int] = ends, spec: SegmentSpec = spec
            ):
                # the tiers copy each piece before asking for the next: one scratch serves all
                if not scratch or scratch["master"].numel() < hi - lo:
                    scratch.update({k: torch.empty(hi - lo, dtype=torch.float32) for k in ARRAYS})
                overlapping = list(itertools.takewhile(lambda r: r[0] < hi, ordered[bisect.bisect_right(ends, lo) :]))
                if spec.state_dtype != "float32" and all(
                    flat - offset == spec.start for offset, flat, _ in overlapping
                ):
                    # Every element is where it was saved (a resume on the same layout): the
                    # moments as stored, bitwise, when a file of this kind holds the piece
                    # on its block grid; decoded and encoded again otherwise.
                    stored = reader.read_stored(spec.start + lo, spec.start + hi, spec.state_dtype)
                    if stored is not None:
                        return stored[0], (stored[1], stored[2])
                piece = {k: v[: hi - lo].zero_() for k, v in scratch.items()}
                for offset, flat, length in overlapping:
                    first, stop = max(lo, offset), min(hi, offset + length)
                    reader.read(
                        flat + first - offset,
                        flat + stop - offset,
                        out={k: v[first - lo : stop - lo] for k, v in piece.items()},
                    )
                return piece["master"], (piece["exp_avg"], piece["exp_avg_sq"])

            self._registry.restore(spec, source, manifest.updates)


def _checksum_of(part: PreservedPartition, written: dict[str, int]) -> int:
    """The file's header checksum: as written now, or as the tier recorded it (a linked or
    copied file)."""
    checksum = written.get(part.name, part.checksum)
    if checksum is None:
        raise CheckpointError(f"no checksum is known for the partition file {part.name}")
    return checksum


def _cancel(parts: Iterable[PreservedPartition]) -> None:
    for part in parts:
        if part.pending is not None:
            part.pending.cancel()


def _save_error(directory: str, error: BaseException) -> CheckpointError:
    if isinstance(error, OSError):
        where = f" ({error.filename})" if error.filename else ""
        reason = f"{error.strerror or error}{where}{free_space_hint(error)}"
    else:
        reason = str(error)
    return CheckpointError(f"saving the partitions into {directory} failed: {reason}")
