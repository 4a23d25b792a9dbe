"""How a worker's step applies its updates: staged or at once, what a non-finite gradient
norm does, when the delayed update starts, and fp16's loss scale (``step_policy`` in
:mod:`~cargohold.services.worker.model_setup` derives it from the config)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from cargohold.services.core.errors import TrainingError
from cargohold.services.core.loss_scale import LossScaleRules

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StepPolicy:
    """How updates are applied (from the ``optim`` and ``worker`` config)."""

    staged: bool
    """Clipping is on or non-finite norms are checked: servers stage until the norm is known."""
    nonfinite: str = "ignore"
    """ignore, skip or fail, for a step whose global gradient norm is not finite."""
    delayed_after: int | None = None
    """Data steps past this one use the delayed update; None never does."""
    loss_scale: LossScaleRules | None = None
    """fp16 compute: the dynamic loss scale's rules (staged, non-finite steps skipped)."""

    def delayed(self, step: int) -> bool:
        return self.delayed_after is not None and step > self.delayed_after

    def skips(self, step: int, global_norm: float, loss_scale: float | None) -> bool:
        """Whether data step ``step`` skips its update: its global gradient norm is not
        finite and ``nonfinite`` does not ignore that (``fail`` raises instead).
        ``loss_scale``: fp16 compute's, whose scaled gradients overflow now and then."""
        if math.isfinite(global_norm) or self.nonfinite == "ignore":
            return False
        if loss_scale is not None:
            logger.info("step %d: the scaled gradients overflowed, update skipped, loss scale %s", step, loss_scale)
        elif self.nonfinite == "fail":
            raise TrainingError(
                f"the gradient norm of step {step} is {global_norm}; set optim.nonfinite=skip "
                "to skip such steps, or lower optim.lr"
            )
        else:
            logger.warning("step %d: gradient norm %s, update skipped", step, global_norm)
        return True
