"""A step's verdict on a non-finite global gradient norm (``StepPolicy.skips``), without
Ray: the bits it guards are tested on a cluster in test_nonfinite.py and test_fp16.py."""

from __future__ import annotations

import logging
import math

import pytest

from cargohold.services.core.errors import TrainingError
from cargohold.services.worker.step_policy import StepPolicy


@pytest.mark.parametrize("nonfinite", ["ignore", "skip", "fail"])
def test_a_finite_norm_never_skips(nonfinite: str) -> None:
    assert not StepPolicy(staged=True, nonfinite=nonfinite).skips(3, 1.5, None)


@pytest.mark.parametrize("norm", [math.inf, math.nan])
def test_a_non_finite_norm_is_ignored_skipped_or_fails_as_configured(norm: float, caplog) -> None:
    assert not StepPolicy(staged=False).skips(3, norm, None)
    with caplog.at_level(logging.WARNING):
        assert StepPolicy(staged=True, nonfinite="skip").skips(3, norm, None)
    assert "step 3: gradient norm" in caplog.text
    with pytest.raises(TrainingError, match="step 3 .*set optim.nonfinite=skip"):
        StepPolicy(staged=True, nonfinite="fail").skips(3, norm, None)


def test_an_overflow_of_fp16_scaled_gradients_is_skipped_quietly(caplog) -> None:
    with caplog.at_level(logging.INFO):
        assert StepPolicy(staged=True, nonfinite="skip").skips(5, math.inf, 65536.0)
    (record,) = caplog.records
    assert record.levelno == logging.INFO and "loss scale 65536.0" in record.getMessage()
