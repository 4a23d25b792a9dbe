"""State servers as Ray actors, for :func:`cargohold.servers.start_state_servers`.

Each server is a :class:`~cargohold.services.server.state_server.StateServer` actor with its
config's CPUs and custom resources, named ``<run_id>-state-server-<i>`` as the launcher
names them. Ray is joined if it runs, else started here and shut down at ``close``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import ray

from cargohold.cluster.schema.server import StateServerConfig
from cargohold.services.core.errors import TrainingError
from cargohold.services.server.state_server import StateServer
from cargohold.services.transport.auth import TlsFiles

logger = logging.getLogger(__name__)


class RayServers:
    """The actors of one run's state servers."""

    def __init__(
        self,
        config: StateServerConfig,
        *,
        run_id: str,
        token: str,
        tls: TlsFiles | None,
        ray_address: str | None,
        timeout_s: float,
    ) -> None:
        self._owns_ray = False
        if not ray.is_initialized():
            if ray_address is not None:
                ray.init(address=ray_address)
            else:  # a cluster of its own, even when another runs on this machine
                ray.init(
                    address="local",
                    num_cpus=max(1, math.ceil(config.num_servers * config.cpus)),
                    include_dashboard=False,
                    _node_ip_address="127.0.0.1",
                )
            self._owns_ray = True
        actor: Any = ray.remote(StateServer)
        self.actors: list[Any] = [
            actor.options(
                num_cpus=config.cpus, resources=dict(config.resources), name=f"{run_id}-state-server-{index}"
            ).remote(config, run_id=run_id, server_index=index, auth_token=token, tls=tls)
            for index in range(config.num_servers)
        ]
        try:
            ready, _ = ray.wait(
                [a.address.remote() for a in self.actors], num_returns=len(self.actors), timeout=timeout_s
            )
            if len(ready) < len(self.actors):
                raise TrainingError(
                    f"{len(self.actors) - len(ready)} of {len(self.actors)} state servers did not start within "
                    f"{timeout_s}s; does the Ray cluster have {config.cpus} CPUs and {config.resources} free for each?"
                )
            ray.get(ready)  # raises a server's start-up error
        except BaseException:
            self.close()
            raise

    def on_each(self, method: str, args: Sequence[tuple[Any, ...]]) -> list[Any]:
        return ray.get([getattr(a, method).remote(*x) for a, x in zip(self.actors, args, strict=True)])

    def close(self) -> None:
        actors, self.actors = self.actors, []
        for actor in actors:
            try:
                ray.get(actor.stop.remote(), timeout=30)
            except Exception as error:  # the others must stop too
                logger.warning("stopping a state server failed: %s", error)
            ray.kill(actor)
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = False
