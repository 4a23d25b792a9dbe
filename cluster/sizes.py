"""Byte sizes as people write them: parsing (``24GiB``, ``512MiB``, ``1.5TB``, ``100Gi``)
and printing (binary units, three significant digits).

Decimal suffixes (kB, MB, GB, TB, PB, and Kubernetes' bare K, M, G, T, P) are powers of
1000; binary ones (KiB ... PiB, and Kubernetes' Ki ... Pi) powers of 1024. Units are read
case-insensitively and always mean bytes, never bits.
"""

from __future__ import annotations

import re

from cargohold.services.core.errors import ConfigError

_DECIMAL = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "p": 10**15,
    "pb": 10**15,
}
_BINARY = {
    "ki": 1 << 10,
    "kib": 1 << 10,
    "mi": 1 << 20,
    "mib": 1 << 20,
    "gi": 1 << 30,
    "gib": 1 << 30,
    "ti": 1 << 40,
    "tib": 1 << 40,
    "pi": 1 << 50,
    "pib": 1 << 50,
}
_UNITS = {**_DECIMAL, **_BINARY}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)(?:[eE]([+-]?\d+))?\s*([a-zA-Z]*)\s*$")
_PRINT_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def parse_size(text: str | int | float, what: str = "size") -> int:
    """Bytes in ``text``: a number of bytes or a number with a unit; ConfigError naming
    ``what`` when it is not one."""
    if isinstance(text, bool):
        raise ConfigError(f"{what} must be a size such as 24GiB, 512MiB, 1.5TB or a number of bytes, got {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"{what} must be >= 0 bytes, got {text}")
        return text
    if isinstance(text, float):
        value, unit = text, 1
    else:
        match = _SIZE.match(str(text))
        found = _UNITS.get(match.group(3).lower()) if match else None
        if match is None or found is None:
            raise ConfigError(
                f"{what}: cannot read {text!r} as a size; write e.g. 24GiB, 512MiB, 1.5TB, 100Gi "
                "or a number of bytes (units: B, kB/MB/GB/TB/PB = powers of 1000, "
                "KiB/MiB/GiB/TiB/PiB = powers of 1024)"
            )
        value, unit = float(f"{match.group(1)}e{match.group(2) or 0}"), found  # 1e400 is inf, refused below
    nbytes = value * unit
    if not nbytes >= 0 or nbytes == float("inf"):
        raise ConfigError(f"{what} must be a finite size >= 0, got {text!r}")
    if nbytes != int(nbytes):
        raise ConfigError(f"{what}: {text!r} is {nbytes} bytes, not a whole number of bytes")
    return int(nbytes)


def format_bytes(nbytes: int | float) -> str:
    """``nbytes`` in the largest binary unit that keeps it >= 1, e.g. ``33.6 GiB``."""
    value = float(nbytes)
    for unit in _PRINT_UNITS:
        if abs(value) < 1024 or unit == _PRINT_UNITS[-1]:
            break
        value /= 1024
    if unit == "B":
        return f"{int(nbytes)} B"
    return f"{value:.3g} {unit}"
