"""Which gradient buckets backward has finished, so they can be reduced and shipped
while backward computes the rest. Pure bookkeeping over a ShardLayout."""

from __future__ import annotations

import threading

from cargohold.services.layout import ShardLayout


class BucketReadiness:
    """Counts, per bucket, the parameters whose gradients are still to come."""

    def __init__(self, layout: ShardLayout) -> None:
        self._buckets_of_param: list[tuple[int, ...]] = []
        totals = [0] * len(layout.buckets)
        for slot in layout.params:
            lo, hi = slot.offset, slot.offset + slot.numel
            mine = tuple(b.index for b in layout.buckets if slot.numel and b.start < hi and lo < b.stop)
            self._buckets_of_param.append(mine)
            for index in mine:
                totals[index] += 1
        self._totals = totals
        self._lock = threading.Lock()
        self._pending: list[int] = []
        self._released: list[bool] = []
        self.reset()

    def reset(self) -> None:
        """Start a new step: every bucket waits for all of its parameters again."""
        with self._lock:
            self._pending = list(self._totals)
            self._released = [False] * len(self._totals)

    def mark(self, param_index: int) -> list[int]:
        """Record that a parameter's gradient is complete; returns buckets now complete."""
        done = []
        with self._lock:
            for index in self._buckets_of_param[param_index]:
                self._pending[index] -= 1
                if self._pending[index] == 0 and not self._released[index]:
                    self._released[index] = True
                    done.append(index)
        return done

    def release_rest(self) -> list[int]:
        """Buckets not yet complete (e.g. parameters that got no gradient), in order."""
        with self._lock:
            rest = [i for i, released in enumerate(self._released) if not released]
            for index in rest:
                self._released[index] = True
        return rest
