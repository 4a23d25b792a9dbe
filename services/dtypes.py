"""The dtypes gradients and weights travel and are held in, by the names configs, the
API and the wire use: defined once here."""

from __future__ import annotations

import torch

WIRE_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""Dtypes gradients and weights may travel in, by the name used in configs and the API."""
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in WIRE_DTYPES.items()}
"""The reverse of :data:`WIRE_DTYPES`."""
