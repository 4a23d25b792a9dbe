"""The launcher's step ledger (cluster/step_ledger.py): the update number and fp16's loss
scale after each recent step, and the step a live recovery goes on after once the servers
settled at an update. Pure bookkeeping, no cluster (tests/test_live_recovery.py runs it
with real actors)."""

from __future__ import annotations

import pytest

from cargohold.cluster.step_ledger import StepEnd, StepLedger
from cargohold.services.core.errors import UnsettledError
from cargohold.services.core.loss_scale import LossScaleRules, LossScaleState, next_state
from cargohold.services.core.update_call import CommitTerms

RULES = LossScaleRules(init_scale=2.0**18, growth_interval=2)
SKIPS = [True, False, False, True, False, False]
"""Steps 1-6 of tests/test_live_recovery.py's fp16 run: overflows at 1 and 4."""


def _fp16_ledger(steps: int) -> StepLedger:
    ledger = StepLedger(0, StepEnd(0, LossScaleState(RULES.init_scale)), RULES)
    for step, skipped in enumerate(SKIPS[:steps], start=1):
        ledger.record(step, skipped=skipped)
    return ledger


def test_each_step_is_recorded_with_its_update_and_the_scale_the_workers_keep() -> None:
    ledger = _fp16_ledger(6)
    scale = LossScaleState(RULES.init_scale)
    for skipped in SKIPS:
        scale = next_state(scale, RULES, found_inf=skipped)
    assert ledger[6] == StepEnd(4, scale)  # two of six skipped
    assert ledger[6].loss_scale == LossScaleState(2.0**18, 0), "grown after two clean steps"
    assert _fp16_ledger(4)[4] == StepEnd(2, LossScaleState(2.0**17, 0)), "backed off at the overflow"


def test_steps_two_updates_back_are_forgotten() -> None:
    ledger = StepLedger(10, StepEnd(7, None), None)
    for step in range(11, 15):
        ledger.record(step, skipped=False)
    assert ledger[14].updates == 11 and ledger[13].updates == 10
    with pytest.raises(KeyError):
        ledger[12]


def test_a_recovery_goes_on_after_the_step_that_reached_the_settled_update() -> None:
    ledger = _fp16_ledger(4)  # step 4 skipped: steps 3 and 4 both stand at update 2
    assert ledger.settle(2) == (4, ledger[4])


def test_a_lost_steps_update_applied_everywhere_counts_as_that_step_done_clean() -> None:
    """Worker lost in step 6 after its update landed on every segment: the run goes on after
    step 6, with the scale a clean step 6 grew (a replacement must not start over)."""
    ledger = _fp16_ledger(5)
    step, end = ledger.settle(4)
    assert (step, end.updates) == (6, 4)
    assert end.loss_scale == LossScaleState(2.0**18, 0)
    assert ledger.record(7, skipped=False).updates == 5


def test_settled_updates_the_ledger_cannot_place_are_refused() -> None:
    ledger = StepLedger(3, StepEnd(3, None), None)
    with pytest.raises(UnsettledError, match="behind every step"):
        ledger.settle(2)
    with pytest.raises(UnsettledError, match="more than one past step 3"):
        StepLedger(3, StepEnd(3, None), None).settle(5)


def test_a_scale_without_its_rules_and_steps_out_of_order_are_refused() -> None:
    with pytest.raises(ValueError, match="loss scale and its rules"):
        StepLedger(0, StepEnd(0, LossScaleState(8.0)), None)
    with pytest.raises(ValueError, match="step 3 recorded after step 1"):
        StepLedger(1, StepEnd(1, None), None).record(3, skipped=False)


def test_the_newest_steps_staged_terms_are_kept_for_the_settlement() -> None:
    terms = CommitTerms(lr=0.01, global_norm=3.0)
    ledger = StepLedger(0, StepEnd(0, None), None)
    assert ledger.staged_terms is None
    ledger.record(1, skipped=False, terms=terms)
    assert ledger.staged_terms == (1, terms)
    ledger.record(2, skipped=True, terms=terms)  # a skipped step stages nothing to commit
    assert ledger.staged_terms is None
