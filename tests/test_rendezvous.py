"""Rank 0's rendezvous store: it holds the port it returns, so nothing else can take it
before the workers join (a probed-then-released port once did: EADDRINUSE in CI)."""

from __future__ import annotations

import datetime
import errno
import socket

import pytest
import torch.distributed as dist

from cargohold.services.worker.actor import rendezvous_store

TIMEOUT = datetime.timedelta(seconds=10)


def test_the_store_keeps_its_port_bound_until_the_workers_join() -> None:
    store = rendezvous_store("127.0.0.1", 2, TIMEOUT)
    with socket.socket() as other, pytest.raises(OSError) as taken:
        other.bind(("127.0.0.1", store.port))
    assert taken.value.errno == errno.EADDRINUSE
    joined = dist.TCPStore("127.0.0.1", store.port, 2, is_master=False, timeout=TIMEOUT)
    joined.set("rank1", "here")
    assert store.get("rank1") == b"here"
