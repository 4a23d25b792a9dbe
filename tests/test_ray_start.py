"""The tests' Ray start-up, once more after a node that timed out (tests/ray_start.py)."""

from __future__ import annotations

import pytest
import ray
from ray_start import ray_processes, started_once_more

pytestmark = pytest.mark.timeout(180)

TIMED_OUT = "The current node timed out during startup. This could happen because ..."


def test_a_node_that_timed_out_is_stopped_and_started_again() -> None:
    """The first start leaves a node running and fails as Ray does when its raylet is
    late; the second finds none of its processes and runs a task."""
    calls = []

    def start() -> str:
        ray.init(
            address="local", num_cpus=1, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False
        )
        calls.append(ray.get_runtime_context().get_node_id())
        if len(calls) == 1:
            ray._private.worker._global_node = None  # as unreachable as a node whose start failed
            raise Exception(TIMED_OUT)  # noqa: TRY002 - Ray's own kind
        return calls[-1]

    try:
        node = started_once_more(start)
        assert len(calls) == 2 and node != calls[0]
        assert ray.get(ray.remote(lambda: 7).remote()) == 7
    finally:
        ray.shutdown()
    assert not ray_processes()


def test_any_other_failure_is_raised_at_once() -> None:
    calls = []

    def start() -> None:
        calls.append(1)
        raise RuntimeError("another failure")

    with pytest.raises(RuntimeError, match="another failure"):
        started_once_more(start)
    assert calls == [1]
