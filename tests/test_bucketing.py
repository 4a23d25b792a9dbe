"""Bucket readiness bookkeeping: a bucket is released exactly once, when the last
parameter overlapping it has its gradient."""

from __future__ import annotations

from cargohold.services.bucketing import BucketReadiness
from cargohold.services.layout import build_layout


def _layout():
    # 4 params of 100 elements at offsets 0, 128, 256, 384 (align 64); buckets of 128
    # elements with 2 workers -> buckets [0,128), [128,256), [256,384), [384,512).
    return build_layout([(f"p{i}", (100,)) for i in range(4)] + [("empty", (0,))],
                        num_workers=2, num_servers=1, align=64, bucket_elements=128)


def test_buckets_release_when_their_parameters_are_done_in_backward_order() -> None:
    readiness = BucketReadiness(_layout())
    assert readiness.mark(3) == [3]
    assert readiness.mark(2) == [2]
    assert readiness.mark(1) == [1]
    assert readiness.mark(0) == [0]
    assert readiness.release_rest() == []


def test_a_parameter_spanning_buckets_holds_all_of_them() -> None:
    layout = build_layout([("big", (300,)), ("small", (10,))], num_workers=1, num_servers=1,
                          align=64, bucket_elements=128)
    readiness = BucketReadiness(layout)
    assert readiness.mark(1) == []  # bucket 2 also holds the tail of "big"
    assert sorted(readiness.mark(0)) == [0, 1, 2]


def test_reset_and_release_rest() -> None:
    readiness = BucketReadiness(_layout())
    assert readiness.mark(0) == [0]
    assert readiness.mark(0) == []  # released once only
    assert readiness.release_rest() == [1, 2, 3]
    readiness.reset()
    assert readiness.mark(1) == [1]
    assert readiness.release_rest() == [0, 2, 3]
