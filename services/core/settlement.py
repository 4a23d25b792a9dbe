"""Settling the update in flight when a worker is lost (issue 42: live recovery).

The state servers outlive a lost worker, holding every segment's state after its last
update. A worker lost part-way through a step leaves the segments in one of three
standings, and only the holders' own reports tell which:

* **Every segment at the same update** ``U``: the lost step never committed anywhere. Its
  staged gradients (if any) are simply staged again when the step is computed once more
  (staging an update replaces what was staged for it), so nothing is settled: the run
  goes on from update ``U``.
* **Some segments at ``U``, the rest at ``U - 1`` with update ``U``'s gradient staged**:
  the commit of a staged update (clipping or the non-finite check on) was going round the
  segments. Every gradient had been pushed (the commit terms need the global norm of them
  all), and the holders that committed know the terms, so the others are committed with
  the same terms: every segment then stands at ``U``, exactly as if no worker was lost.
* **Every segment at ``U`` with update ``U + 1``'s gradient staged, none committed**, and
  the launcher holds that update's terms from its step's report (``known``): a delayed
  update (``worker.delayed_update``) commits update ``U + 1`` during the next step, after
  its step was reported, and the worker was lost before any commit landed. The launcher's
  terms are the ones the workers computed, so every segment is committed with them.
  Without them (the step was never reported) the run goes on from ``U`` as in the first case.
* **Anything else** (a segment at ``U - 1`` with no gradient staged for ``U``, updates two
  apart, holders that committed ``U`` with different terms): an update applied at once
  (no clipping, no check) was lost part-way, and its gradient with the worker. No live
  state is consistent; the run recovers from its newest checkpoint instead.

:func:`settle` decides; the holders report (:class:`HolderStanding`) and finish
(:meth:`~cargohold.services.segments.segment_holder.SegmentHolder.finish_update`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cargohold.services.core.errors import UnsettledError
from cargohold.services.core.update_call import CommitTerms


@dataclass(frozen=True, slots=True)
class SegmentStanding:
    """Where one segment stands: its update number and the update whose gradient is staged
    (0: none)."""

    segment_id: int
    updates: int
    staged: int = 0


@dataclass(frozen=True, slots=True)
class HolderStanding:
    """What one holder (a state server) reports: its segments' standings, and the newest
    update it committed with the terms it committed it with (None: none since it started
    or restored)."""

    segments: tuple[SegmentStanding, ...]
    last_commit: tuple[int, CommitTerms] | None = None


@dataclass(frozen=True, slots=True)
class Settlement:
    """Every segment stands at ``update`` once the holders have committed ``finish`` (the
    terms of ``update``) on the segments still one behind; ``finish`` None: nothing to do."""

    update: int
    finish: CommitTerms | None = None


def settle(standings: Sequence[HolderStanding], known: tuple[int, CommitTerms] | None = None) -> Settlement:
    """The settlement of the holders' ``standings``; raises :class:`UnsettledError`,
    naming a segment, when there is none (see the module's docstring). ``known``: the
    newest reported update the workers staged and its terms."""
    segments = [s for holder in standings for s in holder.segments]
    if not segments:
        raise UnsettledError("no segment reported its standing")
    newest = max(s.updates for s in segments)
    behind = [s for s in segments if s.updates != newest]
    if not behind:
        if known is not None and known[0] == newest + 1 and all(s.staged == newest + 1 for s in segments):
            return Settlement(newest + 1, known[1])
        return Settlement(newest)
    for segment in behind:
        if segment.updates != newest - 1:
            raise UnsettledError(
                f"segment {segment.segment_id} is at update {segment.updates}, others at {newest}: "
                "more than one update apart"
            )
        if segment.staged != newest:
            raise UnsettledError(
                f"segment {segment.segment_id} is at update {segment.updates} with no gradient staged for "
                f"update {newest}, which other segments applied: that update's gradient was lost with the worker"
            )
    terms = {holder.last_commit[1] for holder in standings if holder.last_commit and holder.last_commit[0] == newest}
    if len(terms) != 1:
        raise UnsettledError(
            f"update {newest} was committed with {len(terms)} different sets of terms (lr, global norm, loss "
            "scale); expected one"
        )
    return Settlement(newest, terms.pop())
