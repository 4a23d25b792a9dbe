"""Shared fixtures: one in-process Ray cluster per test module that asks for it."""

from __future__ import annotations

import os

import pytest
import ray

# Everything the tests start binds loopback: cargohold's servers (read by
# cargohold.services.node in every actor, which inherits this environment through the
# raylets the tests start) and gloo's sockets.
os.environ["CARGOHOLD_NODE_IP"] = "127.0.0.1"
os.environ["GLOO_SOCKET_IFNAME"] = "lo"



@pytest.fixture(scope="module")
def ray_local():
    """A single-node Ray on loopback with enough logical CPUs for several actors."""
    ray.init(num_cpus=8, include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()
