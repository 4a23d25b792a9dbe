"""Cross-node paths on one machine: a Ray cluster of four nodes (ray.cluster_utils), each
worker and each state server on its own node, so every gradient and weight crosses
"hosts" over gRPC and the gloo group spans nodes. Also scrapes the
metrics of every actor for real while the run is up."""

from __future__ import annotations

import json
import urllib.request

import pytest
import ray
import torch
from ports import free_port_range
from prometheus_client.parser import text_string_to_metric_families
from ray_start import cluster_of
from reference import reference_train, tiny_config

from cargohold.cluster.launcher import TrainingSession

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def four_nodes():
    # cargohold's servers bind loopback through CARGOHOLD_NODE_IP (conftest.py).
    with cluster_of("trainer", "trainer", "hold", "hold") as cluster:
        yield cluster


def _node_of(actor) -> str:
    return ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))


def _scrape(address: str) -> dict[str, list]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def _value(samples: dict, family: str, sample: str, **labels: str) -> float:
    return sum(
        s.value for s in samples[family] if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
    )


def test_every_actor_on_its_own_node(four_nodes, tmp_path) -> None:
    base_port = free_port_range(4)
    config = tiny_config(
        steps=6,
        state_server__num_servers=2,
        state_server__resources={"hold": 1},
        worker__resources={"trainer": 1},
        cluster__placement_strategy="STRICT_SPREAD",
        metrics__port=base_port,
        metrics__file_sd_path=str(tmp_path / "sd" / "cargohold.json"),
    )
    with TrainingSession(config) as session:
        losses = [session.step().loss for _ in range(config.steps)]
        nodes = [_node_of(actor) for actor in session.workers + session.servers]
        weights = session.all_worker_weights()
        real_elements = session.layout.num_real_elements
        scrapes = {address: _scrape(address) for address in session.metrics_addresses()}

    assert len(set(nodes)) == 4, "each actor must run on its own node"
    # Fixed ports: state server i on base + i, worker r on base + 2 + r; published for
    # Prometheus file-based discovery with role labels.
    groups = json.loads((tmp_path / "sd" / "cargohold.json").read_text())
    published = {(g["labels"]["role"], g["labels"]["index"]): g["targets"][0] for g in groups}
    assert published == {
        ("state_server", "0"): f"127.0.0.1:{base_port}",
        ("state_server", "1"): f"127.0.0.1:{base_port + 1}",
        ("worker", "0"): f"127.0.0.1:{base_port + 2}",
        ("worker", "1"): f"127.0.0.1:{base_port + 3}",
    }
    assert set(scrapes) == set(published.values())
    assert all(address.startswith("127.0.0.1:") for address in session.server_addresses)
    reference = reference_train(config, config.steps)
    assert losses == reference.losses

    assert len(scrapes) == 4  # 2 servers + 2 workers
    server_scrapes = [s for s in scrapes.values() if "cargohold_optimizer_steps" in s]
    worker_scrapes = [s for s in scrapes.values() if "cargohold_worker_steps" in s]
    assert len(server_scrapes) == 2 and len(worker_scrapes) == 2
    segments_per_server = [
        _value(s, "cargohold_optimizer_steps", "cargohold_optimizer_steps_total") for s in server_scrapes
    ]
    assert sum(segments_per_server) % config.steps == 0 and min(segments_per_server) >= config.steps
    for samples in server_scrapes:
        updates = _value(samples, "cargohold_optimizer_steps", "cargohold_optimizer_steps_total")
        assert _value(samples, "cargohold_optimizer_step_seconds", "cargohold_optimizer_step_seconds_count") == updates
        assert _value(samples, "cargohold_optimizer_step_seconds", "cargohold_optimizer_step_seconds_sum") > 0
        # Between nodes the gradients' bytes go over the bulk socket (tuning.state_server.data_plane:
        # socket, the default); gRPC's PushGradient carries only the call.
        received = _value(
            samples,
            "cargohold_transport_received_bytes",
            "cargohold_transport_received_bytes_total",
            rpc="PushGradient.bulk",
        )
        assert received > 0 and received % (4 * config.steps) == 0  # fp32 gradients, every step
        ram = _value(samples, "cargohold_state_resident_bytes", "cargohold_state_resident_bytes", tier="ram")
        assert ram > 0 and ram % 12 == 0  # master + two moments, 4 bytes each
    total_ram = sum(
        _value(s, "cargohold_state_resident_bytes", "cargohold_state_resident_bytes", tier="ram")
        for s in server_scrapes
    )
    assert total_ram == 12 * weights.numel()  # the whole flat space, padding included
    for samples in worker_scrapes:
        assert _value(samples, "cargohold_worker_steps", "cargohold_worker_steps_total") == config.steps
        assert _value(samples, "cargohold_worker_step_seconds", "cargohold_worker_step_seconds_count") == config.steps
        loss = _value(samples, "cargohold_worker_loss", "cargohold_worker_loss")
        assert loss == pytest.approx(losses[-1])
    # each worker holds its FSDP2 shard of every parameter: together, the model once
    assert (
        sum(
            _value(s, "cargohold_worker_resident_bytes", "cargohold_worker_resident_bytes", kind="weights")
            for s in worker_scrapes
        )
        == 4 * real_elements
    )
    assert torch.isfinite(weights).all()
