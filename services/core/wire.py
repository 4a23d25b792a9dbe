"""What travels between workers and state servers, defined once for the config, the
transport and the state: the dtypes gradients and weights are sent and held in, and the
sizes of the chunks they are cut into."""

from __future__ import annotations

import torch

from cargohold.services.core.errors import ConfigError

WIRE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
"""Dtypes gradients and weights may travel in, by the name used in configs and the API.
float16 gradients carry the dynamic loss scale (:mod:`cargohold.services.core.loss_scale`)."""
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in WIRE_DTYPES.items()}
"""The reverse of :data:`WIRE_DTYPES`."""


def check_representable(name: str, value: torch.Tensor, dtype: str) -> None:
    """Refuse a parameter's initial ``value`` that the compute ``dtype`` cannot hold:
    fp16 ends at 65504, and a weight cast to inf would make every step overflow."""
    if dtype != "float16" or value.numel() == 0:
        return
    largest = float(value.detach().abs().max())
    if largest > torch.finfo(torch.float16).max:
        raise ConfigError(
            f"parameter {name!r} holds {largest:g}, beyond float16's largest number (65504): "
            "worker.compute_dtype=float16 cannot hold it; set worker.compute_dtype to bfloat16 or float32"
        )


DEFAULT_CHUNK_BYTES = 1 << 20
MIN_CHUNK_BYTES = 4 << 10
"""Smallest chunk either end sends or accepts (a tensor's last chunk aside). Every message
costs its receiver a parse, a CRC and a copy whatever its size: in 1-byte chunks one MiB
costs minutes of CPU, in 4 KiB chunks a fraction of a second."""
MAX_CHUNK_BYTES = 32 << 20
