"""What travels between workers and state servers, defined once for the config, the
transport and the state: the dtypes gradients and weights are sent and held in, and the
sizes of the chunks they are cut into."""

from __future__ import annotations

import torch

WIRE_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""Dtypes gradients and weights may travel in, by the name used in configs and the API."""
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in WIRE_DTYPES.items()}
"""The reverse of :data:`WIRE_DTYPES`."""

DEFAULT_CHUNK_BYTES = 1 << 20
MIN_CHUNK_BYTES = 4 << 10
"""Smallest chunk either end sends or accepts (a tensor's last chunk aside). Every message
costs its receiver a parse, a CRC and a copy whatever its size: in 1-byte chunks one MiB
costs minutes of CPU, in 4 KiB chunks a fraction of a second."""
MAX_CHUNK_BYTES = 32 << 20
