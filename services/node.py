"""Facts about the node this process runs on."""

from __future__ import annotations


def node_ip() -> str:
    """This node's address as Ray knows it, so servers bind it and never 0.0.0.0;
    loopback outside Ray."""
    import ray

    if ray.is_initialized():
        return ray.util.get_node_ip_address()
    return "127.0.0.1"
