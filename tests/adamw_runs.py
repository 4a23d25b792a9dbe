"""Training runs of the optimizer tests, stepped two ways: plain torch (per-parameter
tensors, clip_grad_norm_, ``torch.optim.AdamW(fused=True)``) and cargohold's (flat fp32
buffers, one :class:`AdamWState` per segment over fragment views), with the assertions
that compare them. Used by the ``test_optim*`` modules."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch

from cargohold.services.core.layout import DEFAULT_ALIGN, build_layout, fragment_views, gather_params, scatter_params
from cargohold.services.core.optim import (
    AdamWHyperParams,
    AdamWState,
    clip_,
    clip_coefficient,
    fused_adamw_,
    global_norm_from_squares,
    sum_of_squares,
)

Shape = tuple[int, ...]

STEPS = 20
"""Steps of every run."""
HYPER = AdamWHyperParams(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
"""The hyper-parameters of the runs unless a test says otherwise: no clipping."""
SHAPE_SETS: dict[str, list[Shape]] = {
    "odd": [(101,), (37, 5), (1,), (1000,)],
    "mixed": [(64, 64), (3,), (257,), (1, 1), (513, 7), (2, 3, 5)],
    "single": [(4099,)],
}
"""The parameter shapes of the models the runs train, by name."""


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


def lr_schedule(base: float = 3e-3) -> list[float]:
    """Linear warm-up then cosine decay: a different lr every step."""
    warmup = 5
    return [base * min(1.0, (k + 1) / warmup) * 0.5 * (1.0 + math.cos(math.pi * k / STEPS)) for k in range(STEPS)]


@dataclass
class Run:
    """Initial weights and one gradient per parameter per step."""

    shapes: list[Shape]
    init: list[torch.Tensor]
    grads: list[list[torch.Tensor]]


def make_run(shapes: Sequence[Shape], seed: int, grad_scale: float = 1.0) -> Run:
    """A run of ``STEPS`` steps over parameters of ``shapes``, a pure function of ``seed``;
    each step's gradients are scaled by ``grad_scale`` times a random 0.05..2."""
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
    """The state a run ends with, one tensor per parameter of each array."""

    weights: list[torch.Tensor]
    exp_avg: list[torch.Tensor]
    exp_avg_sq: list[torch.Tensor]


def torch_reference(run: Run, lrs: Sequence[float], hyper: AdamWHyperParams = HYPER, *, num_workers: int = 1) -> Result:
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


def offloaded(
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


def assert_bitwise(got: Result, want: Result) -> None:
    """Fail naming the first array and parameter where ``got`` and ``want`` differ in a bit."""
    for name in ("weights", "exp_avg", "exp_avg_sq"):
        for i, (g, w) in enumerate(zip(getattr(got, name), getattr(want, name), strict=True)):
            assert g.dtype == w.dtype == torch.float32
            if not torch.equal(g, w):
                differing = int((g != w).sum())
                pytest.fail(
                    f"{name}[{i}] (shape {tuple(w.shape)}): {differing} elements differ, "
                    f"max |diff| {float((g - w).abs().max()):.3g}"
                )


def max_abs_diff(got: Result, want: Result) -> float:
    """The largest absolute difference between the weights of ``got`` and ``want``."""
    return max(float((g - w).abs().max()) for g, w in zip(got.weights, want.weights, strict=True))
