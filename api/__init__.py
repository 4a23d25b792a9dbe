"""cargohold: train models larger than accelerator memory by offloading AdamW state to
host state servers (RAM, then NVMe).

This package is the Python API, the ways into cargohold from a user's own training code.
:class:`~cargohold.trainer.Trainer` runs the whole machinery on a user's model factory,
loss and data (``cargohold train`` is a thin layer over it).
:class:`~cargohold.optimizer.OffloadedAdamW` is a ``torch.optim.Optimizer`` whose AdamW
state lives on state servers; :func:`~cargohold.servers.start_state_servers` and
:func:`~cargohold.servers.connect_state_servers` give it servers. See docs/api.md.

The distribution maps the repository's folders onto this namespace: ``api/`` is
``cargohold`` itself, ``services/`` is ``cargohold.services`` (workers, state servers,
tiers, transport), ``cluster/`` is ``cargohold.cluster`` (the config schema, the Ray
launcher and CLI) and ``proto/cargohold/v1/`` is ``cargohold.v1`` (the generated gRPC
API); docs/architecture.md has the map. The API sits on top: nothing in services or
cluster imports it but the CLI's ``train`` command.

The public names load on first use, so that ``import cargohold`` stays light (no torch,
Ray or gRPC until one is touched).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_PUBLIC = {
    "OffloadedAdamW": "cargohold.optimizer",
    "StateServers": "cargohold.servers",
    "Trainer": "cargohold.trainer",
    "connect_state_servers": "cargohold.servers",
    "share_state_servers": "cargohold.ranks",
    "start_state_servers": "cargohold.servers",
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
    from cargohold.optimizer import OffloadedAdamW
    from cargohold.ranks import share_state_servers
    from cargohold.servers import StateServers, connect_state_servers, start_state_servers
    from cargohold.trainer import Trainer


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'cargohold' has no attribute {name!r}")
