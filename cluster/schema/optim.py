"""The optimizer's section of the configuration: AdamW's constants, the learning-rate
schedule, and which parameters decay and at which lr multiple (``optim.no_decay``,
``optim.param_groups``). Patterns are checked against the model's parameter names by
:mod:`cargohold.services.worker.param_groups`, before anything starts."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from cargohold.cluster.schema.tuning import tuning
from cargohold.services.core.errors import ConfigError
from cargohold.services.core.loss_scale import LossScaleRules
from cargohold.services.core.optim import AdamWHyperParams
from cargohold.services.core.state_precision import StateDtype, parse_state_dtype


@dataclass(kw_only=True, slots=True)
class ParamGroupConfig:
    """Parameters, matched by name, updated with their own learning-rate multiplier and
    weight decay: a param group of torch's AdamW."""

    name: str
    """Names the group in messages and logs."""
    params: list[str] = field(default_factory=list)
    """Patterns over the model's parameter names as `named_parameters()` gives them, with
    shell wildcards (`*` matches dots too): e.g. `tok_emb.*`, `*.attn.*`, `*.bias`. Each
    must match a parameter, and no parameter may match two groups."""
    lr_mult: float = 1.0
    """The group's learning rate: the schedule's at each step (`optim.lr`, warm-up and
    decay) times this."""
    weight_decay: float | None = None
    """The group's weight decay; null gives each of its parameters what `optim.weight_decay`
    and `optim.no_decay` give it."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("optim.param_groups: a group's name must not be empty")
        where = f"optim.param_groups {self.name!r}"
        if not self.params or any(not pattern for pattern in self.params):
            raise ConfigError(f"{where}: params must list one or more non-empty name patterns, got {self.params}")
        if not (math.isfinite(self.lr_mult) and self.lr_mult >= 0.0):
            raise ConfigError(f"{where}: lr_mult must be a finite number >= 0, got {self.lr_mult}")
        if self.weight_decay is not None and not (math.isfinite(self.weight_decay) and self.weight_decay >= 0.0):
            raise ConfigError(f"{where}: weight_decay must be a finite number >= 0, got {self.weight_decay}")


@dataclass(kw_only=True, slots=True)
class LossScaleConfig:
    """The dynamic loss scale of `worker.compute_dtype: float16`, with the rules and
    defaults of torch's `GradScaler` (unused in other dtypes). The scale and factors must
    be powers of two: taking the scale out of the gradients is then exact."""

    init_scale: float = tuning(65536.0)
    """The scale of the first step (2**16)."""
    growth_factor: float = tuning(2.0)
    """The scale is multiplied by this after `growth_interval` steps in a row without overflow."""
    backoff_factor: float = tuning(0.5)
    """The scale is multiplied by this after a step whose scaled gradients overflowed (that
    step's update is skipped)."""
    growth_interval: int = tuning(2000)

    def __post_init__(self) -> None:
        self.rules()

    def rules(self) -> LossScaleRules:
        return LossScaleRules(
            init_scale=self.init_scale,
            growth_factor=self.growth_factor,
            backoff_factor=self.backoff_factor,
            growth_interval=self.growth_interval,
        )


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    lr: float = 1e-3
    """Peak learning rate."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW's two moment rates (beta1, beta2), as `torch.optim.AdamW` takes them: each in
    [0, 1)."""
    eps: float = 1e-8
    weight_decay: float = 0.01
    """Decoupled (AdamW) weight decay of every parameter that `optim.no_decay` does not
    exempt and no group of `optim.param_groups` gives its own."""
    no_decay: Literal["none", "biases_and_norms"] = "none"
    """Parameters exempt from `optim.weight_decay`: none, or biases_and_norms, every
    parameter of fewer than 2 dimensions (biases, LayerNorm and RMSNorm weights), the
    usual rule (GPT-2, nanoGPT, minGPT); embeddings and matrices still decay."""
    param_groups: list[ParamGroupConfig] = field(default_factory=list)
    """Groups of parameters with their own lr multiplier and weight decay (keys below);
    parameters in no group follow `optim.lr`'s schedule and the two keys above."""
    max_grad_norm: float = 1.0
    """Clip the global gradient L2 norm to this; 0 disables clipping."""
    warmup_steps: int = 0
    """Linear warm-up from lr/warmup_steps to lr over this many steps."""
    schedule: Literal["constant", "cosine"] = "constant"
    """After warm-up: keep lr, or decay it along a cosine to lr * min_lr_ratio."""
    min_lr_ratio: float = 0.1
    nonfinite: Literal["skip", "fail", "ignore"] = "skip"
    """A step whose global gradient norm is NaN or Inf: skip its update (logged, counted in
    cargohold_worker_skipped_steps_total), fail the run, or apply it unchecked. With
    "ignore" and no clipping, servers apply each unit's gradients while backward still runs."""
    state_dtype: StateDtype = "float32"
    """How the state servers store AdamW's moments (exp_avg, exp_avg_sq; the master weights
    stay fp32): float32 (12 B of state per parameter, bitwise torch's AdamW), bfloat16
    (8 B; each moment rounded to bf16 after every update) or blockwise8 (about 6.03 B;
    8-bit codes in blocks of 256 elements with an fp32 scale each, Dettmers et al.'s
    8-bit optimizers). The update decodes each partition's moments to fp32 a piece at a
    time and runs the same fused kernel. A resume from a checkpoint saved with another
    value converts its moments (logged). See `services/core/state_precision.py`."""
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)

    def __post_init__(self) -> None:
        parse_state_dtype(self.state_dtype)
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"optim.lr must be a finite number > 0, got {self.lr}")
        if self.warmup_steps < 0:
            raise ConfigError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        self._check_betas()
        self.hyper_params()  # validates eps, weight decay and clipping
        names = [group.name for group in self.param_groups]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ConfigError(f"optim.param_groups: two groups are named {twice[0]!r}; give each its own name")

    def _check_betas(self) -> None:
        if isinstance(self.betas, tuple):
            self.betas = list(self.betas)  # torch's spelling; the config holds a list, as YAML reads it
        betas = self.betas
        if not (
            isinstance(betas, list)
            and len(betas) == 2
            and all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0.0 <= b < 1.0 for b in betas)
        ):
            raise ConfigError(f"optim.betas must be two numbers, each in [0, 1) (e.g. [0.9, 0.999]); got {betas!r}")

    @property
    def staged(self) -> bool:
        """Whether updates wait for the step's global gradient norm (clipping, or a check
        for non-finite gradients): the gradients are staged until it is known."""
        return self.max_grad_norm > 0 or self.nonfinite != "ignore"

    def hyper_params(self) -> AdamWHyperParams:
        return AdamWHyperParams(
            beta1=float(self.betas[0]),
            beta2=float(self.betas[1]),
            eps=self.eps,
            weight_decay=self.weight_decay,
            max_grad_norm=self.max_grad_norm,
        )

    def lr_at(self, step: int, total_steps: int) -> float:
        """Learning rate for ``step`` (1-based) of a run of ``total_steps``."""
        if self.warmup_steps and step <= self.warmup_steps:
            return self.lr * step / self.warmup_steps
        if self.schedule == "constant":
            return self.lr
        span = max(1, total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        floor = self.lr * self.min_lr_ratio
        return floor + 0.5 * (self.lr - floor) * (1.0 + math.cos(math.pi * progress))
