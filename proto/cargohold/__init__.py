"""cargohold: train models larger than accelerator memory by offloading Adam state to
host state servers (RAM, then NVMe).

The distribution maps its folders onto this namespace: ``cargohold.api`` (the Python
API, re-exported here), ``cargohold.services`` (workers, state servers, tiers,
transport), ``cargohold.cluster`` (Ray launcher and CLI) and ``cargohold.v1`` (the
generated gRPC API). See docs/api.md and docs/architecture.md.

The public names load on first use, so that ``import cargohold`` stays light (no torch,
Ray or gRPC until one is touched).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_PUBLIC = {
    "OffloadedAdamW": "cargohold.api.optimizer",
    "StateServers": "cargohold.api.servers",
    "Trainer": "cargohold.api.trainer",
    "connect_state_servers": "cargohold.api.servers",
    "share_state_servers": "cargohold.api.ranks",
    "start_state_servers": "cargohold.api.servers",
}
__all__ = [
    "OffloadedAdamW",
    "StateServers",
    "Trainer",
    "__version__",
    "connect_state_servers",
    "share_state_servers",
    "start_state_servers",
]

if TYPE_CHECKING:
    from cargohold.api.optimizer import OffloadedAdamW
    from cargohold.api.ranks import share_state_servers
    from cargohold.api.servers import StateServers, connect_state_servers, start_state_servers
    from cargohold.api.trainer import Trainer


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'cargohold' has no attribute {name!r}")
