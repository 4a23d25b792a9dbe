"""fp16 against torch's documented recipe (fp32 masters with an fp16 copy, GradScaler's
``unscale_``, then ``clip_grad_norm_``, then AdamW(fused=True)): where the two part, and by
how much. The loop cargohold equals bitwise is the same one with the clip coefficient taken
from the fp64 norm the workers all-reduce (``reference_train(norm="shards")``, which
tests/test_fp16.py holds a run to bitwise); clip_grad_norm_'s fp32 norm can be one ulp away
from it, and only when clipping triggers does that reach the weights. docs/api.md, "fp16
compute: which loop is bitwise", says the same. Ray-free: the state servers' side is
``SegmentState`` in this process."""

from __future__ import annotations

import pytest
import torch
from reference import RecipeRun, ReferenceResult, grad_scaler_recipe, reference_train, tiny_config

from cargohold.cluster.sections import config_layout, model_spec, port_config
from cargohold.services.core.layout import Layout, scatter_params
from cargohold.services.core.optim import global_norm_from_squares, sum_of_squares
from cargohold.services.models.build import build_model
from cargohold.services.segments.segment_state import SegmentState
from cargohold.services.worker.param_groups import resolve_param_groups
from cargohold.services.worker.state_port import segment_spec

RECIPE = {
    "worker__compute_dtype": "float16",
    "worker__grad_wire_dtype": "float16",
    "optim__loss_scale__init_scale": 2.0**18,
    "optim__loss_scale__growth_interval": 2,
    "optim__max_grad_norm": 1.0,
    "worker__num_workers": 1,
    "steps": 8,
}
"""One process; step 1 overflows, so step 2 is the first applied update; clipping triggers
at every applied step (norms 1.1 to 3.4 against 1.0)."""
STATES = {"master": "masters", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
"""The servers' names of the state, and the references'."""

LOSS_TOLERANCE = 1e-4
"""How far a loss of the bitwise reference may be from the recipe's in 8 steps (measured
5.9e-5, about 1e-5 of the loss)."""
MASTER_TOLERANCE = 1e-2
"""How far any master weight may be: the peak lr (measured 4.1e-3, a key's bias)."""
MASTER_TOLERANCE_999 = 5e-4
"""How far 99.9% of the master weights may be (measured 2.1e-4)."""


def _norm_as_the_workers_send_it(layout: Layout, scaled: torch.Tensor, scale: float) -> float:
    """The global norm a worker all-reduces and commits: the squares of the fp16 gradients
    it pushes, segment by segment, summed in fp64, the root divided by the scale."""
    squares = sum(sum_of_squares(scaled[s.start : s.stop]) for s in layout.segments)
    return global_norm_from_squares(squares) / scale


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between two fp32 tensors, element by element, in ulps (the
    elements' signs agree here)."""
    return int((a.contiguous().view(torch.int32).long() - b.contiguous().view(torch.int32).long()).abs().max())


def test_the_first_applied_update_differs_from_the_recipe_only_in_the_norm() -> None:
    """The state servers commit the recipe's own fp16 gradients of step 2 with its scale.
    Given clip_grad_norm_'s norm they end bitwise where unscale_, clip_grad_norm_ and
    AdamW(fused=True) end: the one multiply by (clip coefficient x 1/scale) gives the bits
    of unscale_'s and clipping's two (1/scale is a power of two). The one difference is the
    norm: the workers' (fp64, rounded once to fp32) is 3.4075048, clip_grad_norm_'s (fp32
    per parameter, then fp32 over the parameters) 3.4075050, one fp32 ulp apart; the
    coefficients are then one ulp apart, the masters at most 2**-24 (an ulp of the layer
    norms' weights just under 1.0), the moments at most 2 and 7 ulps."""
    config = tiny_config(**RECIPE)
    recipe = grad_scaler_recipe(config, 2)
    assert [s.skipped for s in recipe.steps] == [True, False]
    first = recipe.steps[1]
    _, _, layout = config_layout(config)
    scaled = scatter_params(layout, first.gradients, dtype=torch.float16)
    ours = _norm_as_the_workers_send_it(layout, scaled, first.scale)
    assert ours == pytest.approx(3.4075048, abs=1e-7) and first.norm == pytest.approx(3.4075050, abs=1e-7)
    assert _ulps(torch.tensor(ours), torch.tensor(first.norm)) == 1
    exact = sum(float(g.double().div(first.scale).square().sum()) for g in first.gradients.values()) ** 0.5
    assert float(torch.tensor(ours)) == float(torch.tensor(exact)), "the workers' norm is the fp64 one, rounded"

    groups = resolve_param_groups(config.optim, layout.params)
    initial = scatter_params(layout, dict(build_model(model_spec(config), config.data).named_parameters()))

    def committed(global_norm: float) -> dict[str, torch.Tensor]:
        flats = {key: torch.zeros(layout.total) for key in STATES}
        for segment in layout.segments:
            state = SegmentState(
                segment_spec(port_config(config), "recipe", segment, groups), initial[segment.start : segment.stop]
            )
            state.stage_gradient(1, scaled[segment.start : segment.stop].clone())
            state.commit(1, global_norm=global_norm, lr=config.optim.lr_at(2, config.steps), loss_scale=first.scale)
            for key, value in state.snapshot().items():
                flats[key][segment.start : segment.stop] = value
        return flats

    want = {key: scatter_params(layout, recipe.state[name]) for key, name in STATES.items()}
    given_torchs_norm, given_ours = committed(first.norm), committed(ours)
    for key in STATES:
        assert torch.equal(given_torchs_norm[key], want[key]), key
        assert not torch.equal(given_ours[key], want[key]), key
    assert float((given_ours["master"] - want["master"]).abs().max()) <= 2.0**-24  # an ulp just under 1.0
    assert _ulps(given_ours["exp_avg"], want["exp_avg"]) <= 2
    assert _ulps(given_ours["exp_avg_sq"], want["exp_avg_sq"]) <= 7


def test_the_recipe_drifts_from_the_bitwise_reference_within_the_stated_tolerance() -> None:
    """Eight steps of the bitwise reference against the recipe. The skips and scales are
    the same, and the losses through step 2, the first applied update, whose masters are
    one ulp apart (the norm, above). After it the runs drift apart most where the true
    gradient is zero: a key's bias (softmax ignores a shift common to every key) has fp16
    rounding noise for gradient, which Adam turns into steps of about lr either way.
    The recipe clipping by the fp64 norm instead (``clip_grads_with_norm_``) is bitwise
    the reference; so is the recipe itself when clipping does not trigger."""
    config = tiny_config(**RECIPE)
    recipe = grad_scaler_recipe(config, config.steps)
    ours = reference_train(config, config.steps, norm="shards")
    assert [s.skipped for s in recipe.steps] == [True, False, False, True, False, False, False, False]
    assert [s.scale for s in recipe.steps] == [2.0**18, 2.0**17, 2.0**17, 2.0**18, 2.0**17, 2.0**17, 2.0**18, 2.0**18]
    losses = [s.loss for s in recipe.steps]
    assert losses[:2] == ours.losses[:2] and losses[2] != ours.losses[2]
    assert max(abs(a - b) for a, b in zip(losses, ours.losses)) <= LOSS_TOLERANCE
    drift = torch.cat([(ours.state["masters"][n] - m).abs().flatten() for n, m in recipe.state["masters"].items()])
    assert float(drift.max()) <= MASTER_TOLERANCE
    assert float(drift.quantile(0.999)) <= MASTER_TOLERANCE_999

    _assert_same_run(grad_scaler_recipe(config, config.steps, fp64_norm=True), ours)
    unclipped = tiny_config(**{**RECIPE, "optim__max_grad_norm": 1.0e6})
    _assert_same_run(grad_scaler_recipe(unclipped, unclipped.steps), reference_train(unclipped, 8, norm="shards"))


def _assert_same_run(recipe: RecipeRun, ours: ReferenceResult) -> None:
    assert [s.loss for s in recipe.steps] == ours.losses
    for name in STATES.values():
        for param, value in recipe.state[name].items():
            assert torch.equal(ours.state[name][param], value), (name, param)
