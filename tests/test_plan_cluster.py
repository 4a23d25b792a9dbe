"""`cargohold plan`'s cluster: sizes as people write them, the cluster description from a
file and flags (and a bad one refused, naming the key), and the checks of a plan against
it (worker and server slots, device memory, host RAM per node, NVMe)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cargohold.cluster.plan.description import ClusterDescription, NodeGroup, load_cluster
from cargohold.cluster.plan.run import plan_run
from cargohold.cluster.sizes import format_bytes, parse_size
from cargohold.services.core.errors import ConfigError
from tests.plans import nvme_tier
from tests.reference import tiny_config


# --- sizes ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, expected",
    [
        ("24GiB", 24 << 30),
        ("512MiB", 512 << 20),
        ("1.5TB", 1_500_000_000_000),
        ("100Gi", 100 << 30),
        ("4096", 4096),
        (" 2 kib ", 2048),
        ("64k", 64_000),
        ("1e3", 1000),
        (1 << 40, 1 << 40),
        ("0", 0),
    ],
)
def test_parse_size(text, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["24GB!", "GiB", "-1GiB", "1.5", "0.1KiB", "12 gigs", "", "1e400", True])
def test_parse_size_refuses_with_a_clear_message(text) -> None:
    with pytest.raises(ConfigError, match="--host-memory"):
        parse_size(text, "--host-memory")


def test_format_bytes() -> None:
    assert [format_bytes(n) for n in (0, 1023, 1024, 1536, 33 << 30, int(37.1 * (1 << 30)), 3 << 40)] == [
        "0 B",
        "1023 B",
        "1 KiB",
        "1.5 KiB",
        "33 GiB",
        "37.1 GiB",
        "3 TiB",
    ]


# --- fitting -------------------------------------------------------------------------------
def test_checks_name_each_resource_and_its_shortfall(tmp_path: Path) -> None:
    config = tiny_config(worker__gpus=1, state_server__tier=nvme_tier(tmp_path))
    plan = plan_run(config, ClusterDescription(device_memory_bytes=1 << 20, nvme_bytes=1 << 30))
    verdicts = {c.resource: c for c in plan.checks}
    device = verdicts["device memory per worker"]
    assert device.fits is False and device.need == plan.worker.device_peak_bytes and "short" in device.reason
    assert verdicts["NVMe of state server 0"].fits is True
    host = next(c for c in plan.checks if c.resource.startswith("host RAM"))
    assert host.fits is None and "--host-memory" in host.reason  # not given: not checked, not failed
    assert not plan.fits
    roomy = plan_run(config, ClusterDescription(device_memory_bytes=1 << 30, nvme_bytes=1 << 30))
    assert roomy.fits


def test_host_memory_counts_every_actor_on_a_node() -> None:
    config = tiny_config(worker__num_workers=4, state_server__num_servers=2)
    plan = plan_run(config)
    worker, server = plan.worker.host_peak_bytes, max(s.ram_peak_bytes for s in plan.servers)
    need = 4 * worker + 2 * server + plan.driver_bytes  # the driver runs on the first node
    one_node = plan_run(config, ClusterDescription(nodes=(NodeGroup(workers=4, servers=2, host_memory_bytes=need),)))
    assert one_node.fits
    short = plan_run(config, ClusterDescription(nodes=(NodeGroup(workers=4, servers=2, host_memory_bytes=need - 1),)))
    assert not short.fits
    spread = ClusterDescription(nodes=(NodeGroup(count=2, workers=2, servers=1),))
    two = plan_run(config, spread)
    assert two.transport == "mixed"  # streams to the other node: the server holds the streamed copies too
    per_node = 2 * two.worker.host_peak_bytes + max(s.ram_peak_bytes for s in two.servers) + two.driver_bytes
    assert per_node < need
    fitted = plan_run(
        config, ClusterDescription(nodes=(NodeGroup(count=2, workers=2, servers=1, host_memory_bytes=per_node),))
    )
    assert fitted.fits
    too_few = plan_run(config, ClusterDescription(nodes=(NodeGroup(count=1, workers=2, servers=2),)))
    slots = {c.resource: c for c in too_few.checks}["worker slots"]
    assert slots.fits is False and slots.need == 4 and slots.available == 2


def test_load_cluster_from_yaml_and_flags(tmp_path: Path) -> None:
    config = tiny_config(worker__num_workers=8, state_server__num_servers=2)
    path = tmp_path / "cluster.yaml"
    path.write_text(
        "device_memory: 80GiB\nnvme: 100Gi\nhost_memory: 64GiB\nnodes:\n"
        "  - {count: 1, workers: 8, host_memory: 480GiB}\n  - {count: 2, servers: 1}\n"
    )
    cluster = load_cluster(path, config=config)
    assert cluster.device_memory_bytes == 80 << 30 and cluster.nvme_bytes == 100 << 30
    assert cluster.nodes == (
        NodeGroup(count=1, workers=8, servers=0, host_memory_bytes=480 << 30),
        NodeGroup(count=2, workers=0, servers=1, host_memory_bytes=64 << 30),
    )
    flagged = load_cluster(path, config=config, nvme="2TiB")
    assert flagged.nvme_bytes == 2 << 40
    default = load_cluster(None, config=config, host_memory="256GiB")
    assert default.nodes == (NodeGroup(workers=8, servers=2, host_memory_bytes=256 << 30),)


@pytest.mark.parametrize(
    "text, message",
    [
        ("device_memry: 1GiB\n", "unknown cluster key 'device_memry'"),
        ("nodes:\n  - {count: 1, wokers: 2}\n", "unknown cluster key nodes[0].wokers"),
        ("nodes:\n  - {count: two}\n", "nodes[0].count must be an integer"),
        ("nvme: lots\n", "nvme (--nvme): cannot read 'lots'"),
        ("- 1\n", "must hold a mapping"),
        ("nodes: {count: 1}\n", "nodes must be a list"),
        ("a: [\n", "not valid YAML"),
    ],
)
def test_a_bad_cluster_file_is_refused(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as error:
        load_cluster(path, config=tiny_config())
    assert message in str(error.value)
