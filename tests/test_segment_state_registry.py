"""SegmentRegistry and SegmentSpec: registration rules (idempotent, conflicts refused,
keyed by run and segment, initial weights checked and copied), the unknown-segment error, and
spec validation."""

from __future__ import annotations

import pickle

import pytest
import torch
from segment_states import NUMEL, assert_snapshot_equal, initial_weights, segment_spec, step_gradient

from cargohold.services.core.errors import CargoholdError, InvalidTensorError, SegmentConflictError, UnknownSegmentError
from cargohold.services.core.optim import AdamWHyperParams
from cargohold.services.segments.segment_registry import SegmentRegistry
from cargohold.services.segments.segment_state import SegmentState

pytestmark = pytest.mark.timeout(60)


# --- registry --------------------------------------------------------------------------------


def test_register_same_spec_twice_returns_the_same_state() -> None:
    registry = SegmentRegistry()
    spec = segment_spec()
    first = registry.register(spec, initial_weights(spec, seed=0))
    first.apply_gradient(1, step_gradient(1), global_norm=0.5, lr=1e-2)
    snap = first.snapshot()
    # A re-registration (e.g. a worker restarting) with other initial weights changes nothing.
    second = registry.register(segment_spec(), initial_weights(spec, seed=1))
    assert second is first
    assert second.updates == 1
    assert_snapshot_equal(second.snapshot(), snap)
    assert registry.segments() == [first]
    assert registry.get("run-a", 3) is first
    assert registry.resident_bytes() == 3 * NUMEL * 4 == first.resident_bytes


@pytest.mark.parametrize(
    "change",
    [
        dict(numel=NUMEL * 2),
        dict(fragments=((0, 101),)),
        dict(grad_dtype="bfloat16"),
        dict(start=0),
        dict(hyper=AdamWHyperParams(max_grad_norm=2.0)),
    ],
)
def test_register_with_a_different_spec_raises_conflict(change: dict) -> None:
    registry = SegmentRegistry()
    original = registry.register(segment_spec(), initial_weights(segment_spec()))
    spec = segment_spec(**change)
    with pytest.raises(
        SegmentConflictError,
        match=r"segment 3 of run 'run-a' is already registered with a different specification",
    ):
        registry.register(spec, initial_weights(spec))
    assert registry.get("run-a", 3) is original
    assert registry.segments() == [original]


def test_registry_keys_by_run_and_segment() -> None:
    registry = SegmentRegistry()
    a3 = registry.register(segment_spec(), initial_weights(segment_spec()))
    a4 = registry.register(segment_spec(segment_id=4), initial_weights(segment_spec()))
    b3 = registry.register(segment_spec(run_id="run-b"), initial_weights(segment_spec()))
    assert len({id(a3), id(a4), id(b3)}) == 3
    assert registry.segments("run-a") == [a3, a4]
    assert registry.segments("run-b") == [b3]
    assert registry.segments("run-c") == []
    assert len(registry.segments()) == 3


def test_register_with_bad_initial_weights_registers_nothing() -> None:
    registry = SegmentRegistry()
    with pytest.raises(InvalidTensorError, match="initial weights must be torch.float32, got torch.float64"):
        registry.register(segment_spec(), initial_weights(segment_spec()).double())
    with pytest.raises(InvalidTensorError, match=rf"initial weights must have {NUMEL} elements"):
        registry.register(segment_spec(), torch.zeros(NUMEL + 1))
    assert registry.segments() == []
    with pytest.raises(UnknownSegmentError):
        registry.get("run-a", 3)


def test_initial_weights_are_copied() -> None:
    spec = segment_spec()
    weights = initial_weights(spec)
    kept = weights.clone()
    state = SegmentState(spec, weights)
    weights.fill_(0.0)
    assert torch.equal(state.weights(0, "float32"), kept)


def test_unknown_segment_error_is_readable_and_pickles() -> None:
    registry = SegmentRegistry()
    registry.register(segment_spec(), initial_weights(segment_spec()))
    for run_id, segment_id in (("run-a", 4), ("run-b", 3)):
        with pytest.raises(UnknownSegmentError) as info:
            registry.get(run_id, segment_id)
        error = info.value
        expected = f"no segment {segment_id} is registered for run {run_id!r}"
        assert str(error) == expected  # not KeyError's quoted repr
        assert isinstance(error, KeyError) and isinstance(error, CargoholdError)
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is UnknownSegmentError and str(copy) == expected


# --- spec validation -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(run_id=""), r"run_id must not be empty"),
        (dict(numel=0), r"segment 3: numel must be > 0, got 0"),
        (dict(numel=-5, fragments=()), r"segment 3: numel must be > 0, got -5"),
        (
            dict(grad_dtype="float64"),
            r"segment 3: grad dtype 'float64' is not one of \['bfloat16', 'float16', 'float32'\]",
        ),
        (dict(grad_dtype="fp32"), r"grad dtype 'fp32' is not one of"),
        (dict(fragments=((0, 101), (100, 10))), r"fragment \(100, 10\) overlaps"),
        (dict(fragments=((128, 10), (0, 10))), r"fragment \(0, 10\) overlaps"),
        (
            dict(fragments=((0, NUMEL + 1),)),
            rf"fragment \(0, {NUMEL + 1}\) .*leaves the segment of {NUMEL} elements",
        ),
        (dict(fragments=((250, 7),)), r"fragment \(250, 7\)"),
        (dict(fragments=((-1, 5),)), r"fragment \(-1, 5\)"),
        (dict(fragments=((0, 0),)), r"fragment \(0, 0\) .*is empty"),
        (dict(fragments=((10, -3),)), r"fragment \(10, -3\)"),
    ],
)
def test_segment_spec_validation(change: dict, message: str) -> None:
    with pytest.raises(InvalidTensorError, match=message):
        segment_spec(**change)


def test_segment_spec_accepts_touching_fragments_and_full_cover() -> None:
    assert segment_spec(fragments=((0, 10), (10, 246))).fragments == ((0, 10), (10, 246))
    assert segment_spec(fragments=((0, NUMEL),)).numel == NUMEL
