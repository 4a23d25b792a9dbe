"""The AdamW kernel wrapper against torch.optim.AdamW(fused=True): bitwise over aligned
shard views (and why the layout aligns them), the learning rate as given each step, and
the server's update of a piece equal to one step over the same views."""

from __future__ import annotations

import math

import pytest
import torch
from adamw_runs import (
    HYPER,
    SHAPE_SETS,
    STEPS,
    Shape,
    adamw_step,
    assert_bitwise,
    lr_schedule,
    make_run,
    offloaded,
    torch_reference,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from cargohold.services.core.layout import build_layout
from cargohold.services.core.optim import (
    AdamWHyperParams,
    AdamWState,
    FragmentGroup,
    UpdateGroup,
    apply_update,
    clip_coefficient,
    fragment_groups,
)

pytestmark = pytest.mark.timeout(60)


# --- bitwise equality with torch.optim.AdamW(fused=True) -------------------------------


@pytest.mark.parametrize("shape_set", sorted(SHAPE_SETS))
@pytest.mark.parametrize("num_workers", [1, 2, 3])
@pytest.mark.parametrize("num_servers", [1, 2, 3])
def test_sharded_update_is_bitwise_equal_to_torch_adamw(shape_set: str, num_workers: int, num_servers: int) -> None:
    run = make_run(SHAPE_SETS[shape_set], seed=num_workers * 10 + num_servers)
    lrs = lr_schedule()
    want = torch_reference(run, lrs, num_workers=num_workers)
    got = offloaded(run, lrs, num_workers=num_workers, num_servers=num_servers)
    assert_bitwise(got, want)
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
    run = make_run(shapes, seed=seed)
    lrs = lr_schedule()
    got = offloaded(run, lrs, num_workers=num_workers, num_servers=num_servers, align=align)
    assert_bitwise(got, torch_reference(run, lrs, num_workers=num_workers))


def test_default_hyper_params_are_bitwise_too() -> None:
    hyper = AdamWHyperParams()  # torch's AdamW defaults except weight_decay 0.01 (= torch's)
    run = make_run(SHAPE_SETS["odd"], seed=7)
    lrs = [1e-3] * STEPS
    assert_bitwise(
        offloaded(run, lrs, num_workers=2, num_servers=3, hyper=hyper),
        torch_reference(run, lrs, hyper=hyper, num_workers=2),
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
        run = make_run(shapes, seed=100 + seed)
        lrs = lr_schedule()
        got = offloaded(run, lrs, num_workers=num_workers, num_servers=num_servers, align=1)
        want = torch_reference(run, lrs)
        for g, w in zip(got.weights, want.weights, strict=True):
            differing += int((g != w).sum())
            torch.testing.assert_close(g, w, rtol=4 * 2**-23, atol=0.0)
    # 0 for these seeds with torch 2.13.0 on AVX512; other seeds give 1-2 (see above).
    print(f"layout at align=1: {differing} weight elements differ from the reference")


# --- learning rate -----------------------------------------------------------------------


def test_zero_lr_leaves_weights_bitwise_unchanged_but_updates_moments() -> None:
    run = make_run(SHAPE_SETS["odd"], seed=3)
    lrs = [0.0] * STEPS
    got = offloaded(run, lrs, num_workers=2, num_servers=2)
    for weight, initial in zip(got.weights, run.init, strict=True):
        assert torch.equal(weight, initial)
    assert all(bool(torch.any(m != 0)) for m in got.exp_avg)
    assert_bitwise(got, torch_reference(run, lrs, num_workers=2))


def test_lr_is_applied_as_given_each_step() -> None:
    """A single step from zero moments moves each weight by -lr*sign(g) (plus decay), so
    two lrs give proportional moves; and a schedule other than the reference's differs."""
    run = make_run([(1000,)], seed=4)
    lrs = lr_schedule()
    other = [lr * 1.5 for lr in lrs]
    assert not torch.equal(
        offloaded(run, other, num_workers=1, num_servers=1).weights[0],
        torch_reference(run, lrs).weights[0],
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


# --- the server's update of a piece --------------------------------------------------------


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
            [FragmentGroup(fragments, HYPER)],
            given,
            step=torch.tensor(1.0),
            coefficient=coefficient,
            lr=1e-2,
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


@pytest.mark.parametrize("wire", [torch.float32, torch.bfloat16])
def test_param_groups_in_one_piece_equal_torch_adamw_with_the_same_groups(wire: torch.dtype) -> None:
    """Fragments of two param groups interleaved in one piece (no decay and half the lr
    for the second, as the CLI's optim.param_groups make them) update as
    torch.optim.AdamW(fused=True) with those two param groups, bit for bit, over 5 steps
    with a changing lr; the padding between them stays as it was."""
    torch.manual_seed(1)
    fragments = ((0, 64), (64, 70), (192, 128), (320, 3))
    tagged = (0, 1, 0, 1)
    hyper = AdamWHyperParams(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, max_grad_norm=1.0)
    groups = fragment_groups(
        fragments, hyper, (UpdateGroup(weight_decay=0.1), UpdateGroup(weight_decay=0.0, lr_scale=0.5)), tagged
    )
    master = torch.randn(384)
    arrays = (master.clone(), torch.zeros(384), torch.zeros(384))
    params = [torch.nn.Parameter(master[o : o + n].clone()) for o, n in fragments]
    reference = torch.optim.AdamW(
        [
            {"params": [p for p, g in zip(params, tagged) if g == index], "weight_decay": decay}
            for index, decay in enumerate((0.1, 0.0))
        ],
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=True,
    )
    for step in range(1, 6):
        lr = 1e-2 / step
        gradient = torch.randn(384).to(wire)
        coefficient = clip_coefficient(
            float(torch.cat([gradient[o : o + n].float() for o, n in fragments]).norm()), 1.0
        )
        apply_update(
            *arrays, groups, gradient, step=torch.tensor(float(step)), coefficient=coefficient, lr=lr, owned=False
        )
        for param, (offset, length) in zip(params, fragments):
            param.grad = gradient[offset : offset + length].float() * coefficient  # clip_grad_norm_'s product
        for group, scale in zip(reference.param_groups, (1.0, 0.5)):
            group["lr"] = lr * scale
        reference.step()
    for param, (offset, length) in zip(params, fragments):
        assert torch.equal(arrays[0][offset : offset + length], param.detach())
        assert torch.equal(arrays[2][offset : offset + length], reference.state[param]["exp_avg_sq"])
    assert torch.equal(arrays[0][134:192], master[134:192])
