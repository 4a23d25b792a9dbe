"""Facts about the node this process runs on."""

from __future__ import annotations

import os

NODE_IP_ENV = "CARGOHOLD_NODE_IP"
"""Deployment setting: the address servers bind, overriding what Ray reports (e.g. a
dedicated interface, or loopback when several Ray nodes share one test machine)."""


def node_ip() -> str:
    """This node's address, so servers bind it and never 0.0.0.0: ``$CARGOHOLD_NODE_IP``,
    else the address Ray knows, else loopback outside Ray."""
    import ray

    if override := os.environ.get(NODE_IP_ENV):
        return override
    if ray.is_initialized():
        return ray.util.get_node_ip_address()
    return "127.0.0.1"


def node_memory_bytes() -> int:
    """This node's physical memory (a container's own limit is not read)."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
