"""Ports to segment state held in this process: a worker's own device segments
(``worker.optimizer_on_device_fraction``) and a step run without Ray or a network.
:class:`SplitPort` sends each segment to its owner."""

from __future__ import annotations

import torch

from cargohold.services.core.layout import Segment
from cargohold.services.core.segment_spec import check_same_spec
from cargohold.services.core.update_call import IN_CALL, STAGED, CommitTerms, UpdateCall
from cargohold.services.segments.segment_registry import SegmentRegistry
from cargohold.services.worker.param_groups import ParamGroups
from cargohold.services.worker.state_port import PortConfig, StatePort, segment_spec


class LocalPort:
    """State in this process: the same registry a state server runs."""

    def __init__(
        self, config: PortConfig, run_id: str, param_groups: ParamGroups, registry: SegmentRegistry | None = None
    ) -> None:
        self.config = config
        self.run_id = run_id
        self.param_groups = param_groups
        self.registry = registry if registry is not None else SegmentRegistry()

    def register(self, segment: Segment, initial: torch.Tensor) -> int:
        return self.registry.register(
            segment_spec(self.config, self.run_id, segment, self.param_groups), initial.clone()
        ).updates

    def join(self, segment: Segment) -> int:
        state = self.registry.get(self.run_id, segment.segment_id)
        check_same_spec(state.spec, segment_spec(self.config, self.run_id, segment, self.param_groups))
        return state.updates

    def update(
        self,
        segment: Segment,
        update: int,
        *,
        gradient: torch.Tensor | None,
        terms: CommitTerms | None,
        out: torch.Tensor | None = None,
    ) -> bool:
        state = self.registry.get(self.run_id, segment.segment_id)
        call = UpdateCall(
            run_id=self.run_id,
            segment_id=segment.segment_id,
            update=update,
            numel=segment.numel,
            gradient=STAGED if gradient is None else IN_CALL,
            terms=terms,
            weights_dtype=None if terms is None else self.config.compute_dtype,
        )
        applied = state.update(call, gradient=gradient).applied
        if out is not None:
            self.fetch(segment, update, out)
        return applied and not call.stages

    def fetch(self, segment: Segment, update: int, out: torch.Tensor) -> None:
        dtype = self.config.compute_dtype
        self.registry.get(self.run_id, segment.segment_id).weights(update, dtype, out=out)

    def close(self) -> None:
        pass


class SplitPort:
    """Each segment to its owner: the state servers' port for theirs, the worker's own
    (a :class:`LocalPort` over its device registry) for its device segments."""

    def __init__(self, servers: StatePort, device: StatePort) -> None:
        self.servers = servers
        self.device = device

    def _owner(self, segment: Segment) -> StatePort:
        return self.device if segment.on_device else self.servers

    def register(self, segment: Segment, initial: torch.Tensor) -> int:
        return self._owner(segment).register(segment, initial)

    def join(self, segment: Segment) -> int:
        return self._owner(segment).join(segment)

    def update(
        self,
        segment: Segment,
        update: int,
        *,
        gradient: torch.Tensor | None,
        terms: CommitTerms | None,
        out: torch.Tensor | None = None,
    ) -> bool:
        return self._owner(segment).update(segment, update, gradient=gradient, terms=terms, out=out)

    def fetch(self, segment: Segment, update: int, out: torch.Tensor) -> None:
        self._owner(segment).fetch(segment, update, out)

    def close(self) -> None:
        self.servers.close()
        self.device.close()
