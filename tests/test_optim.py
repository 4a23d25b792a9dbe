"""The AdamW kernel wrapper against torch.optim.AdamW(fused=True): bitwise over aligned
shard views, the clip factor of clip_grad_norm_, and the hyper-parameter checks."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cargohold.services.errors import ConfigError
from cargohold.services.layout import DEFAULT_ALIGN, build_layout, fragment_views, gather_params, scatter_params
from cargohold.services.optim import (
    CLIP_EPSILON,
    AdamWHyperParams,
    AdamWState,
    apply_update,
    clip_,
    clip_coefficient,
    fused_adamw_,
    global_norm_from_squares,
    sum_of_squares,
)


def adamw_step(
    state: AdamWState,
    gradients: Sequence[torch.Tensor],
    *,
    lr: float,
    hyper: AdamWHyperParams,
    global_norm: float,
) -> None:
    """Clip (by the global norm of all shards) and apply one AdamW step in place: the
    primitives composed as the server composes them per piece (``optim.apply_update``).

    ``gradients`` must be fp32 and parallel to ``state.master``; they are scaled in
    place when clipping is on.
    """
    if len(gradients) != len(state.master):
        raise ValueError(f"{len(gradients)} gradient views for {len(state.master)} state views")
    clip_(gradients, clip_coefficient(global_norm, hyper.max_grad_norm))
    state.step += 1
    fused_adamw_(state, gradients, lr=lr, hyper=hyper)


pytestmark = pytest.mark.timeout(60)

Shape = tuple[int, ...]

STEPS = 20
HYPER = AdamWHyperParams(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
SHAPE_SETS: dict[str, list[Shape]] = {
    "odd": [(101,), (37, 5), (1,), (1000,)],
    "mixed": [(64, 64), (3,), (257,), (1, 1), (513, 7), (2, 3, 5)],
    "single": [(4099,)],
}


def _lr_schedule(base: float = 3e-3) -> list[float]:
    """Linear warm-up then cosine decay: a different lr every step."""
    warmup = 5
    return [base * min(1.0, (k + 1) / warmup) * 0.5 * (1.0 + math.cos(math.pi * k / STEPS)) for k in range(STEPS)]


@dataclass
class Run:
    """Initial weights and one gradient per parameter per step."""

    shapes: list[Shape]
    init: list[torch.Tensor]
    grads: list[list[torch.Tensor]]


def _make_run(shapes: Sequence[Shape], seed: int, grad_scale: float = 1.0) -> Run:
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=gen) for s in shapes]
    grads = []
    for _ in range(STEPS):
        # A different magnitude each step, so that clipping is on for some steps only.
        scale = grad_scale * float(torch.empty(()).uniform_(0.05, 2.0, generator=gen))
        grads.append([torch.randn(s, generator=gen) * scale for s in shapes])
    return Run(list(shapes), init, grads)


@dataclass
class Result:
    weights: list[torch.Tensor]
    exp_avg: list[torch.Tensor]
    exp_avg_sq: list[torch.Tensor]


def _reference(run: Run, lrs: Sequence[float], hyper: AdamWHyperParams = HYPER, *, num_workers: int = 1) -> Result:
    """Plain torch: per-parameter tensors, clip_grad_norm_, AdamW(fused=True). With
    ``num_workers`` > 1 each parameter is stepped as the dim-0 chunks FSDP2 gives each
    worker (separate tensors, as FSDP2 + AdamW does), clipped by the whole norm."""
    chunks = [t.clone().chunk(num_workers) if t.dim() else (t.clone(),) for t in run.init]
    params = [torch.nn.Parameter(c.clone()) for cs in chunks for c in cs]
    optimizer = torch.optim.AdamW(
        params,
        lr=lrs[0],
        betas=(hyper.beta1, hyper.beta2),
        eps=hyper.eps,
        weight_decay=hyper.weight_decay,
        fused=True,
    )
    for grads, lr in zip(run.grads, lrs, strict=True):
        pieces = [c for g, cs in zip(grads, chunks, strict=True) for c in g.chunk(len(cs))]
        for p, g in zip(params, pieces, strict=True):
            p.grad = g.clone()
        if hyper.max_grad_norm > 0:
            total = torch.nn.utils.get_total_norm(grads)
            torch.nn.utils.clip_grads_with_norm_(params, hyper.max_grad_norm, total)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()

    def whole(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        out, at = [], 0
        for init, cs in zip(run.init, chunks, strict=True):
            out.append(torch.cat(tensors[at : at + len(cs)]).view(init.shape))
            at += len(cs)
        return out

    return Result(
        weights=whole([p.detach() for p in params]),
        exp_avg=whole([optimizer.state[p]["exp_avg"] for p in params]),
        exp_avg_sq=whole([optimizer.state[p]["exp_avg_sq"] for p in params]),
    )


def _offloaded(
    run: Run,
    lrs: Sequence[float],
    *,
    num_workers: int,
    num_servers: int,
    align: int = DEFAULT_ALIGN,
    hyper: AdamWHyperParams = HYPER,
    norm: str = "off",
) -> Result:
    """cargohold's way: flat fp32 buffers, one AdamWState per segment over fragment views.

    ``norm`` is the global norm handed to every segment: "off" (0, clipping disabled),
    "torch" (torch's own total norm of the gradients) or "shards" (summed from the
    segments with sum_of_squares, as workers do).
    """
    layout = build_layout(
        [(f"p{i}", s) for i, s in enumerate(run.shapes)],
        num_workers=num_workers,
        num_servers=num_servers,
        align=align,
    )
    master = scatter_params(layout, run.init)
    exp_avg = torch.zeros(layout.total)
    exp_avg_sq = torch.zeros(layout.total)
    states = [
        AdamWState(
            master=fragment_views(seg, master[seg.start : seg.stop]),
            exp_avg=fragment_views(seg, exp_avg[seg.start : seg.stop]),
            exp_avg_sq=fragment_views(seg, exp_avg_sq[seg.start : seg.stop]),
            step=torch.tensor(0.0),
        )
        for seg in layout.segments
    ]
    for grads, lr in zip(run.grads, lrs, strict=True):
        flat_grad = scatter_params(layout, grads)
        # Each segment gets its own copy, as it would off the wire.
        shards = [flat_grad[seg.start : seg.stop].clone() for seg in layout.segments]
        if norm == "off":
            global_norm = 0.0
        elif norm == "torch":
            global_norm = float(torch.nn.utils.get_total_norm(grads))
        else:
            global_norm = global_norm_from_squares(sum(sum_of_squares(s) for s in shards))
        for seg, state, shard in zip(layout.segments, states, shards, strict=True):
            adamw_step(state, fragment_views(seg, shard), lr=lr, hyper=hyper, global_norm=global_norm)
    assert all(int(s.step.item()) == STEPS for s in states)
    # Padding never takes part in the update.
    real = torch.zeros(layout.total, dtype=torch.bool)
    for _, _, flat_start, length in layout.param_runs(0, layout.total):
        real[flat_start : flat_start + length] = True
    for buffer in (master, exp_avg, exp_avg_sq):
        assert torch.all(buffer[~real] == 0)

    def unflatten(flat: torch.Tensor) -> list[torch.Tensor]:
        return list(gather_params(layout, flat).values())

    return Result(unflatten(master), unflatten(exp_avg), unflatten(exp_avg_sq))


def _assert_bitwise(got: Result, want: Result) -> None:
    for name in ("weights", "exp_avg", "exp_avg_sq"):
        for i, (g, w) in enumerate(zip(getattr(got, name), getattr(want, name), strict=True)):
            assert g.dtype == w.dtype == torch.float32
            if not torch.equal(g, w):
                differing = int((g != w).sum())
                pytest.fail(
                    f"{name}[{i}] (shape {tuple(w.shape)}): {differing} elements differ, "
                    f"max |diff| {float((g - w).abs().max()):.3g}"
                )


def _max_abs_diff(got: Result, want: Result) -> float:
    return max(float((g - w).abs().max()) for g, w in zip(got.weights, want.weights, strict=True))


# --- bitwise equality with torch.optim.AdamW(fused=True) -------------------------------


@pytest.mark.parametrize("shape_set", sorted(SHAPE_SETS))
@pytest.mark.parametrize("num_workers", [1, 2, 3])
@pytest.mark.parametrize("num_servers", [1, 2, 3])
def test_sharded_update_is_bitwise_equal_to_torch_adamw(shape_set: str, num_workers: int, num_servers: int) -> None:
    run = _make_run(SHAPE_SETS[shape_set], seed=num_workers * 10 + num_servers)
    lrs = _lr_schedule()
    want = _reference(run, lrs, num_workers=num_workers)
    got = _offloaded(run, lrs, num_workers=num_workers, num_servers=num_servers)
    _assert_bitwise(got, want)
    # The run moved the weights (a vacuous pass would not).
    assert not torch.equal(got.weights[0], run.init[0])


@settings(max_examples=12, deadline=None)
@given(
    shapes=st.lists(
        st.one_of(
            st.tuples(st.integers(1, 3000)),
            st.tuples(st.integers(1, 60), st.integers(1, 60)),
        ),
        min_size=1,
        max_size=6,
    ),
    num_workers=st.integers(1, 4),
    num_servers=st.integers(1, 3),
    align=st.sampled_from([64, 128]),
    seed=st.integers(0, 2**16),
)
def test_sharded_update_is_bitwise_for_random_shapes(
    shapes: list[Shape], num_workers: int, num_servers: int, align: int, seed: int
) -> None:
    total_units = sum(-(-math.prod(s) // align) for s in shapes)
    num_servers = min(num_servers, -(-total_units // num_workers) * num_workers)
    run = _make_run(shapes, seed=seed)
    lrs = _lr_schedule()
    got = _offloaded(run, lrs, num_workers=num_workers, num_servers=num_servers, align=align)
    _assert_bitwise(got, _reference(run, lrs, num_workers=num_workers))


def test_default_hyper_params_are_bitwise_too() -> None:
    hyper = AdamWHyperParams()  # torch's AdamW defaults except weight_decay 0.01 (= torch's)
    run = _make_run(SHAPE_SETS["odd"], seed=7)
    lrs = [1e-3] * STEPS
    _assert_bitwise(
        _offloaded(run, lrs, num_workers=2, num_servers=3, hyper=hyper),
        _reference(run, lrs, hyper=hyper, num_workers=2),
    )


# Why the layout aligns cuts (measured with torch 2.13.0+cpu on AVX512, and with
# ATEN_CPU_CAPABILITY=avx2 / default): the fused CPU kernel (aten/src/ATen/native/cpu/
# FusedAdamKernel.cpp) runs a SIMD loop over each view and a scalar loop over its tail; the
# two spell the same formula with different fused multiply-adds, so an element that lands
# in a different loop than it does in the whole parameter can round differently. In the
# probes exp_avg never differed, exp_avg_sq differed for a few percent of such elements and
# the weights (through exp_avg_sq) for fewer, by at most a few ulp. Views cut at multiples
# of 8 (and so of 64) were bitwise in every probe, views of 15 or 17 elements were not;
# with ATEN_CPU_CAPABILITY=default (no SIMD) even unaligned cuts were bitwise. A layout at
# align=1 cuts a parameter at arbitrary elements, but only the few elements next to each
# cut change loop: in a probe of 60 random configurations with these helpers, 11-19
# differed from the reference in 1 or 2 weight elements, the rest were bitwise. So the
# mismatch is asserted only for views short enough to run entirely in the scalar loop,
# and only where the kernel is vectorized; closeness is asserted for align=1 layouts.
_VECTORIZED = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _cut_and_step(piece: int) -> tuple[int, int]:
    """20 steps on one 7680-element parameter, whole vs cut into views of ``piece``;
    returns the number of differing (weight, exp_avg_sq) elements."""
    n = 7680
    gen = torch.Generator().manual_seed(0)
    init = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) for _ in range(STEPS)]
    whole = AdamWState([init.clone()], [torch.zeros(n)], [torch.zeros(n)], torch.tensor(0.0))
    master, exp_avg, exp_avg_sq = init.clone(), torch.zeros(n), torch.zeros(n)
    cut = AdamWState(
        list(master.split(piece)),
        list(exp_avg.split(piece)),
        list(exp_avg_sq.split(piece)),
        torch.tensor(0.0),
    )
    for g in grads:
        adamw_step(whole, [g.clone()], lr=1e-2, hyper=HYPER, global_norm=0.0)
        adamw_step(cut, list(g.clone().split(piece)), lr=1e-2, hyper=HYPER, global_norm=0.0)
    assert torch.equal(exp_avg, whole.exp_avg[0])  # the first moment is exact either way
    torch.testing.assert_close(master, whole.master[0], rtol=4 * 2**-23, atol=1e-7)
    return int((master != whole.master[0]).sum()), int((exp_avg_sq != whole.exp_avg_sq[0]).sum())


def test_views_cut_at_aligned_offsets_are_bitwise() -> None:
    for piece in (8, 64, 640):
        assert _cut_and_step(piece) == (0, 0), f"views of {piece} elements"


def test_views_cut_off_the_simd_grid_round_differently() -> None:
    differing = _cut_and_step(15)  # shorter than 16: every element runs the scalar loop
    print(f"views of 15 elements: {differing} (weight, exp_avg_sq) elements differ")
    if _VECTORIZED:
        # Deterministic for these inputs: 178 weight elements of 7680 with torch 2.13.0.
        assert differing[0] > 0, "expected the SIMD/scalar rounding difference"
    else:
        pytest.skip(f"kernel not vectorized here ({torch.backends.cpu.get_cpu_capability()})")


def test_layout_at_align_1_is_within_a_few_ulp() -> None:
    shapes = [(2865,), (1001, 3), (4097,)]
    differing = 0
    for seed, (num_workers, num_servers) in enumerate([(3, 2), (4, 3), (2, 3), (3, 1)]):
        layout = build_layout(
            [(f"p{i}", s) for i, s in enumerate(shapes)],
            num_workers=num_workers,
            num_servers=num_servers,
            align=1,
        )
        assert any(f.param_start % 8 for seg in layout.segments for f in seg.fragments), (
            "the configuration must cut a parameter off the SIMD grid"
        )
        run = _make_run(shapes, seed=100 + seed)
        lrs = _lr_schedule()
        got = _offloaded(run, lrs, num_workers=num_workers, num_servers=num_servers, align=1)
        want = _reference(run, lrs)
        for g, w in zip(got.weights, want.weights, strict=True):
            differing += int((g != w).sum())
            torch.testing.assert_close(g, w, rtol=4 * 2**-23, atol=0.0)
    # 0 for these seeds with torch 2.13.0 on AVX512; other seeds give 1-2 (see above).
    print(f"layout at align=1: {differing} weight elements differ from the reference")


# --- learning rate -----------------------------------------------------------------------


def test_zero_lr_leaves_weights_bitwise_unchanged_but_updates_moments() -> None:
    run = _make_run(SHAPE_SETS["odd"], seed=3)
    lrs = [0.0] * STEPS
    got = _offloaded(run, lrs, num_workers=2, num_servers=2)
    for weight, initial in zip(got.weights, run.init, strict=True):
        assert torch.equal(weight, initial)
    assert all(bool(torch.any(m != 0)) for m in got.exp_avg)
    _assert_bitwise(got, _reference(run, lrs, num_workers=2))


def test_lr_is_applied_as_given_each_step() -> None:
    """A single step from zero moments moves each weight by -lr*sign(g) (plus decay), so
    two lrs give proportional moves; and a schedule other than the reference's differs."""
    run = _make_run([(1000,)], seed=4)
    lrs = _lr_schedule()
    other = [lr * 1.5 for lr in lrs]
    assert not torch.equal(
        _offloaded(run, other, num_workers=1, num_servers=1).weights[0],
        _reference(run, lrs).weights[0],
    )
    moves = []
    for lr in (1e-3, 2e-3):
        # From zero weights, so the move is not rounded against a weight of order 1.
        state = AdamWState([torch.zeros(1000)], [torch.zeros(1000)], [torch.zeros(1000)], torch.tensor(0.0))
        hyper = AdamWHyperParams(weight_decay=0.0)
        adamw_step(state, [run.grads[0][0].clone()], lr=lr, hyper=hyper, global_norm=0.0)
        moves.append(state.master[0].clone())
    torch.testing.assert_close(moves[1], 2 * moves[0], rtol=1e-6, atol=0.0)
    # First step: m_hat/sqrt(v_hat) = g/|g| = sign(g), up to eps.
    torch.testing.assert_close(moves[0], -1e-3 * torch.sign(run.grads[0][0]), rtol=1e-4, atol=0.0)


# --- clipping ------------------------------------------------------------------------------


@pytest.mark.parametrize("max_norm", [0.5, 1.0, 3.0, 1e6])
def test_clip_coefficient_is_the_factor_clip_grad_norm_applies(max_norm: float) -> None:
    gen = torch.Generator().manual_seed(int(max_norm * 10) % 1000)
    grads = [torch.randn(s, generator=gen) for s in [(101,), (37, 5), (1,), (1000,)]]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    total = torch.nn.utils.clip_grad_norm_(params, max_norm)

    coefficient = clip_coefficient(float(total), max_norm)
    assert coefficient is not None and coefficient.dtype == torch.float32
    assert float(coefficient) == min(1.0, float(torch.tensor(max_norm) / (total + CLIP_EPSILON)))
    if max_norm == 1e6:
        assert float(coefficient) == 1.0  # clamped: never scales up
    else:
        assert float(coefficient) < 1.0
    for p, g in zip(params, grads, strict=True):
        assert torch.equal(p.grad, g * coefficient)


def test_clip_coefficient_off_and_non_finite() -> None:
    assert clip_coefficient(123.0, 0.0) is None
    assert clip_coefficient(float("nan"), 0.0) is None  # off means off, the norm is unused
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="not finite"):
            clip_coefficient(bad, 1.0)


def test_sum_of_squares_adds_up_across_shards() -> None:
    g = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    whole = sum_of_squares(g)
    parts = sum_of_squares(g[:333]) + sum_of_squares(g[333:])
    assert math.isclose(whole, parts, rel_tol=1e-14)
    assert math.isclose(global_norm_from_squares(whole), float(torch.linalg.vector_norm(g.double())), rel_tol=1e-14)
    assert sum_of_squares(torch.zeros(0)) == 0.0
    assert sum_of_squares(torch.tensor([3.0, 4.0], dtype=torch.bfloat16)) == 25.0


@pytest.mark.parametrize("num_servers", [1, 3])
def test_clipped_update_with_torchs_norm_is_bitwise(num_servers: int) -> None:
    """Given the very norm torch computes, clipping and all 20 steps are bitwise."""
    hyper = AdamWHyperParams(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, max_grad_norm=1.0)
    run = _make_run(SHAPE_SETS["odd"], seed=11, grad_scale=0.1)
    lrs = _lr_schedule()
    norms = [float(torch.nn.utils.get_total_norm(g)) for g in run.grads]
    assert min(norms) < 1.0 < max(norms), "clipping must be on for some steps and off for others"
    got = _offloaded(run, lrs, num_workers=2, num_servers=num_servers, hyper=hyper, norm="torch")
    _assert_bitwise(got, _reference(run, lrs, hyper=hyper, num_workers=2))


# Max |weight diff| after 20 clipped steps with the norm summed from shards, measured with
# torch 2.13.0+cpu: see CLIP_MEASURED. The global norm is
# summed per shard in fp64 (sum_of_squares) instead of torch's fp32 norm of per-tensor
# norms, so the norm, and so the clip factor, can differ in the last ulp; Adam's update is
# nearly invariant to the gradient's scale, which keeps the drift at that level.
# Measured: 2.4e-7 (1-2 ulp of weights of order 1) over 72 runs (3 shape sets x 1-3
# workers x 8 seeds); 70 of the 72 were not bitwise. The tolerance is 10x that.
CLIP_MEASURED = 2.4e-7
CLIP_TOLERANCE = 2.5e-6


@pytest.mark.parametrize("shape_set", sorted(SHAPE_SETS))
@pytest.mark.parametrize("num_workers", [1, 3])
def test_clipped_update_with_norm_from_shards_is_close(shape_set: str, num_workers: int) -> None:
    hyper = AdamWHyperParams(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, max_grad_norm=1.0)
    shapes = SHAPE_SETS[shape_set]
    numel = sum(math.prod(s) for s in shapes)
    # Gradients of norm ~ 0.05..2 whatever the model size, so clipping is on for some steps.
    run = _make_run(shapes, seed=21 + num_workers, grad_scale=1.0 / math.sqrt(numel))
    lrs = _lr_schedule()
    got = _offloaded(run, lrs, num_workers=num_workers, num_servers=2, hyper=hyper, norm="shards")
    want = _reference(run, lrs, hyper=hyper)
    diff = _max_abs_diff(got, want)
    print(f"clipping, norm from shards, {shape_set} x{num_workers}: max |weight diff| {diff:.3g}")
    assert diff <= CLIP_TOLERANCE
    # Not vacuous: clipping changed the result compared with no clipping at all.
    unclipped = _reference(run, lrs, hyper=AdamWHyperParams(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1))
    assert _max_abs_diff(unclipped, want) > 100 * CLIP_TOLERANCE


def test_adamw_step_rejects_mismatched_gradient_count() -> None:
    state = AdamWState([torch.zeros(3)], [torch.zeros(3)], [torch.zeros(3)], torch.tensor(0.0))
    with pytest.raises(ValueError, match="2 gradient views for 1 state views"):
        adamw_step(state, [torch.zeros(3), torch.zeros(3)], lr=1e-3, hyper=HYPER, global_norm=0.0)
    assert int(state.step) == 0


def test_adamw_step_on_an_empty_shard_still_counts_the_step() -> None:
    state = AdamWState([], [], [], torch.tensor(0.0))
    adamw_step(state, [], lr=1e-3, hyper=AdamWHyperParams(max_grad_norm=1.0), global_norm=2.0)
    assert int(state.step) == 1


# --- hyper-parameter validation --------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("beta1", -0.1),
        ("beta1", 1.0),
        ("beta1", float("nan")),
        ("beta2", 1.0),
        ("beta2", -1e-9),
        ("beta2", float("nan")),
        ("eps", 0.0),
        ("eps", -1e-8),
        ("eps", float("nan")),
        ("weight_decay", -0.01),
        ("weight_decay", float("nan")),
        ("max_grad_norm", -1.0),
        ("max_grad_norm", float("nan")),
    ],
)
def test_hyper_params_reject_bad_values_naming_the_key(key: str, value: float) -> None:
    with pytest.raises(ConfigError, match=rf"optim\.{key} must be") as info:
        AdamWHyperParams(**{key: value})
    assert str(value) in str(info.value)


def test_hyper_params_accept_edges() -> None:
    hyper = AdamWHyperParams(beta1=0.0, beta2=0.0, eps=1e-30, weight_decay=0.0, max_grad_norm=0.0)
    assert hyper.max_grad_norm == 0.0
    with pytest.raises(TypeError):
        AdamWHyperParams(0.9)  # type: ignore[misc]  # keyword-only


@pytest.mark.parametrize("wire", [torch.float32, torch.bfloat16])
def test_the_servers_update_of_a_piece_equals_adamw_step_and_keeps_a_borrowed_gradient(wire: torch.dtype) -> None:
    """apply_update (what TieredStorage runs per partition) over a piece's fragments equals
    one adamw_step over the same views, touches nothing between fragments, and leaves a
    gradient it does not own bit for bit as it was; owned, it gives the same state."""
    torch.manual_seed(0)
    fragments = ((0, 64), (128, 72))
    master = torch.randn(200)
    gradient = torch.randn(200).to(wire)
    coefficient = clip_coefficient(10.0, 1.0)
    results = []
    for owned in (False, True):
        arrays = (master.clone(), torch.zeros(200), torch.zeros(200))
        given = gradient.clone()
        apply_update(
            *arrays,
            fragments,
            given,
            step=torch.tensor(1.0),
            coefficient=coefficient,
            lr=1e-2,
            hyper=HYPER,
            owned=owned,
        )
        if not owned:
            assert torch.equal(given, gradient)
        assert torch.equal(arrays[0][64:128], master[64:128])  # padding between fragments untouched
        results.append(arrays)
    assert all(torch.equal(a, b) for a, b in zip(*results))
    views = [lambda t, o=o, n=n: t[o : o + n] for o, n in fragments]
    state = AdamWState(
        [v(master.clone()) for v in views],
        [torch.zeros(n) for _, n in fragments],
        [torch.zeros(n) for _, n in fragments],
        torch.tensor(0.0),
    )
    adamw_step(
        state,
        [v(gradient.float().clone()) for v in views],
        lr=1e-2,
        hyper=AdamWHyperParams(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, max_grad_norm=1.0),
        global_norm=10.0,
    )
    assert all(torch.equal(v(results[0][0]), m) for v, m in zip(views, state.master))
