"""Where the run stood after each recent step: the state servers' update number and, with
fp16 compute, the dynamic loss scale. A live recovery (:mod:`.live_recovery`) reads it to
go on from the step whose update the servers settled at, with the loss scale that step
left (the workers that held it may be gone).

A skipped step (an fp16 overflow, a non-finite norm) applies no update, so step and update
numbers part. Each step's commit terms are kept: a delayed update commits after its step
was reported, and a lost worker can leave it committed nowhere. The launcher replays the
scale's rules on each step's skip as every worker does
(:func:`~cargohold.services.core.loss_scale.next_state`), so it needs no worker to ask.
At most one update is in flight, so steps two updates back are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

from cargohold.services.core.errors import UnsettledError
from cargohold.services.core.loss_scale import LossScaleRules, LossScaleState, next_state
from cargohold.services.core.update_call import CommitTerms


@dataclass(frozen=True, slots=True)
class StepEnd:
    """Where the run stood after one step."""

    updates: int
    """The servers' update number."""
    loss_scale: LossScaleState | None
    """fp16 compute: the dynamic loss scale the next step computes with."""
    terms: CommitTerms | None = None
    """The terms the step's staged update was committed with, or with a delayed update
    will be during the next step (the settlement finishes it with them)."""


class StepLedger:
    """The :class:`StepEnd` of each recent step, from the step the run started or resumed at."""

    def __init__(self, step: int, end: StepEnd, rules: LossScaleRules | None) -> None:
        if (end.loss_scale is None) != (rules is None):
            raise ValueError("a loss scale and its rules go together (fp16 compute), or neither")
        self._rules = rules
        self._ends = {step: end}

    def __getitem__(self, step: int) -> StepEnd:
        return self._ends[step]

    @property
    def staged_terms(self) -> tuple[int, CommitTerms] | None:
        """The newest step's update and its commit terms, where it staged one."""
        end = self._ends[max(self._ends)]
        return None if end.terms is None else (end.updates, end.terms)

    def record(self, step: int, *, skipped: bool, terms: CommitTerms | None = None) -> StepEnd:
        """Step ``step`` (the one after the newest recorded) is done; ``skipped``: it
        applied no update; ``terms``: those of its staged update."""
        newest = max(self._ends)
        if step != newest + 1:
            raise ValueError(f"step {step} recorded after step {newest}")
        before = self._ends[newest]
        scale = before.loss_scale
        if scale is not None:
            assert self._rules is not None  # checked at construction
            scale = next_state(scale, self._rules, found_inf=skipped)
        end = self._ends[step] = StepEnd(before.updates + (not skipped), scale, None if skipped else terms)
        for old in [s for s, e in self._ends.items() if s < step and e.updates < end.updates - 1]:
            del self._ends[old]
        return end

    def settle(self, update: int) -> tuple[int, StepEnd]:
        """The step the run goes on after, the servers standing at ``update`` (a step in
        flight when a worker was lost either applied its update everywhere or nowhere by
        now), and where the run stands after it. Later steps are forgotten."""
        reached = [s for s, e in self._ends.items() if e.updates <= update]
        if not reached:
            raise UnsettledError(f"the servers stand at update {update}, behind every step the run recalls")
        step = max(reached)
        for later in [s for s in self._ends if s > step]:
            del self._ends[later]
        if self._ends[step].updates < update:  # the lost step's update was applied everywhere
            end = self.record(step + 1, skipped=False)
            if end.updates != update:
                raise UnsettledError(f"the servers stand at update {update}, more than one past step {step}")
            return step + 1, end
        return step, self._ends[step]
