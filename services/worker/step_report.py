"""What a worker's step and validation report: one value each, which the launcher
aggregates (cluster/supervise.py) and the Python API returns (api/trainer.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from cargohold.services.core.update_call import CommitTerms


@dataclass(frozen=True, slots=True)
class EvalReport:
    """A validation after data step ``step``: the mean loss over the held-out set's
    counted tokens and its perplexity, ``exp(loss)``."""

    step: int
    loss: float
    seconds: float

    @property
    def perplexity(self) -> float:
        return math.exp(loss) if (loss := self.loss) < EXP_LIMIT else math.inf


EXP_LIMIT = 709.0
"""math.exp overflows a float beyond ~709.78."""


@dataclass(frozen=True, slots=True)
class StepReport:
    """What one worker did in one step; the launcher aggregates these."""

    rank: int
    step: int
    loss: float
    """Mean loss over the step's counted tokens, all workers' batches (identical on every rank)."""
    global_grad_norm: float
    seconds: float
    phases: dict[str, float] = field(default_factory=dict)
    applied: int = 0
    """Segments whose update was applied (not ignored as a repeat)."""
    skipped: bool = False
    """The gradient norm was not finite and the update was skipped (optim.nonfinite; with
    fp16, the scaled gradients overflowed)."""
    loss_scale: float | None = None
    """fp16 compute: the loss scale this step's gradients were computed with."""
    terms: CommitTerms | None = None
    """The terms the step's staged update was committed with, or with a delayed update will
    be during the next step (None: skipped, or applied by its pushes): what a live recovery
    finishes that update with where no segment committed it yet."""
    leaving: bool = False
    """The worker was told during the step that it will be taken away (a preemption
    notice, services/worker/preemption.py): the launcher replaces the workers now."""
