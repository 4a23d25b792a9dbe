"""Settling the step a lost worker left part-way (services/core/settlement.py): the pure
decision, and holders on real tiers (RAM and partition files) that finish a staged update
some segments committed and others not, ending bitwise where an uninterrupted commit ends."""

from __future__ import annotations

from pathlib import Path

import pytest
from tier_stores import LR, assert_same_segment, open_storage, seeded_randn, tier_config, tier_segment_spec

from cargohold.services.core.errors import UnsettledError
from cargohold.services.core.settlement import HolderStanding, SegmentStanding, Settlement, settle
from cargohold.services.core.update_call import CommitTerms
from cargohold.services.segments.segment_holder import SegmentHolder
from cargohold.services.segments.segment_registry import SegmentRegistry
from cargohold.services.segments.segment_state import SegmentState

TERMS = CommitTerms(lr=LR, global_norm=2.0)
RUN = "run-t"


def _holder(*segments: tuple[int, int, int], last: tuple[int, CommitTerms] | None = None) -> HolderStanding:
    return HolderStanding(tuple(SegmentStanding(*s) for s in segments), last)


def test_segments_at_one_update_need_nothing_settled_whatever_is_staged() -> None:
    assert settle([_holder((0, 4, 5), (1, 4, 0), last=(4, TERMS)), _holder((2, 4, 5))]) == Settlement(4)
    assert settle([_holder((0, 0, 0))]) == Settlement(0)


def test_a_delayed_update_committed_nowhere_is_finished_with_the_terms_its_step_reported() -> None:
    """Every segment at 4 with update 5 staged and the launcher holding step 5's terms (a
    delayed update commits after its step's report): committed everywhere with them.
    Without them, or with a segment that staged nothing, the run goes on from 4."""
    staged = [_holder((0, 4, 5), (1, 4, 5), last=(4, TERMS)), _holder((2, 4, 5))]
    assert settle(staged, (5, TERMS)) == Settlement(5, TERMS)
    assert settle(staged) == Settlement(4)
    assert settle(staged, (4, TERMS)) == Settlement(4), "terms of an update already applied finish nothing"
    assert settle([*staged, _holder((3, 4, 0))], (5, TERMS)) == Settlement(4)


def test_segments_one_behind_with_the_gradient_staged_are_finished_with_the_terms_of_the_others() -> None:
    standings = [_holder((0, 5, 0), (1, 4, 5), last=(5, TERMS)), _holder((2, 4, 5), last=(4, CommitTerms(lr=1.0)))]
    assert settle(standings) == Settlement(5, TERMS)


@pytest.mark.parametrize(
    ("standings", "named"),
    [
        ([_holder((0, 5, 0), last=(5, TERMS)), _holder((3, 4, 0))], "segment 3 is at update 4 with no gradient staged"),
        ([_holder((0, 5, 0), last=(5, TERMS)), _holder((3, 3, 4))], "segment 3 is at update 3, others at 5"),
        (
            [_holder((0, 5, 0), last=(5, TERMS)), _holder((1, 5, 0), last=(5, CommitTerms(lr=LR))), _holder((2, 4, 5))],
            "update 5 was committed with 2 different sets of terms",
        ),
        ([_holder((0, 5, 0)), _holder((1, 4, 5))], "update 5 was committed with 0 different sets"),
        ([_holder()], "no segment reported"),
    ],
    ids=["applied-at-once", "two-apart", "terms-disagree", "terms-unknown", "empty"],
)
def test_a_standing_no_live_state_can_settle_is_refused_naming_why(standings, named: str) -> None:
    with pytest.raises(UnsettledError, match=named):
        settle(standings)


def test_holders_finish_a_part_committed_staged_update_bitwise(tmp_path: Path) -> None:
    """Two holders, one on partition files: updates 1-3 staged and committed everywhere,
    then update 4 staged everywhere and committed on one segment only (the worker is lost
    during the commit). Settled, every segment equals the segment that never lost a worker."""
    with open_storage(tier_config(tmp_path)) as storage:
        disk = SegmentHolder(SegmentRegistry(storage), "server0")
        ram = SegmentHolder(SegmentRegistry(), "server1")
        live = [
            disk.registry.register(tier_segment_spec(0), seeded_randn(0)),
            ram.registry.register(tier_segment_spec(1), seeded_randn(1)),
        ]
        reference = [
            SegmentState(tier_segment_spec(0), seeded_randn(0)),
            SegmentState(tier_segment_spec(1), seeded_randn(1)),
        ]
        for update in range(1, 5):
            for index, state in enumerate([*live, *reference]):
                state.stage_gradient(update, seeded_randn(10 * update + index % 2))
            for state in reference:
                state.commit(update, global_norm=TERMS.global_norm, lr=TERMS.lr)
            for state in live if update < 4 else live[1:]:  # update 4 reaches segment 1 only
                state.commit(update, global_norm=TERMS.global_norm, lr=TERMS.lr)

        standings = [disk.standing(RUN), ram.standing(RUN)]
        assert standings[0] == _holder((0, 3, 4), last=(3, TERMS))
        settlement = settle(standings)
        assert settlement == Settlement(4, TERMS)
        assert disk.finish_update(RUN, settlement.update, TERMS) == 1
        assert ram.finish_update(RUN, settlement.update, TERMS) == 0
        assert settle([disk.standing(RUN), ram.standing(RUN)]) == Settlement(4)
        for state, expected in zip(live, reference, strict=True):
            assert state.updates == 4
            assert_same_segment(state, expected)
