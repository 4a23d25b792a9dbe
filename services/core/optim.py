"""The AdamW update over views of a segment, knowing nothing of tiers or transport.

It calls the same fused CPU kernel as ``torch.optim.AdamW(fused=True)``; given views cut
at aligned parameter offsets (see :mod:`cargohold.services.core.layout`) the result is bitwise
equal to that optimizer stepping the whole parameters.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from cargohold.services.core.errors import ConfigError

CLIP_EPSILON = 1e-6
"""Added to the norm before dividing, as ``torch.nn.utils.clip_grad_norm_`` does."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AdamWHyperParams:
    """The per-segment constants of AdamW; the learning rate comes with every step."""

    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    max_grad_norm: float = 0.0
    """Clip gradients to this global L2 norm; 0 disables clipping."""

    def __post_init__(self) -> None:
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ConfigError(f"optim.{name} must be in [0, 1), got {value}")
        if not self.eps > 0.0:
            raise ConfigError(f"optim.eps must be > 0, got {self.eps}")
        if not self.weight_decay >= 0.0:
            raise ConfigError(f"optim.weight_decay must be >= 0, got {self.weight_decay}")
        if not self.max_grad_norm >= 0.0:
            raise ConfigError(f"optim.max_grad_norm must be >= 0, got {self.max_grad_norm}")


@dataclass(frozen=True, slots=True, kw_only=True)
class UpdateGroup:
    """What sets a param group's update apart inside a segment: its weight decay, and its
    learning rate as a multiple of the one each step brings (the CLI's
    ``optim.param_groups``, ``lr_mult``)."""

    weight_decay: float
    lr_scale: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0.0):
            raise ConfigError(f"a param group's weight_decay must be finite and >= 0, got {self.weight_decay}")
        if not (math.isfinite(self.lr_scale) and self.lr_scale >= 0.0):
            raise ConfigError(f"a param group's lr multiplier must be finite and >= 0, got {self.lr_scale}")


@dataclass(frozen=True, slots=True)
class FragmentGroup:
    """Fragments updated by one call of the fused kernel, as ``torch.optim.AdamW`` makes
    one per param group: ``(offset, length)`` runs with the group's constants."""

    fragments: tuple[tuple[int, int], ...]
    hyper: AdamWHyperParams
    lr_scale: float = 1.0


def fragment_groups(
    fragments: Sequence[tuple[int, int]],
    hyper: AdamWHyperParams,
    groups: Sequence[UpdateGroup] = (),
    fragment_group: Sequence[int] = (),
) -> tuple[FragmentGroup, ...]:
    """A segment's fragments sorted into kernel calls: by ``fragment_group`` (each
    fragment's index in ``groups``), each group with ``hyper`` but its own weight decay;
    without groups, all of them in one call with ``hyper``."""
    if not groups:
        return (FragmentGroup(tuple(fragments), hyper),)
    return tuple(
        FragmentGroup(
            tuple(f for f, g in zip(fragments, fragment_group) if g == index),
            replace(hyper, weight_decay=group.weight_decay),
            group.lr_scale,
        )
        for index, group in enumerate(groups)
    )


def clip_fragments(fragments: Sequence[tuple[int, int]], start: int, stop: int) -> tuple[tuple[int, int], ...]:
    """The parts of ``fragments`` inside ``[start, stop)``, relative to ``start``."""
    clipped = []
    for offset, length in fragments:
        lo, hi = max(offset, start), min(offset + length, stop)
        if lo < hi:
            clipped.append((lo - start, hi - lo))
    return tuple(clipped)


@dataclass(slots=True)
class AdamWState:
    """fp32 views of one segment's master weights and moments, plus the step count.

    The lists are parallel: entry i of each covers the same elements.
    """

    master: list[torch.Tensor]
    exp_avg: list[torch.Tensor]
    exp_avg_sq: list[torch.Tensor]
    step: torch.Tensor
    """fp32 scalar, as torch.optim keeps it; incremented before each update."""


def clip_coefficient(global_norm: float, max_grad_norm: float) -> torch.Tensor | None:
    """The factor ``clip_grad_norm_`` would multiply gradients by, or None when off.

    Computed in fp32 tensor arithmetic in the same order as torch does, so that a norm
    equal to torch's gives the identical factor. The norm the workers commit is the fp64
    one rounded to fp32, which can be one ulp from clip_grad_norm_'s fp32 norm; the factor
    is then an ulp away too (docs/api.md, "fp16 compute: which loop is bitwise").
    """
    if max_grad_norm <= 0.0:
        return None
    if not math.isfinite(global_norm):
        raise ValueError(f"global gradient norm is not finite: {global_norm}")
    total_norm = torch.tensor(global_norm, dtype=torch.float32)
    coefficient = max_grad_norm / (total_norm + CLIP_EPSILON)
    return torch.clamp(coefficient, max=1.0)


def inverse_scale(loss_scale: float) -> torch.Tensor | None:
    """What ``GradScaler.unscale_`` multiplies gradients by: the reciprocal of the loss
    scale, taken in double precision and rounded to fp32; None for no scale (1.0)."""
    if loss_scale == 1.0:
        return None
    return torch.tensor(loss_scale, dtype=torch.float64).reciprocal().to(torch.float32)


def unscale_coefficient(coefficient: torch.Tensor | None, inverse: torch.Tensor | None) -> torch.Tensor | None:
    """One factor for clipping and taking out the loss scale: ``coefficient`` (a
    :func:`clip_coefficient`, or None) times ``inverse`` (an :func:`inverse_scale`, or
    None). The inverse is a power of two, so the product is exact, and one multiplication
    by it gives the bits of GradScaler's unscale_ and then the clipping multiply of
    clip_grad_norm_ given the same norm (tests/test_fp16_recipe.py)."""
    if inverse is None:
        return coefficient
    if coefficient is None:
        return inverse
    return coefficient * inverse


def global_norm_from_squares(sum_of_squares: float) -> float:
    """The L2 norm from the sum of squared gradient elements over all segments."""
    return math.sqrt(sum_of_squares)


SQUARES_CHUNK = 1 << 22
"""Elements cast to fp64 at a time: a unit's whole gradient in fp64 would be gigabytes."""


def sum_of_squares(gradient: torch.Tensor) -> float:
    """Squared L2 norm of a gradient (a segment, or a worker's chunks), in fp64 so the pieces add exactly."""
    total = 0.0
    for piece in gradient.reshape(-1).split(SQUARES_CHUNK):
        wide = piece.to(torch.float64)
        total += float(torch.dot(wide, wide))
    return total


def apply_update(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    groups: Sequence[FragmentGroup],
    gradient: torch.Tensor,
    *,
    step: torch.Tensor,
    coefficient: torch.Tensor | None,
    lr: float,
    owned: bool,
) -> None:
    """The state server's update of one piece of a segment: AdamW at ``step`` over the real
    elements (the ``groups``' fragments) of ``master`` and the moments, with ``gradient``
    (parallel to them, in the wire dtype) clipped by ``coefficient``; one kernel call per
    group, at ``lr`` times its ``lr_scale``.

    A bf16 gradient is cast to fp32 (a new tensor, scaled in place). An fp32 one is read in
    place: scaled in place when ``owned`` (the caller hands it over), else clipped into new
    tensors, so that it stays exactly as it was and a retried update can pass it again.
    """
    if gradient.dtype != torch.float32:
        gradient, owned = gradient.to(torch.float32), True
    for group in groups:

        def views(t: torch.Tensor, fragments: Sequence[tuple[int, int]] = group.fragments) -> list[torch.Tensor]:
            return [t[offset : offset + length] for offset, length in fragments]

        grads = views(gradient)
        if owned:
            clip_(grads, coefficient)
        else:
            grads = clipped(grads, coefficient)
        state = AdamWState(views(master), views(exp_avg), views(exp_avg_sq), step)
        fused_adamw_(state, grads, lr=group_lr(lr, group.lr_scale), hyper=group.hyper)


def group_lr(lr: float, lr_scale: float) -> float:
    """A param group's learning rate: the step's times the group's multiplier, in double
    precision as torch's param group holds it (so ``base * mult`` there is the same number)."""
    return lr * lr_scale


def clip_(gradients: Sequence[torch.Tensor], coefficient: torch.Tensor | None) -> None:
    """Scale gradients in place by a :func:`clip_coefficient` (None: leave them).

    Elementwise, so clipping the views of a segment piece by piece gives the same bits as
    clipping them all at once.
    """
    if coefficient is not None and gradients:
        torch._foreach_mul_(list(gradients), coefficient)


def clipped(gradients: Sequence[torch.Tensor], coefficient: torch.Tensor | None) -> list[torch.Tensor]:
    """The gradients scaled by a :func:`clip_coefficient` into new tensors, leaving the
    given ones as they are; without clipping, the given tensors themselves.

    The same elementwise fp32 product as :func:`clip_`, so the same bits; it reads each
    gradient once and writes once, where copying first and then clipping in place moves
    every byte twice. The fused kernel only reads gradients, so without clipping a
    caller's gradient can go to it as is.
    """
    if coefficient is None or not gradients:
        return list(gradients)
    return list(torch._foreach_mul(list(gradients), coefficient))


def fused_adamw_(
    state: AdamWState,
    gradients: Sequence[torch.Tensor],
    *,
    lr: float,
    hyper: AdamWHyperParams,
) -> None:
    """The fused AdamW kernel alone over the views of ``state``, at ``state.step``.

    No clipping and no step increment: a caller that splits one segment's update over
    several pieces (the tier store's partitions) clips and counts the step once, then
    runs this per piece with the same step value.
    """
    if len(gradients) != len(state.master):
        raise ValueError(f"{len(gradients)} gradient views for {len(state.master)} state views")
    if not state.master:
        return
    torch._fused_adamw_(
        state.master,
        list(gradients),
        state.exp_avg,
        state.exp_avg_sq,
        [],
        [state.step] * len(state.master),
        lr=lr,
        beta1=hyper.beta1,
        beta2=hyper.beta2,
        weight_decay=hyper.weight_decay,
        eps=hyper.eps,
        amsgrad=False,
        maximize=False,
    )
