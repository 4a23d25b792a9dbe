"""AdamW's hyper-parameter checks: bad values refused naming the key, edges accepted."""

from __future__ import annotations

import pytest

from cargohold.services.core.errors import ConfigError
from cargohold.services.core.optim import AdamWHyperParams

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("beta1", -0.1),
        ("beta1", 1.0),
        ("beta1", float("nan")),
        ("beta2", 1.0),
        ("beta2", -1e-9),
        ("beta2", float("nan")),
        ("eps", 0.0),
        ("eps", -1e-8),
        ("eps", float("nan")),
        ("weight_decay", -0.01),
        ("weight_decay", float("nan")),
        ("max_grad_norm", -1.0),
        ("max_grad_norm", float("nan")),
    ],
)
def test_hyper_params_reject_bad_values_naming_the_key(key: str, value: float) -> None:
    with pytest.raises(ConfigError, match=rf"optim\.{key} must be") as info:
        AdamWHyperParams(**{key: value})
    assert str(value) in str(info.value)


def test_hyper_params_accept_edges() -> None:
    hyper = AdamWHyperParams(beta1=0.0, beta2=0.0, eps=1e-30, weight_decay=0.0, max_grad_norm=0.0)
    assert hyper.max_grad_norm == 0.0
    with pytest.raises(TypeError):
        AdamWHyperParams(0.9)  # type: ignore[misc]  # keyword-only
