"""``cluster.host_memory_bytes``: one host budget for every process of a run, split by the
planner into the workers' and servers' fixed parts and the state servers' RAM tier; kept
by the run (its config carries the split) and refused before anything starts when the
run cannot fit it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import ray
from plans import nvme_tier
from reference import tiny_config

from cargohold.cluster import cli
from cargohold.cluster.plan.run import budgeted_config, plan_run
from cargohold.cluster.plan.runtime import DRIVER_RUNTIME_BYTES, SERVER_RUNTIME_BYTES, WORKER_RUNTIME_BYTES
from cargohold.services.core.errors import ConfigError
from cargohold.services.tiers.partitions import derived_partition_bytes

MiB = 1 << 20


def _config(tmp_path: Path, budget: int, **overrides):
    tier = nvme_tier(tmp_path)
    del tier["ram_budget_bytes"]
    return tiny_config(
        model__n_layer=4,
        model__n_embd=128,
        worker__weights_nvme_path=str(tmp_path / "weights"),
        state_server__tier=tier,
        cluster__host_memory_bytes=budget,
        **overrides,
    )


def test_the_split_gives_the_servers_what_the_workers_and_runtimes_leave(tmp_path: Path) -> None:
    config = _config(tmp_path, 2048 * MiB)
    plan = plan_run(config)
    split = plan.host_budget
    assert split is not None and split.fits
    # Each part is the plan's own figure for that process, the runtime counted in it.
    assert split.driver_bytes == DRIVER_RUNTIME_BYTES
    assert split.worker_bytes == plan.worker.host_peak_bytes and plan.worker.runtime_bytes == WORKER_RUNTIME_BYTES
    server = plan.servers[0]
    assert server.runtime_bytes == SERVER_RUNTIME_BYTES
    assert split.server_bytes == server.runtime_bytes + max(server.step_bytes, server.registration_bytes)
    # What is left (to the MiB) is the RAM tier's budget, and the whole stays within the budget.
    fixed = split.driver_bytes + 2 * split.worker_bytes + split.server_bytes
    assert split.tier_bytes == (2048 * MiB - fixed) // MiB * MiB
    assert 2048 * MiB - MiB < split.need_bytes <= 2048 * MiB
    assert server.ram_peak_bytes <= split.server_bytes + split.tier_bytes
    # The configured window and slots fit: kept.
    assert (split.weight_window, split.exchange_slots) == (3, 3)
    # A run starts with that split in its config; applying it again changes nothing.
    effective = budgeted_config(config)
    assert effective.state_server.tier.ram_budget_bytes == split.tier_bytes
    assert budgeted_config(effective) == effective


def test_without_a_partition_size_the_split_derives_it_from_each_servers_ram_tier(tmp_path: Path) -> None:
    tier = nvme_tier(tmp_path)
    del tier["ram_budget_bytes"], tier["partition_bytes"]
    config = tiny_config(state_server__tier=tier, cluster__host_memory_bytes=2048 * MiB)
    split = plan_run(config).host_budget
    assert split is not None and split.fits and split.partition_bytes is not None
    assert split.partition_bytes == derived_partition_bytes(split.tier_bytes, tier["buffer_count"])
    effective = budgeted_config(config)
    assert effective.state_server.tier.partition_bytes == split.partition_bytes
    assert effective.state_server.tier.ram_budget_bytes == split.tier_bytes
    assert budgeted_config(effective) == effective
    # A smaller budget leaves a smaller tier, cut into smaller partitions.
    small = budgeted_config(
        dataclasses.replace(config, cluster=dataclasses.replace(config.cluster, host_memory_bytes=1900 * MiB))
    )
    assert small.state_server.tier.ram_budget_bytes < split.tier_bytes
    assert small.state_server.tier.partition_bytes < split.partition_bytes


def test_a_tight_budget_lowers_the_threads_the_slots_then_the_window_before_refusing(tmp_path: Path) -> None:
    roomy = plan_run(_config(tmp_path, 4096 * MiB)).host_budget
    assert roomy is not None and roomy.rpc_threads == 8
    # Just enough for the least tier once the threads, the slots and the window are lowered.
    least = _config(
        tmp_path, 4096 * MiB, worker__exchange_slots=1, worker__weight_window=2, state_server__rpc_threads=2
    )
    lowest = plan_run(least).host_budget
    assert lowest is not None
    staging = least.state_server.tier.staging_bytes()
    tight = lowest.driver_bytes + 2 * lowest.worker_bytes + lowest.server_bytes + staging
    split = plan_run(_config(tmp_path, tight)).host_budget
    assert split is not None and split.fits
    assert (split.weight_window, split.exchange_slots, split.rpc_threads) == (2, 1, 2) and split.tier_bytes == staging
    # A MiB less cannot fit: the plan says so (exit 3) and a run is refused before Ray starts.
    config = _config(tmp_path, tight - MiB)
    plan = plan_run(config)
    assert not plan.fits and plan.host_budget is not None and not plan.host_budget.fits
    # The plan printed is of the least split: the servers' RAM tier holds only its staging buffers.
    assert plan.servers[0].ram_state_bytes == 0 and plan.servers[0].staging_bytes == staging
    with pytest.raises(ConfigError, match=r"cluster.host_memory_bytes=\d+ .* cannot hold this run: driver"):
        budgeted_config(config)


def test_a_budget_too_small_refuses_the_run_with_exit_2_before_ray_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config_file = tmp_path / "run.yaml"
    config_file.write_text(
        f"steps: 1\nstate_server:\n  tier:\n    nvme_paths: [{tmp_path / 'nvme'}]\n"
        "cluster:\n  host_memory_bytes: 1000000000\n"
    )
    assert cli.main(["train", "--config", str(config_file)]) == 2
    err = capsys.readouterr().err
    assert "cluster.host_memory_bytes=1000000000" in err and "cannot hold this run" in err
    assert not ray.is_initialized()
    assert cli.main(["plan", "--config", str(config_file)]) == 3
    assert "DOES NOT FIT  host budget (cluster.host_memory_bytes)" in capsys.readouterr().out


def test_a_ram_budget_set_beside_the_host_budget_must_be_the_derived_one(tmp_path: Path) -> None:
    config = _config(tmp_path, 2048 * MiB)
    derived = budgeted_config(config).state_server.tier.ram_budget_bytes
    assert derived is not None
    tier = dataclasses.replace(config.state_server.tier, ram_budget_bytes=derived + MiB)
    clashing = dataclasses.replace(config, state_server=dataclasses.replace(config.state_server, tier=tier))
    with pytest.raises(
        ConfigError, match=r"state_server.tier.ram_budget_bytes is derived from cluster.host_memory_bytes"
    ):
        budgeted_config(clashing)


def test_without_an_nvme_tier_the_whole_state_must_fit(tmp_path: Path) -> None:
    config = tiny_config(cluster__host_memory_bytes=4096 * MiB)
    split = plan_run(config).host_budget
    assert split is not None and split.fits
    assert split.tier_bytes == plan_run(config).servers[0].ram_bytes
    assert budgeted_config(config).state_server.tier.ram_budget_bytes is None
    with pytest.raises(ConfigError, match="cannot hold this run"):
        budgeted_config(tiny_config(cluster__host_memory_bytes=1024 * MiB))
