"""OffloadedAdamW's parameter groups, checked and laid out over the state servers.

Each param group is a unit of the flat space (:func:`cargohold.services.core.layout.build_layout`
with one worker): its parameters one after the other, each starting at a multiple of 64
elements, the whole space cut over the servers at multiples of 64. So a group's segments
hold its parameters only, and are registered with its betas, eps and weight decay; the lr
comes with every push. And every cut of a parameter falls at a multiple of 64 elements
from its start, where the fused kernel's SIMD loop would be anyway: the servers' update
is ``torch.optim.AdamW(fused=True)``'s per parameter, bit for bit (docs/architecture.md,
"Why 64").

Pure bookkeeping on names, shapes and options; no tensor is read.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from cargohold.services.core.errors import LayoutError, OptimizerError
from cargohold.services.core.layout import Layout, build_layout
from cargohold.services.core.optim import AdamWHyperParams

HELD_OPTIONS = ("betas", "eps", "weight_decay")
"""Group options the servers hold from the first step on; only ``lr`` may change after."""
UNSUPPORTED = ("amsgrad", "maximize")
"""``torch.optim.AdamW`` options the servers' update does not have; refused when true."""

NamedShapes = Sequence[tuple[str, tuple[int, ...]]]


def group_name(index: int) -> str:
    """How messages and the checkpoint's layout name param group ``index``."""
    return f"param_groups[{index}]"


def group_hyper(index: int, group: Mapping[str, Any]) -> AdamWHyperParams:
    """The constants the servers hold for a group's segments; refuses options out of range
    or unsupported, naming the group. Clipping stays off: torch's AdamW does not clip (clip
    with ``torch.nn.utils.clip_grad_norm_`` before ``step()``, as with it)."""
    where = group_name(index)
    for option in UNSUPPORTED:
        if group.get(option):
            raise OptimizerError(f"{where}: {option}=True is not supported by OffloadedAdamW")
    group_lr(index, group)
    betas = group["betas"]
    if not (isinstance(betas, Sequence) and len(betas) == 2 and all(0.0 <= float(b) < 1.0 for b in betas)):
        raise OptimizerError(f"{where}: betas must be two numbers in [0, 1), got {betas!r}")
    if not float(group["eps"]) > 0.0:
        raise OptimizerError(f"{where}: eps must be > 0, got {group['eps']}")
    if not float(group["weight_decay"]) >= 0.0:
        raise OptimizerError(f"{where}: weight_decay must be >= 0, got {group['weight_decay']}")
    return AdamWHyperParams(
        beta1=float(betas[0]),
        beta2=float(betas[1]),
        eps=float(group["eps"]),
        weight_decay=float(group["weight_decay"]),
        max_grad_norm=0.0,
    )


def group_lr(index: int, group: Mapping[str, Any]) -> float:
    """The group's lr now (a scheduler may have set it), refused unless finite and >= 0."""
    lr = float(group["lr"])
    if not (math.isfinite(lr) and lr >= 0.0):
        raise OptimizerError(f"{group_name(index)}: lr must be finite and >= 0, got {group['lr']}")
    return lr


def held_options(group: Mapping[str, Any]) -> tuple[Any, ...]:
    """The values of :data:`HELD_OPTIONS`, to compare before each step."""
    return tuple(_plain(group[option]) for option in HELD_OPTIONS)


def check_held(index: int, group: Mapping[str, Any], held: tuple[Any, ...]) -> None:
    """Refuse a change of betas, eps or weight decay after the servers took them."""
    for option, before in zip(HELD_OPTIONS, held):
        now = _plain(group[option])
        if now != before:
            raise OptimizerError(
                f"{group_name(index)}: {option} changed from {before!r} to {now!r} after the state servers took "
                "it; only lr may change during training (e.g. OneCycleLR needs cycle_momentum=False)"
            )


def group_layout(groups: Sequence[NamedShapes], num_servers: int, ranks: int = 1) -> Layout:
    """The flat space of the groups' parameters (name, shape), in group order, cut over
    ``num_servers x ranks`` pieces: with ranks, each server's range in one piece per rank
    (:class:`~cargohold.ranks.Shares`)."""
    try:
        return build_layout(
            [entry for group in groups for entry in group],
            num_workers=1,
            num_servers=num_servers * ranks,
            unit_sizes=[len(group) for group in groups],  # one unit per param group
            unit_names=[group_name(i) for i in range(len(groups))],
        )
    except LayoutError as error:
        raise OptimizerError(
            f"cannot place the parameters on {num_servers} state servers x {ranks} ranks: {error}"
        ) from error


def _plain(value: Any) -> Any:
    """A group option as comparable data (betas may be a list or a tuple)."""
    return tuple(float(v) for v in value) if isinstance(value, Sequence) else float(value)
