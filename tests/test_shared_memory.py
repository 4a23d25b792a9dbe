"""The co-located fast path: gradients and weights through /dev/shm, with gRPC carrying
only the call. Same results as streaming; refuses any file it should not touch."""

from __future__ import annotations

import os
import urllib.request
import uuid

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from cargohold.cluster.launcher import TrainingSession
from cargohold.services.transport.grpc_client import RemoteError
from cargohold.services.transport.shm import SHM_ROOT, SharedRegion
from reference import tiny_config
from test_transport import G1, G2, GLOBAL_NORM, LR, NUMEL, RUN, W0, _assert_bitwise_equal, _spec, serving

pytestmark = pytest.mark.skipif(not SHM_ROOT.is_dir(), reason="no /dev/shm on this host")


@pytest.fixture
def region():
    shared = SharedRegion.create(f"test-{uuid.uuid4().hex}", NUMEL * 8)
    yield shared
    shared.close()


def test_push_and_fetch_through_shared_memory_equal_streaming(region: SharedRegion) -> None:
    with serving() as s:
        spec_a, spec_b = _spec(), _spec(shard_id=1)
        s.client.register(spec_a, W0)
        s.client.register(spec_b, W0)
        gradients = region.tensor(torch.float32, 0, NUMEL)
        weights = region.tensor(torch.float32, NUMEL * 4, NUMEL)
        for step, gradient in ((1, G1), (2, G2)):
            gradients.copy_(gradient)
            s.client.push(RUN, 0, step, gradient, global_norm=GLOBAL_NORM, lr=LR, shm=(str(region.path), 0))
            s.client.push(RUN, 1, step, gradient, global_norm=GLOBAL_NORM, lr=LR)
            assert s.client.fetch(RUN, 0, step, "float32", NUMEL, shm=(str(region.path), NUMEL * 4)) is None
            _assert_bitwise_equal(weights, s.client.fetch(RUN, 1, step, "float32", NUMEL))


@pytest.mark.parametrize("path, offset, message", [
    ("/tmp/cargohold-x", 0, "is not allowed"),
    (str(SHM_ROOT / "other-name"), 0, "is not allowed"),
    (str(SHM_ROOT / "cargohold-does-not-exist"), 0, "cannot open shared memory"),
    (str(SHM_ROOT / "cargohold-../etc"), 0, "is not allowed"),
    ("REGION", NUMEL * 8 - 4, "does not fit"),
    ("REGION", 2, "does not fit"),
])
def test_bad_shared_memory_references_are_refused_and_change_nothing(region, path, offset, message) -> None:
    path = str(region.path) if path == "REGION" else path
    with serving() as s:
        s.client.register(_spec(), W0)
        for call in (lambda: s.client.push(RUN, 0, 1, G1, global_norm=GLOBAL_NORM, lr=LR, shm=(path, offset)),
                     lambda: s.client.fetch(RUN, 0, 0, "float32", NUMEL, shm=(path, offset))):
            with pytest.raises(RemoteError) as error:
                call()
            assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert message in error.value.details
        assert s.client.describe(RUN, 0)[1] == 0
        _assert_bitwise_equal(s.client.fetch(RUN, 0, 0, "float32", NUMEL), W0)


def test_a_symlink_is_not_followed(region: SharedRegion) -> None:
    link = SHM_ROOT / f"cargohold-link-{uuid.uuid4().hex}"
    os.symlink(region.path, link)
    try:
        with serving() as s:
            s.client.register(_spec(), W0)
            with pytest.raises(RemoteError, match="cannot open shared memory"):
                s.client.push(RUN, 0, 1, G1, global_norm=GLOBAL_NORM, lr=LR, shm=(str(link), 0))
    finally:
        link.unlink()


def _received_by_rpc(address: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        families = text_string_to_metric_families(reply.read().decode())
    return {s.labels["rpc"]: s.value for f in families if f.name == "cargohold_transport_received_bytes"
            for s in f.samples if s.name.endswith("_total")}


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["auto", "off"])
def test_a_colocated_run_uses_shared_memory_unless_off(ray_local, mode: str) -> None:
    config = tiny_config(steps=2, worker__shared_memory=mode)
    with TrainingSession(config) as session:
        session.step()
        session.step()
        server_metrics = session.metrics_addresses()[0]
        received = _received_by_rpc(server_metrics)
        leftovers = [p for p in SHM_ROOT.glob(f"cargohold-{session.run_id}-*")]
        assert len(leftovers) == (2 if mode == "auto" else 0)
    assert not list(SHM_ROOT.glob(f"cargohold-{session.run_id}-*")), "workers must remove their regions"
    streamed, shared = received.get("PushGradient", 0), received.get("PushGradient.shm", 0)
    assert (shared > 0 and streamed == 0) if mode == "auto" else (streamed > 0 and shared == 0)
