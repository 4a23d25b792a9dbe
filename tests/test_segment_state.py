"""SegmentState and SegmentRegistry without transport: idempotent pushes keyed by step,
complete validation before any change, weight reads, and registration rules."""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable

import pytest
import torch

from cargohold.services.errors import (
    CargoholdError,
    InvalidTensorError,
    ShardConflictError,
    StepMismatchError,
    UnknownShardError,
)
from cargohold.services.layout import build_layout, fragment_views, scatter_params
from cargohold.services.optim import AdamWHyperParams
from cargohold.services.segment_state import SegmentRegistry, SegmentSpec, SegmentState, UpdateOutcome

pytestmark = pytest.mark.timeout(60)

HYPER = AdamWHyperParams(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, max_grad_norm=1.0)
NUMEL = 256
# Real elements at [0, 101) and [128, 213); the rest is padding.
FRAGMENTS = ((0, 101), (128, 85))
PADDING_VALUE = 12345.0


def _spec(**overrides: object) -> SegmentSpec:
    fields: dict[str, object] = dict(
        run_id="run-a",
        segment_id=3,
        start=1024,
        numel=NUMEL,
        fragments=FRAGMENTS,
        grad_dtype="float32",
        hyper=HYPER,
    )
    fields.update(overrides)
    return SegmentSpec(**fields)  # type: ignore[arg-type]


def _padding_mask(spec: SegmentSpec) -> torch.Tensor:
    mask = torch.ones(spec.numel, dtype=torch.bool)
    for offset, length in spec.fragments:
        mask[offset : offset + length] = False
    return mask


def _initial(spec: SegmentSpec, seed: int = 0) -> torch.Tensor:
    """Random real elements, a recognisable value in the padding."""
    weights = torch.randn(spec.numel, generator=torch.Generator().manual_seed(seed))
    weights[_padding_mask(spec)] = PADDING_VALUE
    return weights


def _gradient(step: int, numel: int = NUMEL, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    # Non-zero everywhere, padding included: the padding must still be left alone.
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 + step)).to(dtype)


def _state(spec: SegmentSpec | None = None) -> SegmentState:
    spec = spec or _spec()
    return SegmentState(spec, _initial(spec))


def _assert_snapshot_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() == {"master", "exp_avg", "exp_avg_sq"}
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} changed"


# --- pushes ------------------------------------------------------------------------------


def test_push_applies_the_next_step_and_ignores_a_repeat() -> None:
    state = _state()
    before = state.snapshot()
    assert state.updates == 0

    first = state.apply_gradient(1, _gradient(1), global_norm=0.5, lr=1e-2)
    assert isinstance(first, UpdateOutcome)
    assert first.applied and first.updates == 1 and first.seconds >= 0.0
    assert state.updates == 1
    after = state.snapshot()
    assert not torch.equal(after["master"], before["master"])
    assert bool(torch.any(after["exp_avg"] != 0)) and bool(torch.any(after["exp_avg_sq"] != 0))

    # The same push again (a retry after a lost reply), even with another payload: ignored.
    for gradient in (_gradient(1), _gradient(99)):
        repeat = state.apply_gradient(1, gradient, global_norm=0.5, lr=1e-2)
        assert repeat == UpdateOutcome(applied=False, updates=1, seconds=0.0)
        assert state.updates == 1
        _assert_snapshot_equal(state.snapshot(), after)

    second = state.apply_gradient(2, _gradient(2), global_norm=0.5, lr=1e-2)
    assert second.applied and second.updates == 2 and state.updates == 2


@pytest.mark.parametrize(("at", "pushed"), [(0, 0), (0, 2), (1, 3), (1, 0), (2, 1)])
def test_push_of_a_step_out_of_order_raises_and_changes_nothing(at: int, pushed: int) -> None:
    state = _state()
    for step in range(1, at + 1):
        state.apply_gradient(step, _gradient(step), global_norm=0.5, lr=1e-2)
    before = state.snapshot()
    with pytest.raises(StepMismatchError) as info:
        state.apply_gradient(pushed, _gradient(pushed), global_norm=0.5, lr=1e-2)
    assert str(info.value) == (
        f"shard 3 of run 'run-a' is at step {at}; it accepts a gradient for step {at + 1}, got step {pushed}"
    )
    assert state.updates == at
    _assert_snapshot_equal(state.snapshot(), before)


_BAD_GRADIENTS: dict[str, tuple[Callable[[], torch.Tensor], str]] = {
    "too long": (
        lambda: _gradient(1, NUMEL + 1),
        rf"gradient must have {NUMEL} elements, got shape \({NUMEL + 1},\)",
    ),
    "too short": (
        lambda: _gradient(1, NUMEL - 1),
        rf"gradient must have {NUMEL} elements, got shape \({NUMEL - 1},\)",
    ),
    "empty": (lambda: torch.zeros(0), rf"gradient must have {NUMEL} elements, got shape \(0,\)"),
    "2-D": (
        lambda: _gradient(1).reshape(16, 16),
        rf"gradient must have {NUMEL} elements, got shape \(16, 16\)",
    ),
    "2-D column": (lambda: _gradient(1).reshape(NUMEL, 1), r"got shape \(256, 1\)"),
    "scalar": (lambda: torch.tensor(1.0), r"got shape \(\)"),
    "float64": (
        lambda: _gradient(1, dtype=torch.float64),
        r"gradient must be torch.float32, got torch.float64",
    ),
    "bfloat16": (
        lambda: _gradient(1, dtype=torch.bfloat16),
        r"gradient must be torch.float32, got torch.bfloat16",
    ),
    "float16": (
        lambda: _gradient(1, dtype=torch.float16),
        r"gradient must be torch.float32, got torch.float16",
    ),
}


@pytest.mark.parametrize("case", sorted(_BAD_GRADIENTS))
def test_bad_gradient_raises_naming_the_problem_and_changes_nothing(case: str) -> None:
    make, message = _BAD_GRADIENTS[case]
    state = _state()
    state.apply_gradient(1, _gradient(1), global_norm=0.5, lr=1e-2)
    before = state.snapshot()
    with pytest.raises(InvalidTensorError, match=message) as info:
        state.apply_gradient(2, make(), global_norm=0.5, lr=1e-2)
    assert str(info.value).startswith("shard 3: gradient must ")
    assert state.updates == 1
    _assert_snapshot_equal(state.snapshot(), before)
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
    state = _state()
    before = state.snapshot()
    args = dict(global_norm=0.5, lr=1e-2)
    args.update(kwargs)
    with pytest.raises(InvalidTensorError, match=rf"^shard 3: {message}$"):
        state.apply_gradient(1, _gradient(1), **args)
    assert state.updates == 0
    _assert_snapshot_equal(state.snapshot(), before)
    assert state.apply_gradient(1, _gradient(1), global_norm=0.5, lr=1e-2).applied  # still usable


def test_bfloat16_gradients_are_accepted_when_the_spec_says_so() -> None:
    spec = _spec(grad_dtype="bfloat16")
    state = SegmentState(spec, _initial(spec))
    reference = SegmentState(_spec(), _initial(spec))
    gradient = _gradient(1, dtype=torch.bfloat16)
    assert state.apply_gradient(1, gradient, global_norm=0.5, lr=1e-2).applied
    reference.apply_gradient(1, gradient.to(torch.float32), global_norm=0.5, lr=1e-2)
    _assert_snapshot_equal(state.snapshot(), reference.snapshot())
    with pytest.raises(InvalidTensorError, match="must be torch.bfloat16, got torch.float32"):
        state.apply_gradient(2, _gradient(2), global_norm=0.5, lr=1e-2)


def test_push_does_not_modify_the_callers_gradient() -> None:
    state = _state()
    gradient = _gradient(1)
    kept = gradient.clone()
    state.apply_gradient(1, gradient, global_norm=50.0, lr=1e-2)  # clipping scales its own copy
    assert torch.equal(gradient, kept)


def test_without_clipping_the_gradient_is_read_in_place_and_left_alone() -> None:
    spec = _spec(hyper=AdamWHyperParams(max_grad_norm=0.0))
    state, reference = _state(spec), _state(spec)
    gradient = _gradient(1)
    kept = gradient.clone()
    state.apply_gradient(1, gradient, global_norm=50.0, lr=1e-2)
    assert torch.equal(gradient, kept)  # the kernel only reads it
    reference.apply_gradient(1, kept.clone(), global_norm=50.0, lr=1e-2, owned=True)
    _assert_snapshot_equal(state.snapshot(), reference.snapshot())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_owned_gradient_gives_the_same_update_bitwise(dtype: torch.dtype) -> None:
    """Handed over, the gradient may be clipped in place: the bits of the update stay."""
    spec = _spec(grad_dtype="float32" if dtype == torch.float32 else "bfloat16")
    owned, lent = _state(spec), _state(spec)
    for step in (1, 2):
        gradient = _gradient(step, dtype=dtype)
        assert owned.apply_gradient(step, gradient.clone(), global_norm=50.0, lr=1e-2, owned=True).applied
        assert lent.apply_gradient(step, gradient, global_norm=50.0, lr=1e-2).applied
        assert torch.equal(gradient, _gradient(step, dtype=dtype))
    _assert_snapshot_equal(owned.snapshot(), lent.snapshot())


def test_weights_buffers_are_reused_only_once_handed_back() -> None:
    state = _state()
    state.apply_gradient(1, _gradient(1), global_norm=0.5, lr=1e-2)
    first = state.weights(1, "bfloat16")  # read (nothing prepared)
    kept = first.clone()
    state.apply_gradient(2, _gradient(2), global_norm=0.5, lr=1e-2, prepare="bfloat16")
    assert torch.equal(first, kept)  # not handed back: never written again
    second = state.weights(2, "bfloat16")  # the weights the update prepared
    assert second.data_ptr() != first.data_ptr()
    state.recycle(second)
    state.apply_gradient(3, _gradient(3), global_norm=0.5, lr=1e-2, prepare="bfloat16")
    third = state.weights(3, "bfloat16")
    assert third.data_ptr() == second.data_ptr()  # the update prepared into the recycled buffer
    assert torch.equal(third, state.snapshot()["master"].to(torch.bfloat16))
    again = state.weights(3, "bfloat16")  # a second fetch of the step while the first holds it
    assert again.data_ptr() != third.data_ptr() and torch.equal(again, third)
    state.recycle(third)
    state.recycle(again)  # one spare at most; the other is freed
    in_fp32 = state.weights(3, "float32")  # a spare of another dtype is not used
    assert torch.equal(in_fp32, state.snapshot()["master"])
    reread = state.weights(3, "bfloat16")
    assert reread.data_ptr() == third.data_ptr() and torch.equal(reread, again)


def test_padding_stays_exactly_as_registered() -> None:
    state = _state()
    mask = _padding_mask(state.spec)
    assert int(mask.sum()) == NUMEL - 101 - 85
    for step in range(1, 6):
        state.apply_gradient(step, _gradient(step), global_norm=0.5, lr=1e-2)
    snap = state.snapshot()
    assert torch.all(snap["master"][mask] == PADDING_VALUE)
    assert torch.all(snap["exp_avg"][mask] == 0) and torch.all(snap["exp_avg_sq"][mask] == 0)
    assert torch.all(snap["master"][~mask] != _initial(state.spec)[~mask])
    assert torch.all(state.weights(5, "float32")[mask] == PADDING_VALUE)


def test_padding_only_shard_counts_steps() -> None:
    """A segment of padding alone (the tail of the last worker) still follows the steps."""
    spec = _spec(fragments=())
    state = SegmentState(spec, torch.zeros(NUMEL))
    for step in (1, 2):
        assert state.apply_gradient(step, _gradient(step), global_norm=0.5, lr=1e-2).applied
    assert state.updates == 2
    assert torch.equal(state.weights(2, "float32"), torch.zeros(NUMEL))


def test_shard_pushes_over_a_layout_match_torch_adamw_bitwise() -> None:
    """Registry shards built from a real layout reproduce torch.optim.AdamW(fused=True)."""
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
            shard = registry.get("r", seg.segment_id)
            assert shard.apply_gradient(step, flat_grad[seg.start : seg.stop], global_norm=0.0, lr=1e-2).applied
    result = torch.zeros(layout.total)
    for seg in layout.segments:
        result[seg.start : seg.stop] = registry.get("r", seg.segment_id).weights(10, "float32")
        for view, f in zip(fragment_views(seg, result[seg.start : seg.stop]), seg.fragments, strict=True):
            slot = layout.params[f.param_index]
            want = params[f.param_index].detach().reshape(-1)[f.param_start : f.param_start + f.length]
            assert torch.equal(view, want), f"segment {seg.segment_id}, parameter {slot.name}"


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
            outcome = state.apply_gradient(step, _gradient(step), global_norm=0.5, lr=1e-2)
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
    reference = _state()
    reference.apply_gradient(1, _gradient(1), global_norm=0.5, lr=1e-2)
    for _ in range(5):  # several rounds, to give a race a chance to show
        state = _state()
        outcomes = _push_from_threads(state, 1, threads=8)
        assert sum(o.applied for o in outcomes) == 1
        assert all(o.updates == 1 for o in outcomes)
        assert state.updates == 1
        _assert_snapshot_equal(state.snapshot(), reference.snapshot())


# --- weights -------------------------------------------------------------------------------


def test_weights_of_the_current_step_in_both_wire_dtypes() -> None:
    state = _state()
    initial = _initial(state.spec)
    assert torch.equal(state.weights(0, "float32"), initial)
    for step in (1, 2):
        state.apply_gradient(step, _gradient(step), global_norm=0.5, lr=1e-2)
    master = state.snapshot()["master"]
    fp32 = state.weights(2, "float32")
    bf16 = state.weights(2, "bfloat16")
    assert fp32.dtype == torch.float32 and bf16.dtype == torch.bfloat16
    assert fp32.shape == bf16.shape == (NUMEL,)
    assert torch.equal(fp32, master)
    assert torch.equal(bf16, master.to(torch.bfloat16))
    # Copies: writing to them leaves the shard alone.
    fp32.fill_(0.0)
    bf16.fill_(0.0)
    assert torch.equal(state.snapshot()["master"], master)


@pytest.mark.parametrize("asked", [0, 1, 3, -1])
def test_weights_of_another_step_raise_step_mismatch(asked: int) -> None:
    state = _state()
    state.apply_gradient(1, _gradient(1), global_norm=0.5, lr=1e-2)
    state.apply_gradient(2, _gradient(2), global_norm=0.5, lr=1e-2)
    with pytest.raises(StepMismatchError, match=rf"holds the weights of step 2, not of step {asked}$"):
        state.weights(asked, "float32")


def test_weights_in_an_unknown_dtype_raise_invalid_tensor() -> None:
    state = _state()
    with pytest.raises(InvalidTensorError, match=r"weight dtype 'float16' is not one of \['bfloat16', 'float32'\]"):
        state.weights(0, "float16")


# --- registry --------------------------------------------------------------------------------


def test_register_same_spec_twice_returns_the_same_state() -> None:
    registry = SegmentRegistry()
    spec = _spec()
    first = registry.register(spec, _initial(spec, seed=0))
    first.apply_gradient(1, _gradient(1), global_norm=0.5, lr=1e-2)
    snap = first.snapshot()
    # A re-registration (e.g. a worker restarting) with other initial weights changes nothing.
    second = registry.register(_spec(), _initial(spec, seed=1))
    assert second is first
    assert second.updates == 1
    _assert_snapshot_equal(second.snapshot(), snap)
    assert registry.shards() == [first]
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
    original = registry.register(_spec(), _initial(_spec()))
    spec = _spec(**change)
    with pytest.raises(
        ShardConflictError,
        match=r"shard 3 of run 'run-a' is already registered with a different specification",
    ):
        registry.register(spec, _initial(spec))
    assert registry.get("run-a", 3) is original
    assert registry.shards() == [original]


def test_registry_keys_by_run_and_shard() -> None:
    registry = SegmentRegistry()
    a3 = registry.register(_spec(), _initial(_spec()))
    a4 = registry.register(_spec(segment_id=4), _initial(_spec()))
    b3 = registry.register(_spec(run_id="run-b"), _initial(_spec()))
    assert len({id(a3), id(a4), id(b3)}) == 3
    assert registry.shards("run-a") == [a3, a4]
    assert registry.shards("run-b") == [b3]
    assert registry.shards("run-c") == []
    assert len(registry.shards()) == 3


def test_register_with_bad_initial_weights_registers_nothing() -> None:
    registry = SegmentRegistry()
    with pytest.raises(InvalidTensorError, match="initial weights must be torch.float32, got torch.float64"):
        registry.register(_spec(), _initial(_spec()).double())
    with pytest.raises(InvalidTensorError, match=rf"initial weights must have {NUMEL} elements"):
        registry.register(_spec(), torch.zeros(NUMEL + 1))
    assert registry.shards() == []
    with pytest.raises(UnknownShardError):
        registry.get("run-a", 3)


def test_initial_weights_are_copied() -> None:
    spec = _spec()
    weights = _initial(spec)
    kept = weights.clone()
    state = SegmentState(spec, weights)
    weights.fill_(0.0)
    assert torch.equal(state.weights(0, "float32"), kept)


def test_unknown_shard_error_is_readable_and_pickles() -> None:
    registry = SegmentRegistry()
    registry.register(_spec(), _initial(_spec()))
    for run_id, segment_id in (("run-a", 4), ("run-b", 3)):
        with pytest.raises(UnknownShardError) as info:
            registry.get(run_id, segment_id)
        error = info.value
        expected = f"no shard {segment_id} is registered for run {run_id!r}"
        assert str(error) == expected  # not KeyError's quoted repr
        assert isinstance(error, KeyError) and isinstance(error, CargoholdError)
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is UnknownShardError and str(copy) == expected


# --- spec validation -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(run_id=""), r"run_id must not be empty"),
        (dict(numel=0), r"shard 3: numel must be > 0, got 0"),
        (dict(numel=-5, fragments=()), r"shard 3: numel must be > 0, got -5"),
        (
            dict(grad_dtype="float16"),
            r"shard 3: grad dtype 'float16' is not one of \['bfloat16', 'float32'\]",
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
def test_shard_spec_validation(change: dict, message: str) -> None:
    with pytest.raises(InvalidTensorError, match=message):
        _spec(**change)


def test_shard_spec_accepts_touching_fragments_and_full_cover() -> None:
    assert _spec(fragments=((0, 10), (10, 246))).fragments == ((0, 10), (10, 246))
    assert _spec(fragments=((0, NUMEL),)).numel == NUMEL
