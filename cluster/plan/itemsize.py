"""Bytes per element of the dtypes a plan counts in."""

from __future__ import annotations

from cargohold.services.core.wire import WIRE_DTYPES

DTYPE_BYTES: dict[str, int] = {name: dtype.itemsize for name, dtype in WIRE_DTYPES.items()}
"""Bytes per element of each compute and wire dtype, by its config name."""
FP32_BYTES = 4
"""Bytes per element of fp32: initial values, the loss's logits, update temporaries."""
