"""`cargohold plan` checked against a real run.

Margins (test_plan_matches_a_real_run, test_worker_buffers_match_a_real_run):
* worker buffers (TrainingWorker.resident_bytes: FSDP2 weight shards and exchange
  buffers) and the bytes pushed and fetched per step: equal, no margin;
* a state server's state per tier (12 B/element): equal once every partition sits in its
  planned tier (partitions move after their next update; compared after 3 steps);
* the memory its tiers hold (RAM tier + staging buffers, in the 4 KiB-aligned file
  layout) and the NVMe bytes written per step: equal;
* NVMe bytes read per step: at most the planned bytes and at least the planned bytes less
  the staging buffers (partitions still staged from the previous step are not read).
"""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cargohold.cluster.plan.run import plan_run
from tests.plans import nvme_tier
from tests.reference import tiny_config


def _scrape(address: str) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        families = text_string_to_metric_families(reply.read().decode())
    return {(s.name, frozenset(s.labels.items())): s.value for f in families for s in f.samples}


def _total(samples: dict, name: str, **labels: str) -> float:
    """Sum of ``name`` over the samples whose labels include ``labels`` (an ``rpc`` prefix)."""
    rpc = labels.pop("rpc", None)
    return sum(
        v
        for (n, ls), v in samples.items()
        if n == name
        and all((k, x) in ls for k, x in labels.items())
        and (rpc is None or dict(ls).get("rpc", "").startswith(rpc))
    )


@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.parametrize("tiered", [False, True], ids=["all-ram", "nvme"])
def test_plan_matches_a_real_run(ray_local, tmp_path: Path, tiered: bool) -> None:
    from cargohold.cluster.launcher import TrainingSession
    from cargohold.services.checkpoint import CheckpointDir

    # Tiered: the optimizer state mostly in partition files, the units' weights in files too,
    # the units below a block (worker.max_unit_params).
    overrides = (
        {
            "state_server__tier": nvme_tier(tmp_path),
            "worker__weights_nvme_path": str(tmp_path / "weights"),
            "worker__max_unit_params": 20_000,
            "worker__activation_checkpointing": "blocks",
            "worker__weight_window": 2,
        }
        if tiered
        else {}
    )
    config = tiny_config(steps=5, checkpoint__dir=str(tmp_path / "checkpoints"), **overrides)
    plan = plan_run(config)
    server_plan = plan.servers[0]
    assert (server_plan.nvme_state_bytes > 0) is tiered
    assert (server_plan.checkpoint_snapshot_bytes > 0) is not tiered

    with TrainingSession(config) as session:
        assert session.worker_resident_bytes() == plan.worker.buffers  # both are buffer sizes: equal
        targets = {(t.role, t.index): t.address for t in session.metrics_targets()}
        for _ in range(3):
            session.step()
        session.settle()  # a step returns with its update still in flight
        server = session.servers[0]
        by_tier = ray_get(server.__ray_call__.remote(lambda s: s.registry.bytes_by_tier()))
        summary = ray_get(server.__ray_call__.remote(lambda s: s.registry.storage.summary()))
        before = _scrape(targets[("state_server", 0)])
        session.step()
        session.step()
        session.settle()
        after = _scrape(targets[("state_server", 0)])
        worker = _scrape(targets[("worker", 0)])
        store = CheckpointDir(tmp_path / "checkpoints")
        saved = session.checkpoint_finish(store, session.checkpoint_begin(store))

    # One checkpoint: the files the plan counts, written or hard-linked as it says.
    assert saved.written_bytes + saved.linked_bytes == server_plan.checkpoint_bytes
    assert saved.written_bytes == server_plan.checkpoint_written_bytes
    assert (saved.linked_bytes > 0) is tiered

    # State per tier (12 B/element), once every partition reached its planned tier.
    assert by_tier["ram"] == server_plan.ram_state_bytes
    assert by_tier.get("nvme", 0) == server_plan.nvme_state_bytes
    # Memory the tiers hold: resident partitions in file layout plus the staging buffers.
    assert summary.ram_used_bytes == server_plan.ram_bytes
    assert summary.planned_nvme_bytes + server_plan.nvme_gradient_bytes == server_plan.nvme_file_bytes

    traffic = plan.worker.traffic
    assert (plan.worker.nvme_weight_bytes > 0) is tiered
    assert _total(worker, "cargohold_worker_weight_file_bytes_total", op="read") == 5 * traffic.weight_read_bytes
    # Written at registration, then after each update.
    assert _total(worker, "cargohold_worker_weight_file_bytes_total", op="write") == 6 * traffic.weight_write_bytes

    steps, sent, received = 5, "cargohold_transport_sent_bytes_total", "cargohold_transport_received_bytes_total"
    assert _total(worker, sent, rpc="PushGradient") == steps * plan.worker.traffic.push_bytes
    assert _total(after, received, rpc="PushGradient") == steps * server_plan.traffic.push_bytes
    # Weights are all a worker receives and a server sends, whichever call carries them
    # (co-located: the commit's, `CommitStep.shm`; else `FetchWeights`).
    assert _total(worker, received) == steps * plan.worker.traffic.fetch_bytes
    assert _total(after, sent) == steps * server_plan.traffic.fetch_bytes

    def per_step(name: str) -> float:
        return (_total(after, name) - _total(before, name)) / 2

    assert per_step("cargohold_tier_write_bytes_total") == server_plan.traffic.nvme_write_bytes
    read = per_step("cargohold_tier_read_bytes_total")
    planned = server_plan.traffic.nvme_read_bytes
    assert planned - server_plan.staging_bytes <= read <= planned


def ray_get(ref):
    import ray

    return ray.get(ref, timeout=60)


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_worker_buffers_match_a_real_run(ray_local) -> None:
    """bf16 weights and wire, 3 workers (uneven dim-0 shards: rank 0 holds the most),
    checkpointed blocks kept gathered: every worker's buffers are at most the plan's,
    rank 0's equal, and the bytes pushed and fetched are the plan's."""
    from cargohold.cluster.launcher import TrainingSession
    from cargohold.services.worker.host_allocator import loaded_allocator

    config = tiny_config(
        steps=2,
        worker__num_workers=3,
        worker__compute_dtype="bfloat16",
        worker__grad_wire_dtype="bfloat16",
        worker__activation_checkpointing="blocks",
        worker__reshard_after_forward=False,
    )
    plan = plan_run(config)
    with TrainingSession(config) as session:
        resident = [ray_get(w.resident_bytes.remote()) for w in session.workers]
        allocators = [ray_get(w.__ray_call__.remote(lambda self: loaded_allocator())) for w in session.workers]
        address = {(t.role, t.index): t.address for t in session.metrics_targets()}[("worker", 0)]
        session.step()
        session.step()
        session.settle()
        worker = _scrape(address)
    assert resident[0] == plan.worker.buffers
    assert allocators == ["mimalloc"] * 3  # the workers' processes started with it preloaded
    assert all(r["exchange"] == plan.worker.buffers["exchange"] for r in resident)
    assert all(r["weights"] <= plan.worker.buffers["weights"] for r in resident)
    assert resident[-1]["weights"] < resident[0]["weights"]  # the last rank's chunks run short
    sent, received = "cargohold_transport_sent_bytes_total", "cargohold_transport_received_bytes_total"
    assert _total(worker, sent, rpc="PushGradient") == 2 * plan.worker.traffic.push_bytes
    assert _total(worker, received) == 2 * plan.worker.traffic.fetch_bytes  # weights, in whichever call
