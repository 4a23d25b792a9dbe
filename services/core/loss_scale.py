"""The dynamic loss scale of fp16 compute, kept as ``torch.amp.GradScaler`` keeps it.

fp16 holds numbers up to 65504 and loses those below ~6e-8, where many gradients live.
The loss is multiplied by the scale before backward, so the gradients are computed that
many times larger; the state servers take the scale out again in fp32, before clipping.
A step whose scaled gradients overflowed (an inf or NaN anywhere: the global norm the
workers all-reduce is then not finite) is skipped by every server, and the scale is
multiplied by ``backoff_factor``; after ``growth_interval`` clean steps in a row it is
multiplied by ``growth_factor``. Every worker sees the same norm, so every worker keeps
the same scale without exchanging it.

The scale and both factors are powers of two: multiplying an fp32 gradient by the scale's
inverse is then exact, so taking it out before or after other exact steps gives the same
bits, and the norm of the scaled gradients divided by the scale is exactly the norm of the
unscaled ones. (GradScaler's own defaults are such powers.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cargohold.services.core.errors import ConfigError
from cargohold.services.core.update_call import is_power_of_two

FP16_MAX = float(torch.finfo(torch.float16).max)
"""The largest finite fp16 number, 65504."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LossScaleRules:
    """GradScaler's arguments (its defaults too)."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        for name in ("init_scale", "growth_factor", "backoff_factor"):
            value = getattr(self, name)
            if not is_power_of_two(value):
                raise ConfigError(
                    f"tuning.optim.loss_scale.{name} must be a power of two (so that taking the scale out of "
                    f"the gradients is exact), got {value}"
                )
        if not self.growth_factor > 1.0:
            raise ConfigError(f"tuning.optim.loss_scale.growth_factor must be > 1, got {self.growth_factor}")
        if not self.backoff_factor < 1.0:
            raise ConfigError(f"tuning.optim.loss_scale.backoff_factor must be < 1, got {self.backoff_factor}")
        if isinstance(self.growth_interval, bool) or not isinstance(self.growth_interval, int):
            raise ConfigError(
                f"tuning.optim.loss_scale.growth_interval must be an integer, got {self.growth_interval!r}"
            )
        if self.growth_interval < 1:
            raise ConfigError(f"tuning.optim.loss_scale.growth_interval must be >= 1, got {self.growth_interval}")


@dataclass(frozen=True, slots=True)
class LossScaleState:
    """Where the scale stands: what a checkpoint keeps to resume bitwise."""

    scale: float
    growth_tracker: int = 0
    """Clean steps in a row since the scale last changed."""

    def __post_init__(self) -> None:
        if not is_power_of_two(self.scale):
            raise ValueError(f"a loss scale must be a power of two, got {self.scale}")
        if isinstance(self.growth_tracker, bool) or not isinstance(self.growth_tracker, int) or self.growth_tracker < 0:
            raise ValueError(f"a loss scale's growth tracker must be an integer >= 0, got {self.growth_tracker!r}")


def next_state(state: LossScaleState, rules: LossScaleRules, *, found_inf: bool) -> LossScaleState:
    """The scale after a step, by ``torch._amp_update_scale_``'s rules: back off after an
    overflow, grow after ``growth_interval`` clean steps unless the grown scale would not
    be a finite fp32 number."""
    if found_inf:
        return LossScaleState(_fp32(state.scale * rules.backoff_factor), 0)
    clean = state.growth_tracker + 1
    if clean < rules.growth_interval:
        return LossScaleState(state.scale, clean)
    grown = _fp32(state.scale * rules.growth_factor)
    return LossScaleState(grown if math.isfinite(grown) else state.scale, 0)


def _fp32(value: float) -> float:
    """``value`` as GradScaler's fp32 scale tensor holds it (inf past fp32's range)."""
    return float(torch.tensor(value, dtype=torch.float64).to(torch.float32))
