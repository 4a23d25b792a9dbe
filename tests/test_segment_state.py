"""SegmentState pushes without transport: idempotent updates keyed by step (exactly once
under concurrent retries), complete validation before any change, the caller's gradient
and the padding left alone, and bitwise equality with torch.optim.AdamW(fused=True)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
from segment_states import (
    NUMEL,
    PADDING_VALUE,
    assert_snapshot_equal,
    fresh_state,
    initial_weights,
    padding_mask,
    segment_spec,
    step_gradient,
)

from cargohold.services.core.errors import InvalidTensorError, UpdateMismatchError
from cargohold.services.core.layout import build_layout, fragment_views, scatter_params
from cargohold.services.core.optim import AdamWHyperParams
from cargohold.services.core.segment_spec import SegmentSpec, UpdateOutcome
from cargohold.services.segments.segment_registry import SegmentRegistry
from cargohold.services.segments.segment_state import SegmentState

pytestmark = pytest.mark.timeout(60)


# --- pushes ------------------------------------------------------------------------------


def test_push_applies_the_next_step_and_ignores_a_repeat() -> None:
    state = fresh_state()
    before = state.snapshot()
    assert state.updates == 0

    first = state.apply_gradient(1, step_gradient(1), global_norm=0.5, lr=1e-2)
    assert isinstance(first, UpdateOutcome)
    assert first.applied and first.updates == 1 and first.seconds >= 0.0
    assert state.updates == 1
    after = state.snapshot()
    assert not torch.equal(after["master"], before["master"])
    assert bool(torch.any(after["exp_avg"] != 0)) and bool(torch.any(after["exp_avg_sq"] != 0))

    # The same push again (a retry after a lost reply), even with another payload: ignored.
    for gradient in (step_gradient(1), step_gradient(99)):
        repeat = state.apply_gradient(1, gradient, global_norm=0.5, lr=1e-2)
        assert repeat == UpdateOutcome(applied=False, updates=1, seconds=0.0)
        assert state.updates == 1
        assert_snapshot_equal(state.snapshot(), after)

    second = state.apply_gradient(2, step_gradient(2), global_norm=0.5, lr=1e-2)
    assert second.applied and second.updates == 2 and state.updates == 2


@pytest.mark.parametrize(("at", "pushed"), [(0, 0), (0, 2), (1, 3), (1, 0), (2, 1)])
def test_push_of_a_step_out_of_order_raises_and_changes_nothing(at: int, pushed: int) -> None:
    state = fresh_state()
    for step in range(1, at + 1):
        state.apply_gradient(step, step_gradient(step), global_norm=0.5, lr=1e-2)
    before = state.snapshot()
    with pytest.raises(UpdateMismatchError) as info:
        state.apply_gradient(pushed, step_gradient(pushed), global_norm=0.5, lr=1e-2)
    assert str(info.value) == (
        f"segment 3 of run 'run-a' is at update {at}; it accepts a gradient for update {at + 1}, got update {pushed}"
    )
    assert state.updates == at
    assert_snapshot_equal(state.snapshot(), before)


_BAD_GRADIENTS: dict[str, tuple[Callable[[], torch.Tensor], str]] = {
    "too long": (
        lambda: step_gradient(1, NUMEL + 1),
        rf"gradient must have {NUMEL} elements, got shape \({NUMEL + 1},\)",
    ),
    "too short": (
        lambda: step_gradient(1, NUMEL - 1),
        rf"gradient must have {NUMEL} elements, got shape \({NUMEL - 1},\)",
    ),
    "empty": (lambda: torch.zeros(0), rf"gradient must have {NUMEL} elements, got shape \(0,\)"),
    "2-D": (
        lambda: step_gradient(1).reshape(16, 16),
        rf"gradient must have {NUMEL} elements, got shape \(16, 16\)",
    ),
    "2-D column": (lambda: step_gradient(1).reshape(NUMEL, 1), r"got shape \(256, 1\)"),
    "scalar": (lambda: torch.tensor(1.0), r"got shape \(\)"),
    "float64": (
        lambda: step_gradient(1, dtype=torch.float64),
        r"gradient must be torch.float32, got torch.float64",
    ),
    "bfloat16": (
        lambda: step_gradient(1, dtype=torch.bfloat16),
        r"gradient must be torch.float32, got torch.bfloat16",
    ),
    "float16": (
        lambda: step_gradient(1, dtype=torch.float16),
        r"gradient must be torch.float32, got torch.float16",
    ),
}


@pytest.mark.parametrize("case", sorted(_BAD_GRADIENTS))
def test_bad_gradient_raises_naming_the_problem_and_changes_nothing(case: str) -> None:
    make, message = _BAD_GRADIENTS[case]
    state = fresh_state()
    state.apply_gradient(1, step_gradient(1), global_norm=0.5, lr=1e-2)
    before = state.snapshot()
    with pytest.raises(InvalidTensorError, match=message) as info:
        state.apply_gradient(2, make(), global_norm=0.5, lr=1e-2)
    assert str(info.value).startswith("segment 3: gradient must ")
    assert state.updates == 1
    assert_snapshot_equal(state.snapshot(), before)
    # Validation comes first: a bad payload for the already applied step is an error too,
    # not a silently ignored repeat.
    with pytest.raises(InvalidTensorError):
        state.apply_gradient(1, make(), global_norm=0.5, lr=1e-2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(lr=float("nan")), r"lr must be finite and >= 0, got nan"),
        (dict(lr=float("inf")), r"lr must be finite and >= 0, got inf"),
        (dict(lr=-1e-3), r"lr must be finite and >= 0, got -0.001"),
        (dict(global_norm=float("nan")), r"global gradient norm must be finite and >= 0, got nan"),
        (dict(global_norm=float("inf")), r"global gradient norm must be finite and >= 0, got inf"),
        (
            dict(global_norm=float("-inf")),
            r"global gradient norm must be finite and >= 0, got -inf",
        ),
        (dict(global_norm=-1.0), r"global gradient norm must be finite and >= 0, got -1.0"),
    ],
)
def test_bad_lr_or_norm_raises_naming_it_and_changes_nothing(kwargs: dict, message: str) -> None:
    state = fresh_state()
    before = state.snapshot()
    args = dict(global_norm=0.5, lr=1e-2)
    args.update(kwargs)
    with pytest.raises(InvalidTensorError, match=rf"^segment 3: {message}$"):
        state.apply_gradient(1, step_gradient(1), **args)
    assert state.updates == 0
    assert_snapshot_equal(state.snapshot(), before)
    assert state.apply_gradient(1, step_gradient(1), global_norm=0.5, lr=1e-2).applied  # still usable


def test_bfloat16_gradients_are_accepted_when_the_spec_says_so() -> None:
    spec = segment_spec(grad_dtype="bfloat16")
    state = SegmentState(spec, initial_weights(spec))
    reference = SegmentState(segment_spec(), initial_weights(spec))
    gradient = step_gradient(1, dtype=torch.bfloat16)
    assert state.apply_gradient(1, gradient, global_norm=0.5, lr=1e-2).applied
    reference.apply_gradient(1, gradient.to(torch.float32), global_norm=0.5, lr=1e-2)
    assert_snapshot_equal(state.snapshot(), reference.snapshot())
    with pytest.raises(InvalidTensorError, match="must be torch.bfloat16, got torch.float32"):
        state.apply_gradient(2, step_gradient(2), global_norm=0.5, lr=1e-2)


def test_push_does_not_modify_the_callers_gradient() -> None:
    state = fresh_state()
    gradient = step_gradient(1)
    kept = gradient.clone()
    state.apply_gradient(1, gradient, global_norm=50.0, lr=1e-2)  # clipping scales its own copy
    assert torch.equal(gradient, kept)


def test_without_clipping_the_gradient_is_read_in_place_and_left_alone() -> None:
    spec = segment_spec(hyper=AdamWHyperParams(max_grad_norm=0.0))
    state, reference = fresh_state(spec), fresh_state(spec)
    gradient = step_gradient(1)
    kept = gradient.clone()
    state.apply_gradient(1, gradient, global_norm=50.0, lr=1e-2)
    assert torch.equal(gradient, kept)  # the kernel only reads it
    reference.apply_gradient(1, kept.clone(), global_norm=50.0, lr=1e-2, owned=True)
    assert_snapshot_equal(state.snapshot(), reference.snapshot())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_owned_gradient_gives_the_same_update_bitwise(dtype: torch.dtype) -> None:
    """Handed over, the gradient may be clipped in place: the bits of the update stay."""
    spec = segment_spec(grad_dtype="float32" if dtype == torch.float32 else "bfloat16")
    owned, lent = fresh_state(spec), fresh_state(spec)
    for step in (1, 2):
        gradient = step_gradient(step, dtype=dtype)
        assert owned.apply_gradient(step, gradient.clone(), global_norm=50.0, lr=1e-2, owned=True).applied
        assert lent.apply_gradient(step, gradient, global_norm=50.0, lr=1e-2).applied
        assert torch.equal(gradient, step_gradient(step, dtype=dtype))
    assert_snapshot_equal(owned.snapshot(), lent.snapshot())


def test_padding_stays_exactly_as_registered() -> None:
    state = fresh_state()
    mask = padding_mask(state.spec)
    assert int(mask.sum()) == NUMEL - 101 - 85
    for step in range(1, 6):
        state.apply_gradient(step, step_gradient(step), global_norm=0.5, lr=1e-2)
    snap = state.snapshot()
    assert torch.all(snap["master"][mask] == PADDING_VALUE)
    assert torch.all(snap["exp_avg"][mask] == 0) and torch.all(snap["exp_avg_sq"][mask] == 0)
    assert torch.all(snap["master"][~mask] != initial_weights(state.spec)[~mask])
    assert torch.all(state.weights(5, "float32")[mask] == PADDING_VALUE)


def test_padding_only_segment_counts_updates() -> None:
    """A segment of padding alone (the tail of the last worker) still follows the steps."""
    spec = segment_spec(fragments=())
    state = SegmentState(spec, torch.zeros(NUMEL))
    for step in (1, 2):
        assert state.apply_gradient(step, step_gradient(step), global_norm=0.5, lr=1e-2).applied
    assert state.updates == 2
    assert torch.equal(state.weights(2, "float32"), torch.zeros(NUMEL))


def test_segment_pushes_over_a_layout_match_torch_adamw_bitwise() -> None:
    """Registry segments built from a real layout reproduce torch.optim.AdamW(fused=True)."""
    shapes = [(101,), (37, 5), (1,), (1000,)]
    layout = build_layout([(f"p{i}", s) for i, s in enumerate(shapes)], num_workers=2, num_servers=3)
    gen = torch.Generator().manual_seed(5)
    init = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(10)]
    hyper = AdamWHyperParams(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)

    # The reference steps each worker's FSDP2 chunk (dim 0) as its own tensor.
    chunks = [[torch.nn.Parameter(c.clone()) for c in t.chunk(2)] for t in init]
    optimizer = torch.optim.AdamW(
        [c for cs in chunks for c in cs], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True
    )
    for step_grads in grads:
        for cs, g in zip(chunks, step_grads, strict=True):
            for c, piece in zip(cs, g.chunk(len(cs)), strict=True):
                c.grad = piece.clone()
        optimizer.step()
    params = [torch.cat([c.detach() for c in cs]) for cs in chunks]

    def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
        return scatter_params(layout, tensors)

    registry = SegmentRegistry()
    initial = flat(init)
    for seg in layout.segments:
        spec = SegmentSpec(
            run_id="r",
            segment_id=seg.segment_id,
            start=seg.start,
            numel=seg.numel,
            fragments=tuple((f.segment_start, f.length) for f in seg.fragments),
            grad_dtype="float32",
            hyper=hyper,
        )
        registry.register(spec, initial[seg.start : seg.stop])
    for step, step_grads in enumerate(grads, start=1):
        flat_grad = flat(step_grads)
        for seg in layout.segments:
            segment = registry.get("r", seg.segment_id)
            assert segment.apply_gradient(step, flat_grad[seg.start : seg.stop], global_norm=0.0, lr=1e-2).applied
    result = torch.zeros(layout.total)
    for seg in layout.segments:
        result[seg.start : seg.stop] = registry.get("r", seg.segment_id).weights(10, "float32")
        for view, f in zip(fragment_views(seg, result[seg.start : seg.stop]), seg.fragments, strict=True):
            place = layout.params[f.param_index]
            want = params[f.param_index].detach().reshape(-1)[f.param_start : f.param_start + f.length]
            assert torch.equal(view, want), f"segment {seg.segment_id}, parameter {place.name}"


# --- concurrency -------------------------------------------------------------------------


def _push_from_threads(state: SegmentState, step: int, threads: int) -> list[UpdateOutcome]:
    """Push the same step from ``threads`` threads released together by a barrier."""
    barrier = threading.Barrier(threads)
    outcomes: list[UpdateOutcome] = []
    errors: list[BaseException] = []
    record = threading.Lock()

    def push() -> None:
        barrier.wait()
        try:
            outcome = state.apply_gradient(step, step_gradient(step), global_norm=0.5, lr=1e-2)
        except BaseException as error:  # reported below
            with record:
                errors.append(error)
            return
        with record:
            outcomes.append(outcome)

    workers = [threading.Thread(target=push) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=30)
    assert not errors, errors
    assert len(outcomes) == threads
    return outcomes


def test_concurrent_pushes_of_the_same_step_apply_exactly_once() -> None:
    reference = fresh_state()
    reference.apply_gradient(1, step_gradient(1), global_norm=0.5, lr=1e-2)
    for _ in range(5):  # several rounds, to give a race a chance to show
        state = fresh_state()
        outcomes = _push_from_threads(state, 1, threads=8)
        assert sum(o.applied for o in outcomes) == 1
        assert all(o.updates == 1 for o in outcomes)
        assert state.updates == 1
        assert_snapshot_equal(state.snapshot(), reference.snapshot())
