"""OffloadedAdamW on state servers that start_state_servers starts as Ray actors, their
state spilled to an NVMe tier: a state_dict saved part-way through the tier (its files
hard-linked) and resumed on other actors continues bit for bit; and the loop of
docs/api.md runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from own_loops import STEPS, TinyMLP, assert_same_bits, offloaded, reference, schedule, train

from cargohold import StateServers, start_state_servers
from cargohold.cluster.schema.server import StateServerConfig, TierConfig
from cargohold.services.transport.grpc_client import StateServerClient

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

DOC = Path(__file__).resolve().parents[1] / "docs" / "api.md"


def on_nvme(tmp_path: Path, num_servers: int) -> StateServerConfig:
    """Servers whose RAM budget holds only their staging buffers: every partition is a file."""
    staging = TierConfig(partition_bytes=4096).staging_bytes()
    tier = TierConfig(nvme_paths=[str(tmp_path / "nvme")], partition_bytes=4096, ram_budget_bytes=staging)
    return StateServerConfig(num_servers=num_servers, cpus=0.5, tier=tier)


def nvme_bytes(servers: StateServers) -> list[int]:
    result = []
    for address in servers.addresses:
        with StateServerClient(address, auth_token=servers.token) as client:
            result.append(client.stats(servers.run_id).resident_bytes_by_tier.get("nvme", 0))
    return result


def test_ray_servers_on_an_nvme_tier_save_and_resume_bitwise(ray_local, tmp_path: Path) -> None:
    model = TinyMLP()
    with start_state_servers(on_nvme(tmp_path, 2)) as servers:
        optimizer = offloaded(model, servers, checkpoint_dir=tmp_path / "checkpoints")
        scheduler = schedule(optimizer)
        train(model, optimizer, scheduler, range(3))
        assert all(n > 0 for n in nvme_bytes(servers))
        state, scheduled = optimizer.state_dict(), scheduler.state_dict()
        files = list(Path(state["checkpoint"]).glob("*.tier"))
        assert files and all(f.stat().st_nlink == 2 for f in files)  # the tier's own files, linked
        optimizer.close()

    resumed = TinyMLP(seed=1)
    with start_state_servers(on_nvme(tmp_path, 1)) as servers:
        optimizer = offloaded(resumed, servers)
        scheduler = schedule(optimizer)
        optimizer.load_state_dict(state)
        scheduler.load_state_dict(scheduled)
        train(resumed, optimizer, scheduler, range(3, STEPS))
        optimizer.close()
    assert_same_bits(resumed, reference())


def test_the_loop_of_the_docs_runs_as_written(ray_local, tmp_path: Path) -> None:
    code = next(
        (c for c in re.finditer(r"```python\n(.*?)```", DOC.read_text(), re.S) if "OffloadedAdamW(" in c[1]), None
    )
    assert code is not None, "docs/api.md has no OffloadedAdamW example"
    exec(compile(code.group(1).replace("/tmp/", f"{tmp_path}/"), "docs/api.md", "exec"), {})
    assert (tmp_path / "run.pt").is_file()
    assert len(list((tmp_path / "cargohold-checkpoints").glob("step-*"))) == 1
