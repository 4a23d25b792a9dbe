"""The weight window's bookkeeping, without I/O: in which order a micro-batch uses the
units' weights, which units are in memory, and which to read or free next. The worker's
:class:`~cargohold.services.worker.weight_window.WeightWindow` moves the bytes; the plan replays
the same schedule to count what a step reads (:func:`reads_per_micro_batch`).

A micro-batch's uses are laid out as entries: every unit forward, then every unit FSDP2
gathers again for backward, in reverse. Entries are taken in order
while fewer than ``window`` units are in memory (a unit already in memory is taken at
no cost, it just gains a use); taking an entry whose unit is not in memory starts a
read. A unit is freed when its last taken use is released. An entry can be taken out of
turn (``ensure``), beyond the window: the hooks ask for what FSDP2 is about to gather,
and correctness never waits on the window's reach.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from cargohold.services.core.errors import TrainingError

FORWARD, BACKWARD = "forward", "backward"
Entry = tuple[str, int]
"""(pass, the unit's index in the layout) of one gather."""


def pass_entries(units: Sequence[int], *, backward: Collection[int]) -> list[Entry]:
    """The gathers of one micro-batch, in order; ``backward``: the units FSDP2 gathers
    again for their backward (none in a pass without backward)."""
    return [(FORWARD, u) for u in units] + [(BACKWARD, u) for u in reversed(units) if u in backward]


class WindowSchedule:
    """Which units are in memory, and the uses taken of each."""

    def __init__(self, window: int) -> None:
        if window < 2:
            raise TrainingError(f"tuning.worker.weight_window must be >= 2, got {window}")
        self.window = window
        self._entries: list[Entry] = []
        self._position: dict[Entry, int] = {}
        self._cursor = 0
        self._uses: dict[int, int] = {}

    @property
    def resident(self) -> frozenset[int]:
        """Units in memory (or being read)."""
        return frozenset(self._uses)

    def reset(self) -> frozenset[int]:
        """Forget every use and pass; returns the units that were in memory, to free."""
        resident = self.resident
        self._entries, self._position, self._cursor, self._uses = [], {}, 0, {}
        return resident

    def begin(self, entries: list[Entry]) -> list[int]:
        """Lay out a pass; returns the units to read now. Nothing may be in memory."""
        if self._uses:
            raise TrainingError(f"units {sorted(self._uses)} are still in memory at the start of a pass")
        self._entries, self._cursor = entries, 0
        self._position = {entry: index for index, entry in enumerate(entries)}
        return self._fill()

    def ensure(self, entry: Entry) -> list[int]:
        """Take every entry up to ``entry`` (beyond the window if need be); returns the units
        to read. Raises for an entry outside the pass or whose use was already released."""
        index = self._position.get(entry)
        if index is None:
            raise TrainingError(f"unit {entry[1]} was used in {entry[0]} outside the laid-out passes")
        reads = []
        while self._cursor <= index:
            reads += self._take()
        if entry[1] not in self._uses:
            raise TrainingError(f"unit {entry[1]} was used in {entry[0]} after its use was released")
        return reads

    def release(self, entry: Entry) -> tuple[int | None, list[int]]:
        """The entry's gather is done: (the unit to free, or None while another taken use
        needs it; the units to read into the room made)."""
        unit = entry[1]
        if self._uses.get(unit, 0) == 0:
            return None, []
        self._uses[unit] -= 1
        if self._uses[unit]:
            return None, []
        del self._uses[unit]
        return unit, self._fill()

    def _fill(self) -> list[int]:
        reads = []
        while self._cursor < len(self._entries):
            unit = self._entries[self._cursor][1]
            if unit not in self._uses and len(self._uses) >= self.window:
                break
            reads += self._take()
        return reads

    def _take(self) -> list[int]:
        unit = self._entries[self._cursor][1]
        self._cursor += 1
        first = unit not in self._uses
        self._uses[unit] = self._uses.get(unit, 0) + 1
        return [unit] if first else []


def reads_per_micro_batch(units: Sequence[int], *, window: int, backward: Collection[int]) -> list[int]:
    """The units read in one training micro-batch (with multiplicity), as the worker's
    hooks drive the schedule: each unit's forward takes its entry and releases it after;
    after the root's forward the last unit's backward entry is taken (FSDP2's root
    pre-backward gathers it) where it has one; each unit's backward takes its entry and
    the previous unit's (gathered ahead by FSDP2), those of them gathered again for
    backward (``backward``), and releases its own once its gradients are reduced."""
    schedule = WindowSchedule(window)
    reads = schedule.begin(pass_entries(units, backward=backward))
    for unit in units:
        reads += schedule.ensure((FORWARD, unit))
        reads += schedule.release((FORWARD, unit))[1]
    if units and units[-1] in backward:
        reads += schedule.ensure((BACKWARD, units[-1]))
    for index in range(len(units) - 1, -1, -1):
        unit, previous = units[index], units[index - 1] if index else None
        if unit in backward:
            reads += schedule.ensure((BACKWARD, unit))
        if previous is not None and previous in backward:
            reads += schedule.ensure((BACKWARD, previous))
        if unit in backward:
            reads += schedule.release((BACKWARD, unit))[1]
    return reads
