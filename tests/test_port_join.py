"""Joining segments a holder already has (a restore, a live recovery): the update count
comes back without initial values being drawn or sent, and a segment held under another
specification, or not held at all, is refused. Through the in-process port, whose
registry is the one a state server runs; the gRPC port asks the server the same
(DescribeShard, tests/test_live_recovery.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from reference import tiny_config

from cargohold.cluster.sections import config_layout, port_config
from cargohold.services.core.errors import SegmentConflictError, UnknownSegmentError
from cargohold.services.core.update_call import CommitTerms
from cargohold.services.worker.device_port import LocalPort
from cargohold.services.worker.param_groups import resolve_param_groups


def _port(**overrides) -> tuple[LocalPort, list]:
    config = tiny_config(**overrides)
    layout = config_layout(config)[2]
    port = LocalPort(port_config(config), "run", resolve_param_groups(config.optim, layout.params))
    return port, list(layout.segments_of_worker(0))


def test_a_held_segment_is_joined_at_its_update_count() -> None:
    port, segments = _port()
    for segment in segments:
        assert port.register(segment, torch.zeros(segment.numel)) == 0
    for update in (1, 2, 3):  # three updates of the first segment, applied at once
        gradient = torch.full((segments[0].numel,), 0.1)
        assert port.update(segments[0], update, gradient=gradient, terms=CommitTerms(lr=0.01))
    assert port.join(segments[0]) == 3
    assert [port.join(s) for s in segments[1:]] == [0] * (len(segments) - 1)


def test_a_segment_held_under_another_specification_is_refused() -> None:
    port, segments = _port()
    port.register(segments[0], torch.zeros(segments[0].numel))
    other = dataclasses.replace(port.config, optim=dataclasses.replace(port.config.optim, eps=1e-6))
    joining = LocalPort(other, "run", port.param_groups, port.registry)
    with pytest.raises(SegmentConflictError, match=f"segment {segments[0].segment_id} of run 'run'"):
        joining.join(segments[0])


def test_a_segment_not_held_is_refused() -> None:
    port, segments = _port()
    with pytest.raises(UnknownSegmentError):
        port.join(segments[0])
