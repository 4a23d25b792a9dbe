"""Shared fixtures: one in-process Ray cluster for the test modules that ask for it, and
one checkpoint-writer zygote per test module that asks for it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from ray_start import started_once_more
from transport_server import G1, GLOBAL_NORM, LR, RUN, W0, Served, make_spec, serving

# Everything the tests start binds loopback: cargohold's servers (read by
# cargohold.services.core.node in every actor, which inherits this environment through the
# raylets the tests start) and gloo's sockets.
os.environ["CARGOHOLD_NODE_IP"] = "127.0.0.1"
os.environ["GLOO_SOCKET_IFNAME"] = "lo"

SHM = Path("/dev/shm")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The modules that ask for ``ray_local`` run last, one after another, on one Ray (see
    :func:`ray_between_modules`); tests marked ``gpu`` run where torch sees a CUDA device,
    and are skipped elsewhere."""
    shared = {getattr(item, "module", None) for item in items if "ray_local" in item.fixturenames}
    items.sort(key=lambda item: getattr(item, "module", None) in shared)  # stable: each module's order kept
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module", autouse=True)
def leaves_no_shared_memory():
    """Every test module leaves /dev/shm as it found it: nothing of cargohold's, even from
    killed actors (exchange buffers are memfds; nothing else of ours belongs there)."""
    before = set(SHM.glob("cargohold-*")) if SHM.is_dir() else set()
    yield
    left = sorted(str(p) for p in (set(SHM.glob("cargohold-*")) if SHM.is_dir() else set()) - before)
    assert not left, f"left in /dev/shm: {left}"


@pytest.fixture(scope="module", autouse=True)
def ray_between_modules(request: pytest.FixtureRequest) -> Iterator[None]:
    """The Ray of ``ray_local`` outlives its module, for the next module that asks for it
    (starting one costs 5-7 s on 2 cores, once per module before). A module that checks
    whether something started Ray (its source tests ``ray.is_initialized()``) before
    its first test that asks for it finds none running (``ray_local`` starts one again
    there). The modules that do not ask run before (:func:`pytest_collection_modifyitems`),
    finding none either: their tests start Ray themselves or expect the launcher to."""
    first = next(item for item in request.session.items if item.module is request.module)
    checks = "ray.is_initialized()" in Path(request.module.__file__).read_text(encoding="utf-8")
    if ray.is_initialized() and checks and "ray_local" not in first.fixturenames:
        ray.shutdown()
    yield


@pytest.fixture(scope="session", autouse=True)
def ray_stopped_at_the_end() -> Iterator[None]:
    yield
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    """A single-node Ray on loopback with enough logical CPUs for several actors, and the
    GPUs torch sees (Ray's own detection can report none: the gpu tests would wait for
    their placement groups); the one already running where an earlier module started it."""
    if ray.is_initialized():
        yield
        return
    import torch

    settings = {
        "address": "local",  # a cluster of this process's own, even beside another one
        "num_cpus": 8,
        "num_gpus": torch.cuda.device_count(),
        "include_dashboard": False,
        "_node_ip_address": "127.0.0.1",
        "log_to_driver": False,
        "configure_logging": False,
    }
    started_once_more(lambda: ray.init(**settings))
    yield


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory):
    """A process with torch and ``checkpoint_writers.py`` loaded, forking its writers."""
    from checkpoint_writers import Zygote

    helper = Zygote(tmp_path_factory.mktemp("zygote") / "zygote.log")
    yield helper
    helper.close()


# --- a state server on 127.0.0.1 (tests/transport_server.py) ---------------------------


@pytest.fixture
def served() -> Iterator[Served]:
    """A state server of its own, with a client."""
    with serving() as s:
        yield s


@pytest.fixture
def stepped(served: Served) -> Served:
    """Segment 0 registered and at step 1."""
    assert served.client.register(make_spec(), W0) == (0, True)
    assert served.client.push(RUN, 0, 1, G1, global_norm=GLOBAL_NORM, lr=LR).applied
    return served
