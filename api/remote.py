"""OffloadedAdamW's segments on their state servers, over gRPC: the check that every
server answers, registration, and one update (push each segment's gradient, fetch its
new weights), the segments in parallel."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from cargohold.ranks import Shares
from cargohold.servers import StateServers
from cargohold.services.core.errors import OptimizerError, TransportError
from cargohold.services.core.layout import Segment
from cargohold.services.core.segment_spec import SegmentSpec
from cargohold.services.core.update_call import IN_CALL, CommitTerms, UpdateCall
from cargohold.services.core.wire import DTYPE_NAMES
from cargohold.services.transport.grpc_client import StateServerClient

MAX_CALLS = 16
"""Segments pushed and fetched at once."""


class RemoteSegments:
    """The clients of one optimizer's servers, and its segments' calls on them."""

    def __init__(self, servers: StateServers, shares: Shares, *, timeout_s: float) -> None:
        self.servers = servers
        self._shares = shares
        self.clients = [
            StateServerClient(address, timeout_s=timeout_s, auth_token=servers.token, tls=servers.tls, bulk=True)
            for address in servers.addresses
        ]
        self._pool = ThreadPoolExecutor(max_workers=MAX_CALLS, thread_name_prefix="offloaded-adamw")

    def check_reachable(self, timeout_s: float) -> None:
        """Every server answers, serves this run and takes this token; else an error
        naming the first that does not."""
        for index, client in enumerate(self.clients):
            try:
                client.wait_ready(timeout_s)
                client.stats(self.servers.run_id)  # authenticated and bound to the run: refuses a wrong one
            except TransportError as error:
                raise TransportError(f"state server {index} at {client.address} cannot be used: {error}") from error

    def register(self, specs: Sequence[SegmentSpec], server_of: Sequence[int], initial: torch.Tensor) -> None:
        """Register every segment with its slice of the flat fp32 ``initial`` weights; the
        servers must not hold them already (their state would silently win)."""

        def register(spec: SegmentSpec, server: int) -> None:
            client = self.clients[server]
            _, created = client.register(spec, initial[spec.start : spec.start + spec.numel])
            if not created:
                raise OptimizerError(
                    f"state server {server} at {client.address} already holds segment {spec.segment_id} of run "
                    f"{spec.run_id!r}: each OffloadedAdamW needs state servers of its own (start new ones, or "
                    "restore a checkpoint with load_state_dict before the first step)"
                )

        self._each(register, list(zip(specs, server_of)))

    def update(
        self,
        segments: Sequence[Segment],
        update: int,
        *,
        lr_of: Callable[[Segment], float],
        gradient: Callable[[Segment], torch.Tensor],
        weights: Callable[[Segment], torch.Tensor],
    ) -> None:
        """Apply update number ``update`` to every segment and fetch its weights into
        ``weights(segment)``, in the dtype of that buffer. Harmless to repeat after a
        failure: a server ignores a gradient it has applied."""
        run_id = self.servers.run_id

        def step(segment: Segment) -> None:
            client, out = self.clients[self._shares.server(segment)], weights(segment)
            dtype = DTYPE_NAMES[out.dtype]
            call = UpdateCall(
                run_id=run_id,
                segment_id=segment.segment_id,
                update=update,
                numel=segment.numel,
                gradient=IN_CALL,
                terms=CommitTerms(lr=lr_of(segment)),
                weights_dtype=dtype,
            )
            client.update(call, gradient(segment))
            client.fetch(run_id, segment.segment_id, update, dtype, segment.numel, out=out)

        self._each(step, [(s,) for s in segments])

    def fetch(self, segments: Sequence[Segment], update: int, weights: Callable[[Segment], torch.Tensor]) -> None:
        """The weights after ``update`` into ``weights(segment)`` (after a restore)."""

        def fetch(segment: Segment) -> None:
            out = weights(segment)
            self.clients[self._shares.server(segment)].fetch(
                self.servers.run_id, segment.segment_id, update, DTYPE_NAMES[out.dtype], segment.numel, out=out
            )

        self._each(fetch, [(s,) for s in segments])

    def close(self) -> None:
        self._pool.shutdown()
        for client in self.clients:
            client.close()

    def _each(self, call: Callable[..., None], args: Sequence[tuple]) -> None:
        """``call(*a)`` for every ``a``, in parallel; raises the first failure after all ended."""
        for future in [self._pool.submit(call, *a) for a in args]:
            future.result()
