"""Bad input on the CUDA path that CPU tests can see (a GPU worker whose memory cannot be
page-locked is in test_page_lock.py).

worker.gpus against the GPUs a cluster has. An in-process cluster is given torch's
count of this node's GPUs (Ray's own NVML detection can report none), and a run asking
for more fails at once naming worker.gpus, instead of its placement group waiting
its start-up timeout (120 s in-process) for GPUs that never come. On a cluster the
launcher joins, nodes may still be joining: there it warns and waits. worker.gpus also
says where the workers compute: a GPU worker that sees no CUDA device, or whose torch
has no NCCL, fails naming worker.gpus."""

from __future__ import annotations

import logging
import time

import pytest
import ray
import torch
import torch.distributed as dist
from reference import tiny_config

from cargohold.cluster.connect import connect_ray
from cargohold.cluster.launcher import TrainingSession
from cargohold.cluster.schema.io import load_config
from cargohold.cluster.schema.worker import WorkerConfig
from cargohold.services.core.errors import ConfigError, TrainingError
from cargohold.services.worker.actor import process_group_backend
from cargohold.services.worker.model_setup import resolve_device

MORE = torch.cuda.device_count() + 1
"""More GPUs than this node has."""


@pytest.mark.parametrize(
    "overrides",
    [dict(worker__num_workers=1, worker__gpus=MORE), dict(worker__num_workers=2 * MORE, worker__gpus=0.5)],
    ids=["one-worker-too-many", "all-workers-too-many"],
)
def test_a_run_asking_for_more_gpus_than_the_node_has_fails_at_once_naming_worker_gpus(overrides: dict) -> None:
    assert not ray.is_initialized()
    config = tiny_config(steps=1, **overrides)
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"worker\.gpus=\S+ x worker\.num_workers=\d+ needs .* GPUs, this node"):
        TrainingSession(config).start()
    assert time.monotonic() - started < config.cluster.startup_wait_s / 4
    assert not ray.is_initialized()  # refused before any cluster started


def test_a_joined_cluster_short_of_gpus_is_warned_about_and_waited_for(
    ray_local, caplog: pytest.LogCaptureFixture
) -> None:
    config = tiny_config(steps=1, worker__num_workers=1, worker__gpus=MORE)
    with caplog.at_level(logging.WARNING, logger="cargohold.cluster.launcher"):
        assert connect_ray(config) is False  # ray_local's: joined, not owned
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and f"worker.gpus={MORE}" in warnings[0] and "the Ray cluster" in warnings[0]


def test_cuda_workers_without_nccl_fail_naming_worker_gpus() -> None:
    if dist.is_nccl_available():
        pytest.skip("this torch has NCCL")
    with pytest.raises(ConfigError, match=r"worker\.gpus above 0\) need NCCL .* set worker\.gpus=0"):
        process_group_backend(torch.device("cuda"))
    assert process_group_backend(torch.device("cpu")) == "gloo"


def test_the_workers_compute_on_cuda_when_they_reserve_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """No key chooses the device: worker.gpus above 0 is CUDA (NCCL), 0 the CPU (gloo)
    even where a GPU is visible; a GPU worker that sees no CUDA device fails naming
    worker.gpus, as it starts."""
    assert resolve_device(WorkerConfig()).type == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device(WorkerConfig(gpus=0)).type == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(TrainingError, match=r"worker\.gpus=0\.5 asks for CUDA workers but this worker sees no CUDA"):
        resolve_device(WorkerConfig(gpus=0.5))
    with pytest.raises(ConfigError, match=r"unknown config key 'worker\.device': no key sets it: .*worker\.gpus"):
        load_config(None, ["worker.device=cuda"])
