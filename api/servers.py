"""State servers for :class:`~cargohold.optimizer.OffloadedAdamW`: started by
:func:`start_state_servers` (Ray actors with the tiers of a ``StateServerConfig``, or
servers in this process), or found by address with :func:`connect_state_servers`.

The optimizer talks to them over gRPC only, by address. Checkpoints are another matter:
a state server writes its segments' files itself and restores from them, on orders that
do not travel over gRPC (whoever may call a state server could otherwise make it write
files anywhere its process may). Only the owner of servers, the handle that started them,
gives those orders; servers found by address train but cannot save or load state.
"""

from __future__ import annotations

import dataclasses
import secrets
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from cargohold.cluster.schema.server import StateServerConfig
from cargohold.services.core.errors import CheckpointError, ConfigError
from cargohold.services.server.state_server import StateServer
from cargohold.services.transport.auth import TlsFiles


class ServerOwner(Protocol):
    """What started the servers: it can call every :class:`StateServer` method on them."""

    def on_each(self, method: str, args: Sequence[tuple[Any, ...]]) -> list[Any]:
        """``method(*args[i])`` on server ``i``, for every server; the results in order."""

    def close(self) -> None:
        """Stop the servers (their tier files are deleted) and release what ran them."""


@dataclass(frozen=True, slots=True)
class StateServers:
    """State servers serving one run: what an optimizer needs to reach them.

    Use it as a context manager, or call :meth:`close`, to stop servers that
    :func:`start_state_servers` started; servers found by address are left running.
    """

    addresses: tuple[str, ...]
    """host:port of each server's gRPC API; server ``i`` owns the ``i``-th range of the flat space."""
    run_id: str
    """The one run the servers serve; calls naming another are refused."""
    token: str | None = field(default=None, repr=False)
    """The bearer token every call carries; None when the servers take calls without one."""
    tls: TlsFiles | None = None
    """The client's certificate, key and CA for mutual TLS; None for plain gRPC."""
    owner: ServerOwner | None = field(default=None, repr=False, compare=False)
    """What started the servers (:func:`start_state_servers` sets it), which can give them
    the orders checkpoints need; None for servers found by address, which train but
    cannot save or load state."""

    def on_each(self, method: str, args: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Call a :class:`StateServer` method on every server (checkpoints); only the owner can."""
        if self.owner is None:
            raise CheckpointError(
                f"the state servers of run {self.run_id!r} were found by address: only the process that started "
                "them (start_state_servers) can make them write or read checkpoints"
            )
        return self.owner.on_each(method, args)

    def close(self) -> None:
        """Stop the servers if this handle started them; their state is gone after."""
        if self.owner is not None:
            self.owner.close()

    def __enter__(self) -> StateServers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect_state_servers(
    addresses: Sequence[str], *, run_id: str, auth_token: str | None = None, tls: TlsFiles | None = None
) -> StateServers:
    """Servers already running for run ``run_id`` at ``addresses`` (host:port, in server
    order), reached with ``auth_token`` and ``tls`` if they ask for them. Nothing is
    contacted yet: the optimizer checks that each answers when it is built."""
    if not addresses or not all(isinstance(a, str) and a for a in addresses):
        raise ConfigError(f"addresses must be a non-empty list of host:port strings, got {addresses!r}")
    if not run_id:
        raise ConfigError("run_id must name the run the servers serve")
    return StateServers(addresses=tuple(addresses), run_id=run_id, token=auth_token, tls=tls)


def start_state_servers(
    config: StateServerConfig | None = None,
    *,
    in_process: bool = False,
    run_id: str | None = None,
    auth_token: str | None = None,
    tls: TlsFiles | None = None,
    ray_address: str | None = None,
    timeout_s: float = 120.0,
) -> StateServers:
    """Start ``config.num_servers`` state servers (default: one, all state in RAM) and
    return their handle; ``config.tier`` puts their state in RAM or spills it to NVMe files.

    By default each is a Ray actor asking for ``config.cpus`` CPUs and ``config.resources``:
    in the running Ray, else in the cluster at ``ray_address``, else in a Ray started here
    (and shut down by :meth:`StateServers.close`). With ``in_process`` they run in this
    process instead, on loopback unless ``config.bind_host`` says otherwise: no Ray needed,
    the update shares this process's CPU threads.

    ``run_id`` defaults to a fresh one; ``auth_token`` (every call must carry it) too.
    ``timeout_s`` bounds the start of Ray actors.
    """
    config = config if config is not None else StateServerConfig()
    run_id = run_id or f"optim-{uuid.uuid4().hex[:12]}"
    token = auth_token or secrets.token_urlsafe(32)
    if in_process:
        owner: ServerOwner = LocalServers(config, run_id=run_id, token=token, tls=tls)
    else:
        from cargohold.ray_servers import RayServers  # Ray is imported only when used

        owner = RayServers(config, run_id=run_id, token=token, tls=tls, ray_address=ray_address, timeout_s=timeout_s)
    addresses = owner.on_each("address", [()] * config.num_servers)
    return StateServers(addresses=tuple(addresses), run_id=run_id, token=token, tls=tls, owner=owner)


class LocalServers:
    """State servers as objects in this process, each serving gRPC on its own threads."""

    def __init__(self, config: StateServerConfig, *, run_id: str, token: str, tls: TlsFiles | None) -> None:
        config = dataclasses.replace(config, bind_host=config.bind_host or "127.0.0.1")
        threads = torch.get_num_threads()  # a StateServer sets its process's: this one is the user's
        self.servers: list[StateServer] = []
        try:
            for index in range(config.num_servers):
                self.servers.append(
                    StateServer(
                        config, run_id=run_id, server_index=index, metrics_enabled=False, auth_token=token, tls=tls
                    )
                )
        except BaseException:
            self.close()
            raise
        finally:
            torch.set_num_threads(threads)

    def on_each(self, method: str, args: Sequence[tuple[Any, ...]]) -> list[Any]:
        return [getattr(server, method)(*a) for server, a in zip(self.servers, args, strict=True)]

    def close(self) -> None:
        servers, self.servers = self.servers, []
        for server in servers:
            server.stop()
