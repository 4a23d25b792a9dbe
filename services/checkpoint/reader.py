"""Reading flat ranges of a checkpoint's state, however the saving servers cut the flat
space into payload files: a file covers a flat range ``[start, stop)``, and
:class:`CheckpointReader` assembles any other range from whichever files cover it.

What a range reads is refused, naming the file and segment, unless every master weight,
moment and 8-bit block scale in it is finite. The checksums cannot tell: a file whose
values were edited and every checksum recomputed, or one saved by a run that applied
non-finite updates (``optim.nonfinite: ignore``), passes them, and a resume from it would
put NaN into the next checkpoint. The check reads what the range read, a partition at a
time, with no copy (a min and max; a mask only to name the first bad element).
"""

from __future__ import annotations

import bisect
import itertools
import math
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from cargohold.services.checkpoint.errors import corrupt
from cargohold.services.checkpoint.manifest import Manifest, SegmentRecord, gaps, is_int
from cargohold.services.checkpoint.payload import CHUNK, Payload, open_sized, read_into, read_stored, verify
from cargohold.services.core.errors import CheckpointError
from cargohold.services.core.state_precision import BLOCK_ELEMENTS, StateDtype, StoredMoment
from cargohold.services.tiers.fileformat import ARRAYS


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
        self._segments = sorted(manifest.segments, key=lambda s: s.start)
        self._stops = [s.stop for s in self._segments]
        self._verified: dict[str, Payload] = {}
        self._buffer = memoryview(bytearray(CHUNK))

    def read(self, start: int, stop: int, out: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """master/exp_avg/exp_avg_sq of flat elements ``[start, stop)``: new tensors, or
        views of the first ``stop - start`` elements of ``out``'s fp32 tensors (scratch
        reused across calls, so a long restore allocates nothing per partition).

        The range must lie inside the checkpoint's ``[0, total)`` and every element of it
        be covered by a segment, else CheckpointError names the range or the gap.
        """
        manifest = self.manifest
        if not (is_int(start) and is_int(stop) and 0 <= start <= stop <= manifest.total):
            raise CheckpointError(
                f"flat range [{start}, {stop}) is not a range inside checkpoint {self.directory}'s "
                f"[0, {manifest.total})"
            )
        # segments are sorted and do not overlap: the first that may overlap ends past start
        segments = self._segments[bisect.bisect_right(self._stops, start) :]
        segments = list(itertools.takewhile(lambda s: s.start < stop, segments))
        missing = gaps(segments, start, stop)
        if missing:
            lo, hi = missing[0]
            raise CheckpointError(
                f"checkpoint {self.directory} (step {manifest.step}) holds no file for flat elements "
                f"[{lo}, {hi}) of the requested [{start}, {stop})"
            )
        if out is None:
            out = {name: torch.empty(stop - start, dtype=torch.float32) for name in ARRAYS}
        else:
            out = {name: out[name][: stop - start] for name in ARRAYS}
        for segment in segments:
            lo, hi = max(segment.start, start), min(segment.stop, stop)
            path = self.directory / segment.file
            fd, size = open_sized(path, self._records[segment.file])
            try:
                payload = self._verified.get(segment.file) or self._verify(fd, path, size, segment)
                read_into(fd, payload, lo, hi, out, lo - start)
            finally:
                os.close(fd)
            for name in ARRAYS:
                _refuse_unusable(path, segment.segment_id, name, out[name][lo - start : hi - start], lo)
        return out

    def read_stored(
        self, start: int, stop: int, dtype: StateDtype
    ) -> tuple[torch.Tensor, StoredMoment, StoredMoment] | None:
        """master (fp32) and the moments of flat elements ``[start, stop)`` as the file
        stores them, for a restore into the same ``optim.state_dtype`` that keeps their
        bits (a decoded and re-encoded 8-bit block may differ). None where that cannot
        be: the file stores another kind, or the range is not inside one file, starting
        on its block grid and ending on it or at the file's end."""
        if dtype == "float32" or start >= stop:
            return None
        at = bisect.bisect_right(self._stops, start)
        if at >= len(self._segments):
            return None
        segment = self._segments[at]
        first = start - segment.start
        if not (segment.start <= start and stop <= segment.stop):
            return None
        if dtype == "blockwise8" and (
            first % BLOCK_ELEMENTS or ((stop - segment.start) % BLOCK_ELEMENTS and stop != segment.stop)
        ):
            return None
        path = self.directory / segment.file
        fd, size = open_sized(path, self._records[segment.file])
        try:
            payload = self._verified.get(segment.file) or self._verify(fd, path, size, segment)
            if payload.layout.dtype != dtype:
                return None
            master = torch.empty(stop - start, dtype=torch.float32)
            read_into(fd, payload, start, stop, {"master": master}, 0, arrays=1)
            moments = [read_stored(fd, payload, index, first, stop - segment.start) for index in (1, 2)]
        finally:
            os.close(fd)
        _refuse_unusable(path, segment.segment_id, "master", master, start)
        for moment in moments:
            if moment.values.is_floating_point():  # 8-bit codes are any byte; their scales are checked
                _refuse_unusable(path, segment.segment_id, moment.moment, moment.values, start)
            _refuse_unusable(
                path, segment.segment_id, f"{moment.moment} block scale", moment.scales, start, blocks=True
            )
        return master, moments[0], moments[1]

    def _verify(self, fd: int, path: Path, size: int, segment: SegmentRecord) -> Payload:
        payload = verify(fd, path, size, self._records[segment.file], segment, self.manifest, self._buffer)
        self._verified[segment.file] = payload
        return payload


def _refuse_unusable(
    path: Path, segment_id: int, name: str, values: torch.Tensor, first: int, *, blocks: bool = False
) -> None:
    """Refuse ``values`` of array ``name`` (from flat element ``first``; with ``blocks``,
    the scales of 8-bit blocks from there) unless every one is finite. Raises
    CorruptCheckpointError naming the file."""
    if not len(values):
        return
    least, greatest = (float(bound) for bound in torch.aminmax(values))  # NaN if any is: no mask unless bad
    if math.isfinite(least) and math.isfinite(greatest):
        return
    index = int((~torch.isfinite(values)).nonzero()[0, 0])
    where = f"flat element {first + index}"
    if blocks:
        where = f"the block from flat element {first + index * BLOCK_ELEMENTS}"
    raise corrupt(
        path,
        f"{name} of segment {segment_id} holds {float(values[index])} at {where}, from which training cannot "
        "go on (its checksums match: values edited with them recomputed, or saved by a run that applied "
        "non-finite updates with optim.nonfinite=ignore); resume from an earlier checkpoint",
    )


def read_flat_range(directory: Path, manifest: Manifest, start: int, stop: int) -> dict[str, torch.Tensor]:
    """:meth:`CheckpointReader.read` of one range (each file is verified once)."""
    return CheckpointReader(directory, manifest).read(start, stop)
