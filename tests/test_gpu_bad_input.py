"""Bad input on the CUDA path that CPU tests can see (a GPU worker whose memory cannot be
page-locked is in test_page_lock.py).

worker.gpus against the GPUs a cluster has. An in-process cluster is given torch's
count of this node's GPUs (Ray's own NVML detection can report none), and a run asking
for more fails at once naming worker.gpus, instead of its placement group waiting
cluster.startup_timeout_s (120 s by default) for GPUs that never come. On a cluster the
launcher joins, nodes may still be joining: there it warns and waits. CUDA workers
where torch has no NCCL fail naming worker.device."""

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
from cargohold.services.core.errors import ConfigError
from cargohold.services.worker.actor import process_group_backend

MORE = torch.cuda.device_count() + 1
"""More GPUs than this node has."""


@pytest.mark.parametrize(
    "overrides",
    [dict(worker__num_workers=1, worker__gpus=MORE), dict(worker__num_workers=2 * MORE, worker__gpus=0.5)],
    ids=["one-worker-too-many", "all-workers-too-many"],
)
def test_a_run_asking_for_more_gpus_than_the_node_has_fails_at_once_naming_worker_gpus(overrides: dict) -> None:
    assert not ray.is_initialized()
    config = tiny_config(steps=1, worker__device="cpu", **overrides)
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"worker\.gpus=\S+ x worker\.num_workers=\d+ needs .* GPUs, this node"):
        TrainingSession(config).start()
    assert time.monotonic() - started < config.cluster.startup_timeout_s / 4
    assert not ray.is_initialized()  # refused before any cluster started


def test_a_joined_cluster_short_of_gpus_is_warned_about_and_waited_for(
    ray_local, caplog: pytest.LogCaptureFixture
) -> None:
    config = tiny_config(steps=1, worker__num_workers=1, worker__gpus=MORE)
    with caplog.at_level(logging.WARNING, logger="cargohold.cluster.launcher"):
        assert connect_ray(config) is False  # ray_local's: joined, not owned
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and f"worker.gpus={MORE}" in warnings[0] and "the Ray cluster" in warnings[0]


def test_cuda_workers_without_nccl_fail_naming_worker_device() -> None:
    if dist.is_nccl_available():
        pytest.skip("this torch has NCCL")
    with pytest.raises(ConfigError, match=r"worker\.device=cuda needs NCCL .* set worker\.device=cpu"):
        process_group_backend(torch.device("cuda"))
    assert process_group_backend(torch.device("cpu")) == "gloo"
