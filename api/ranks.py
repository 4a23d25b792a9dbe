"""OffloadedAdamW over the ranks of a ``torch.distributed`` process group (``torchrun``):
every rank holds the whole model with the same gradients (DDP's, or an all-reduce of its
own), and each pushes the gradients and fetches the weights of 1/W of the flat space;
then each segment's weights are broadcast from its rank, so every rank ends the step with
every weight. ZeRO-1's shape, with the state on the servers instead of on the ranks.

The shares: the optimizer's layout cuts the flat space over ``servers x ranks`` pieces
(at multiples of 64 elements, as it cuts it over servers, so the update stays torch's
AdamW(fused=True) bit for bit), and piece ``v`` is rank ``v % ranks``'s part of server
``v // ranks``'s range (:class:`Shares`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cargohold.servers import StateServers, connect_state_servers
from cargohold.services.core.errors import OptimizerError
from cargohold.services.core.layout import Segment


def share_state_servers(servers: StateServers | None, group: dist.ProcessGroup | None = None) -> StateServers:
    """Every rank's handle on the state servers that rank 0 of ``group`` started: rank 0
    passes their handle (from :func:`~cargohold.start_state_servers`), the other ranks
    None, and get servers found by address (address, run and token sent over ``group``).
    Only rank 0 can then write or restore checkpoints; :class:`OffloadedAdamW` with a
    ``process_group`` asks it to."""
    rank = dist.get_rank(group)
    if (servers is None) != (rank != 0):
        raise OptimizerError(
            f"share_state_servers on rank {rank}: rank 0 passes the servers it started, every other rank None"
        )
    sent: list[object] = [(servers.addresses, servers.run_id, servers.token, servers.tls) if servers else None]
    dist.broadcast_object_list(sent, group=group, group_src=0)
    if servers is not None:
        return servers
    received = sent[0]
    assert isinstance(received, tuple)  # rank 0 sent its servers' address, run, token and TLS files
    return connect_state_servers(received[0], run_id=received[1], auth_token=received[2], tls=received[3])


@dataclass(frozen=True, slots=True)
class Shares:
    """Who handles a segment of a layout laid out over ``servers x ranks`` pieces."""

    ranks: int
    """Ranks sharing the work (1: a single process)."""
    rank: int
    """This process's rank among them."""

    def server(self, segment: Segment) -> int:
        """The state server that holds the segment."""
        return segment.server // self.ranks

    def rank_of(self, segment: Segment) -> int:
        """The rank that pushes and fetches the segment."""
        return segment.server % self.ranks


def share_weights(
    segments: Sequence[Segment],
    shares: Shares,
    weights_of: Callable[[Segment], torch.Tensor],
    group: dist.ProcessGroup | None,
) -> None:
    """Broadcast each segment's weights from the rank that fetched them, in segment order
    on every rank."""
    for segment in segments:
        dist.broadcast(weights_of(segment), group=group, group_src=shares.rank_of(segment))
