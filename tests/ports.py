"""Ports for tests that must name a port before something binds it.

A port found by binding port 0 comes from the kernel's ephemeral range, and while the test
starts Ray the kernel hands ports of that same range to Ray's own outgoing and listening
sockets: a port free at the probe can be taken before our server binds it (CI saw
"Address already in use" that way). The ports given here lie below the ephemeral range and
above Ray's worker ports (10002-19999 by default), where only an explicit bind can take them."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_LOWEST = 20000  # above Ray's default worker port range


def _first_ephemeral_port() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_range(count: int) -> int:
    """A base port whose next ``count`` ports are free now and outside the ephemeral range."""
    highest = _first_ephemeral_port() - count
    if highest <= _LOWEST:
        raise RuntimeError(f"no room below the ephemeral port range for {count} ports")
    for _ in range(200):
        base = random.randint(_LOWEST, highest)
        try:
            for port in range(base, base + count):
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {count} free consecutive ports between {_LOWEST} and {highest + count}")


def free_port() -> int:
    """One free port outside the ephemeral range."""
    return free_port_range(1)


def free_ports(count: int) -> list[int]:
    """``count`` free ports outside the ephemeral range (consecutive)."""
    base = free_port_range(count)
    return list(range(base, base + count))
