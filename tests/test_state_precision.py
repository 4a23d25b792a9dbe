"""The moments' stored precision (``services/core/state_precision.py``): each encoding's round
trip within its stated bound, one update against a float64 AdamW within the bound the
quantization implies, fp32 bitwise ``torch.optim.AdamW(fused=True)``, the update's pieces
invisible in the result, clear errors for bad input, and 200-step runs of a small
regression whose loss with bf16 and 8-bit moments follows fp32's.

Bounds stated and tested (x an element, A its block's absmax):

* bfloat16: ``|decode(encode(x)) - x| <= 2**-8 * |x|`` (half a bf16 ulp);
* blockwise8: ``<= code_bound * A``, ``code_bound`` 0.00713 (exp_avg) and 0.00707
  (exp_avg_sq): the dynamic map's largest half gap (0.00703) plus the look-up's interval
  and fp32 rounding;
* one update from stored moments: the master weights within ``2**-20`` of the sizes of
  their terms (``|p| + |update|``, the update's exp_avg taken as ``b1 |m| + (1 - b1) |g|``)
  of float64 AdamW from the same decoded moments, the new moments within their round-trip
  bound of float64's (plus ``2**-21`` of their terms); from fp32 moments that were then
  stored, the update lies in the interval float64 AdamW spans over the moments' round-trip
  intervals (widened by the same ``2**-20``);
* 200 steps of a 1176-parameter regression: the loss within 1% (bf16) and 30% (8-bit) of
  fp32's at every step, within 0.1% at the end, the weights within 0.1% (relative L2).
"""

from __future__ import annotations

import math

import pytest
import torch

from cargohold.services.core.errors import ConfigError
from cargohold.services.core.optim import AdamWHyperParams
from cargohold.services.core.state_precision import (
    BLOCK_ELEMENTS,
    MOMENTS,
    PIECE_ELEMENTS,
    STATE_DTYPES,
    Moment,
    StateDtype,
    StoredMoment,
    adamw_step_,
    bytes_per_parameter,
    code_bound,
    decode,
    decode_range,
    encode,
    error_bound,
    parse_state_dtype,
    stored_bytes,
    zeros,
)

pytestmark = pytest.mark.timeout(120)

HYPER = AdamWHyperParams(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
QUANTIZED: tuple[StateDtype, ...] = ("bfloat16", "blockwise8")
N = 40 * BLOCK_ELEMENTS + 77
"""Elements of the ranges the tests use: a short last block."""


def moment_values(moment: Moment, n: int = N, seed: int = 0) -> torch.Tensor:
    """Values as moments hold them: magnitudes over 12 decades within a block (squared
    for exp_avg_sq), exact zeros, one all-zero block, signs for exp_avg."""
    gen = torch.Generator().manual_seed(seed)
    scale = 10.0 ** (torch.rand(n, generator=gen) * 12 - 10)
    values = torch.randn(n, generator=gen) * scale
    values[::97] = 0.0
    values[BLOCK_ELEMENTS : 2 * BLOCK_ELEMENTS] = 0.0
    return values if moment == "exp_avg" else values * values


def stored_state(dtype: StateDtype, n: int = N, seed: int = 1) -> tuple[StoredMoment, StoredMoment]:
    return encode(moment_values("exp_avg", n, seed), dtype, "exp_avg"), encode(
        moment_values("exp_avg_sq", n, seed) * 1e6, dtype, "exp_avg_sq"
    )


# --- sizes ------------------------------------------------------------------------------


def test_bytes_per_parameter_of_each_kind() -> None:
    assert [bytes_per_parameter(d) for d in STATE_DTYPES] == [12.0, 8.0, 4 + 2 + 8 / 256]
    assert [stored_bytes(d, N) for d in STATE_DTYPES] == [12 * N, 8 * N, 6 * N + 2 * 4 * 41]
    for dtype in STATE_DTYPES:  # what a tier would write: the stored tensors themselves
        m, v = zeros(dtype, "exp_avg", N), zeros(dtype, "exp_avg_sq", N)
        tensors = [m.values, m.scales, v.values, v.scales]
        assert 4 * N + sum(t.numel() * t.element_size() for t in tensors) == stored_bytes(dtype, N)


# --- round trips ------------------------------------------------------------------------


@pytest.mark.parametrize("moment", MOMENTS)
@pytest.mark.parametrize("dtype", STATE_DTYPES)
def test_a_round_trip_errs_within_its_bound(dtype: StateDtype, moment: Moment) -> None:
    values = moment_values(moment)
    stored = encode(values, dtype, moment)
    error = (decode(stored) - values).abs()
    bound = error_bound(dtype, moment, values)
    assert bool((error <= bound).all()), f"worst error / bound {float((error / bound).nan_to_num(0).max())}"
    if dtype == "float32":
        assert torch.equal(decode(stored), values)
    else:  # the bound is reached, not loose
        assert float((error / bound)[bound > 0].max()) > 0.9


def test_the_stated_bounds() -> None:
    assert code_bound("exp_avg") == pytest.approx(0.00713, abs=1e-5)
    assert code_bound("exp_avg_sq") == pytest.approx(0.00707, abs=1e-5)
    x = torch.tensor([1.0, 3.0, -1e-20, 2.0**-130])
    assert torch.equal(
        error_bound("bfloat16", "exp_avg", x), torch.tensor([2.0**-8, 3 * 2.0**-8, 1e-20 * 2.0**-8, 2.0**-134])
    )


def test_blockwise8_scales_are_block_absmaxes_and_zeros_are_zero_bytes() -> None:
    values = moment_values("exp_avg")
    stored = encode(values, "blockwise8", "exp_avg")
    absmax = torch.cat([values[i : i + BLOCK_ELEMENTS].abs().amax()[None] for i in range(0, N, BLOCK_ELEMENTS)])
    assert torch.equal(stored.scales, absmax)
    assert bool((stored.values[values == 0] == 0).all())
    for moment in MOMENTS:  # a zeroed file is a zero moment, and back
        blank = StoredMoment("blockwise8", moment, torch.zeros(N, dtype=torch.uint8), torch.zeros(41))
        assert not decode(blank).any()
        assert not encode(torch.zeros(N), "blockwise8", moment).values.any()


def test_a_positive_second_moment_never_decodes_to_zero() -> None:
    """Else the element's update would be exp_avg / eps. The squared map reaches 1e-13 of
    the absmax and rounds what is below up; exp_avg's map rounds such values to 0."""
    values = torch.tensor([1.0, 1e-12, 1e-20, 1e-30, 0.0])
    assert bool((decode(encode(values, "blockwise8", "exp_avg_sq"))[:4] > 0).all())
    assert decode(encode(values, "blockwise8", "exp_avg"))[2] == 0.0


# --- one update against float64 ---------------------------------------------------------


def adamw_float64(p, m, v, g, *, step: int, lr: float, hyper: AdamWHyperParams):
    """torch's AdamW in float64: new master weights and moments, the update subtracted,
    and the sizes of the terms each is a sum of (what fp32's rounding errs relative to):
    ``|p| + |update of |terms| of m|``, ``b1 |m| + (1 - b1) |g|`` and ``b2 v + (1 - b2) g**2``."""
    p, m, v, g = (t.double() for t in (p, m, v, g))
    m_terms = hyper.beta1 * m.abs() + (1 - hyper.beta1) * g.abs()
    m = hyper.beta1 * m + (1 - hyper.beta1) * g
    v = hyper.beta2 * v + (1 - hyper.beta2) * g * g
    update = update_float64(m, v, step=step, lr=lr, hyper=hyper)
    p_terms = p.abs() + update_float64(m_terms, v, step=step, lr=lr, hyper=hyper)
    return p * (1 - lr * hyper.weight_decay) - update, m, v, update, (p_terms, m_terms, v)


def update_float64(m, v, *, step: int, lr: float, hyper: AdamWHyperParams) -> torch.Tensor:
    denom = v.sqrt() / math.sqrt(1 - hyper.beta2**step) + hyper.eps
    return lr / (1 - hyper.beta1**step) * m / denom


def one_update(dtype: StateDtype, m: StoredMoment, v: StoredMoment, *, step: int = 7, lr: float = 1e-3):
    gen = torch.Generator().manual_seed(2)
    master, gradient = torch.randn(m.numel, generator=gen), moment_values("exp_avg", m.numel, seed=3) * 1e3
    before = master.clone()
    adamw_step_(master, m, v, gradient, step=torch.tensor(float(step)), lr=lr, hyper=HYPER)
    return before, gradient, master


@pytest.mark.parametrize("dtype", STATE_DTYPES)
def test_one_update_from_stored_moments_is_float64_adamw_of_them(dtype: StateDtype) -> None:
    """The kernel runs in fp32 on exactly the decoded moments: its ~8 roundings of 2**-24
    each stay within 2**-20 of the sizes of the terms (a new exp_avg may cancel); the
    moments it leaves are then stored, erring by at most their round-trip bound."""
    m, v = stored_state(dtype)
    m0, v0 = decode(m), decode(v)
    p0, g, p1 = one_update(dtype, m, v)
    p_ref, m_ref, v_ref, _, (p_terms, m_terms, v_terms) = adamw_float64(p0, m0, v0, g, step=7, lr=1e-3, hyper=HYPER)
    assert bool(((p1.double() - p_ref).abs() <= 2.0**-20 * p_terms).all())
    for moment, stored, ref, terms in (("exp_avg", m, m_ref, m_terms), ("exp_avg_sq", v, v_ref, v_terms)):
        bound = error_bound(dtype, moment, ref.float()).double() * (1 + 2.0**-20) + 2.0**-21 * terms
        error = (decode(stored).double() - ref).abs()
        worst = float(torch.where(bound > 0, error / bound, error).max())
        assert bool((error <= bound).all()), f"{moment}: worst error / bound {worst}"


@pytest.mark.parametrize("dtype", STATE_DTYPES)
def test_one_update_from_fp32_moments_lies_within_their_quantization_interval(dtype: StateDtype) -> None:
    """The update is increasing in exp_avg and, in magnitude, decreasing in exp_avg_sq, so
    over moments within their round-trip bounds (e_m, e_v) it spans exactly
    [update(m1 - b1 e_m, v1 +- b2 e_v), update(m1 + b1 e_m, v1 -+ b2 e_v)] (v's sign
    against m's); float64 AdamW from the exact fp32 moments gives those ends, and the
    stored update must lie between them (widened by fp32's rounding)."""
    exact_m, exact_v = moment_values("exp_avg", seed=1), moment_values("exp_avg_sq", seed=1) * 1e6
    e_m, e_v = (error_bound(dtype, k, t).double() for k, t in (("exp_avg", exact_m), ("exp_avg_sq", exact_v)))
    m, v = encode(exact_m, dtype, "exp_avg"), encode(exact_v, dtype, "exp_avg_sq")
    p0, g, p1 = one_update(dtype, m, v)
    _, m1, v1, _, (p_terms, _, _) = adamw_float64(p0, exact_m, exact_v, g, step=7, lr=1e-3, hyper=HYPER)
    m_hi, m_lo = m1 + HYPER.beta1 * e_m, m1 - HYPER.beta1 * e_m
    v_hi, v_lo = v1 + HYPER.beta2 * e_v, (v1 - HYPER.beta2 * e_v).clamp(min=0)
    top = update_float64(m_hi, torch.where(m_hi > 0, v_lo, v_hi), step=7, lr=1e-3, hyper=HYPER)
    bottom = update_float64(m_lo, torch.where(m_lo > 0, v_hi, v_lo), step=7, lr=1e-3, hyper=HYPER)
    stored_update = p0.double() * (1 - 1e-3 * HYPER.weight_decay) - p1.double()
    slack = 2.0**-20 * p_terms
    assert bool((stored_update <= top + slack).all() and (stored_update >= bottom - slack).all())
    if dtype == "float32":
        assert torch.equal(top, bottom)


# --- bitwise and pieces -----------------------------------------------------------------


def test_float32_is_torch_fused_adamw_bitwise() -> None:
    gen = torch.Generator().manual_seed(4)
    init = torch.randn(N, generator=gen)
    param = torch.nn.Parameter(init.clone())
    reference = torch.optim.AdamW([param], lr=1.0, betas=(HYPER.beta1, HYPER.beta2), eps=HYPER.eps,
                                  weight_decay=HYPER.weight_decay, fused=True)  # fmt: skip
    master, m, v = init.clone(), zeros("float32", "exp_avg", N), zeros("float32", "exp_avg_sq", N)
    step = torch.tensor(0.0)
    for k in range(6):
        lr = 1e-3 * (k + 1)
        gradient = torch.randn(N, generator=gen)
        param.grad = gradient.clone()
        reference.param_groups[0]["lr"] = lr
        reference.step()
        step += 1
        adamw_step_(master, m, v, gradient, step=step, lr=lr, hyper=HYPER)
    state = reference.state[param]
    assert torch.equal(master, param.detach())
    assert torch.equal(m.values, state["exp_avg"]) and torch.equal(v.values, state["exp_avg_sq"])


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_the_pieces_do_not_change_the_result(dtype: StateDtype) -> None:
    results = []
    for piece in (3 * BLOCK_ELEMENTS, PIECE_ELEMENTS):
        m, v = stored_state(dtype)
        gen = torch.Generator().manual_seed(5)
        master, gradient = torch.randn(N, generator=gen), torch.randn(N, generator=gen)
        for k in range(3):
            adamw_step_(master, m, v, gradient, step=torch.tensor(k + 1.0), lr=1e-3, hyper=HYPER, piece_elements=piece)
        results.append([master, m.values, m.scales, v.values, v.scales])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_bf16_second_moment_does_not_decay_below_half_an_ulp_but_8bit_scales_do() -> None:
    """The limit the module states for bfloat16: 0.999 * v rounds back to v. The 8-bit
    block's scale is fp32 and carries the decay."""
    for dtype, expected in (("bfloat16", 1.0), ("blockwise8", HYPER.beta2), ("float32", HYPER.beta2)):
        m, v = zeros(dtype, "exp_avg", 256), encode(torch.ones(256), dtype, "exp_avg_sq")
        adamw_step_(torch.zeros(256), m, v, torch.zeros(256), step=torch.tensor(2.0), lr=1e-3, hyper=HYPER)
        assert decode(v).tolist() == pytest.approx([expected] * 256, rel=1e-6), dtype


# --- bad input --------------------------------------------------------------------------


def test_an_unknown_kind_names_the_setting_and_the_kinds() -> None:
    with pytest.raises(ConfigError, match=r"optim.state_dtype must be one of float32, bfloat16, blockwise8, got 'fp8'"):
        parse_state_dtype("fp8")
    with pytest.raises(ConfigError, match="'int4'"):
        zeros("int4", "exp_avg", 8)  # type: ignore[arg-type]


def test_bad_stored_moments_say_what_is_wrong() -> None:
    codes = torch.zeros(N, dtype=torch.uint8)
    with pytest.raises(ValueError, match="blockwise8 exp_avg of 10317 elements needs 41 block scales, got 40"):
        StoredMoment("blockwise8", "exp_avg", codes, torch.zeros(40))
    with pytest.raises(ValueError, match=r"bfloat16 exp_avg_sq's values must be torch.bfloat16, got torch.float32"):
        StoredMoment("bfloat16", "exp_avg_sq", torch.zeros(N), torch.zeros(0))
    with pytest.raises(ValueError, match="unknown moment 'exp_avg2'"):
        StoredMoment("float32", "exp_avg2", torch.zeros(N), torch.zeros(0))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"must be a flat contiguous CPU tensor, got shape \(4, 4\)"):
        StoredMoment("float32", "exp_avg", torch.zeros(4, 4), torch.zeros(0))
    with pytest.raises(ValueError, match=r"range \[100, 356\) .* start at a multiple of 256"):
        decode_range(zeros("blockwise8", "exp_avg", N), 100, torch.empty(256))


def test_bad_update_arguments_say_what_is_wrong() -> None:
    m, v = zeros("blockwise8", "exp_avg", N), zeros("blockwise8", "exp_avg_sq", N)
    master, gradient = torch.zeros(N), torch.zeros(N)

    def step(**changes):
        args = {"master": master, "exp_avg": m, "exp_avg_sq": v, "gradient": gradient, "step": torch.tensor(1.0)}
        adamw_step_(**(args | changes), lr=1e-3, hyper=HYPER)

    with pytest.raises(ValueError, match=r"equal lengths, got \{'master': 10317, 'gradient': 10316"):
        step(gradient=torch.zeros(N - 1))
    with pytest.raises(ValueError, match="the gradient must be torch.float32, got torch.bfloat16"):
        step(gradient=gradient.bfloat16())
    with pytest.raises(ValueError, match="exp_avg is stored as blockwise8 but exp_avg_sq as bfloat16"):
        step(exp_avg_sq=zeros("bfloat16", "exp_avg_sq", N))
    with pytest.raises(ValueError, match=r"moments given as \(exp_avg_sq, exp_avg\)"):
        step(exp_avg=v, exp_avg_sq=m)
    with pytest.raises(ValueError, match="step must be a finite fp32 scalar tensor, got torch.int64"):
        step(step=torch.tensor(1))
    with pytest.raises(ValueError, match="piece_elements must be a positive multiple of 256, got 1000"):
        step(piece_elements=1000)
    with pytest.raises(
        ValueError, match=r"master weights must be a flat contiguous CPU tensor, got shape \(1, 10317\)"
    ):
        step(master=master[None])
    assert not master.any() and not m.values.any()  # nothing was changed


# --- trajectories -----------------------------------------------------------------------


def regression_run(dtype: StateDtype, seed: int, steps: int = 200) -> tuple[torch.Tensor, torch.Tensor]:
    """AdamW (beta2 0.999, cosine lr from 0.1) on least squares with 48 features whose
    scales span a decade, 24 targets, weights and biases in one flat range of 1176
    (4 blocks and a short one), updated in pieces of 512: the loss of every step and the
    last weights."""
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(512, 48, generator=gen) * torch.logspace(-1, 0, 48)
    targets = features @ torch.randn(48, 24, generator=gen) + 0.1 * torch.randn(512, 24, generator=gen)
    n = 48 * 24 + 24
    master, m, v = torch.zeros(n), zeros(dtype, "exp_avg", n), zeros(dtype, "exp_avg_sq", n)
    hyper = AdamWHyperParams(beta2=0.999, weight_decay=0.0)
    losses = []
    for k in range(steps):
        weights = master.clone().requires_grad_()
        loss = ((features @ weights[:1152].view(48, 24) + weights[1152:] - targets) ** 2).mean()
        loss.backward()
        losses.append(loss.item())
        lr = 0.1 * 0.5 * (1 + math.cos(math.pi * k / steps))
        adamw_step_(master, m, v, weights.grad, step=torch.tensor(k + 1.0), lr=lr, hyper=hyper, piece_elements=512)
    return torch.tensor(losses), master


@pytest.mark.parametrize(("dtype", "along"), [("bfloat16", 0.01), ("blockwise8", 0.3)])
def test_200_steps_follow_fp32(dtype: StateDtype, along: float) -> None:
    """Measured: at most 0.4% (bf16) and 13% (8-bit) apart along the way, where the loss
    falls fastest (steps 30-60), 3e-5 at the end, the weights 2e-4 apart."""
    for seed in (0, 1):
        reference, reference_weights = regression_run("float32", seed)
        losses, weights = regression_run(dtype, seed)
        apart = (losses - reference).abs() / reference
        assert reference[-1] < 1e-3 * reference[0]  # it did converge
        assert float(apart.max()) <= along, f"seed {seed}: {float(apart.max())} at step {int(apart.argmax())}"
        assert float(apart[-1]) <= 1e-3
        assert float((weights - reference_weights).norm() / reference_weights.norm()) <= 1e-3
