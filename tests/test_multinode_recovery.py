"""A worker's node removed mid-run, on a Ray cluster of several nodes on this machine
(ray.cluster_utils): its worker dies with the node, the state servers (on a node of
their own) keep the state, Ray places the lost bundle on a node added after the loss,
and the run goes on live from the servers, ending bitwise where the uninterrupted run
ends. The same path on one node, in the default run: tests/test_live_recovery.py."""

from __future__ import annotations

import pytest
import ray
from ray.cluster_utils import Cluster
from ray_start import cluster_of
from reference import reference_train, tiny_config

from cargohold.cluster.launcher import TrainingSession
from cargohold.cluster.supervise import train

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 8


@pytest.fixture
def three_nodes():
    """A head without CPUs, two worker nodes and one for the state server."""
    with cluster_of("trainer", "trainer", "hold") as cluster:
        yield cluster


def _node_of(actor) -> str:
    return ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))


def test_a_removed_worker_node_is_replaced_live_and_the_run_ends_bitwise(three_nodes: Cluster, tmp_path) -> None:
    cluster = three_nodes
    config = tiny_config(
        steps=STEPS,
        state_server__resources={"hold": 1},
        worker__resources={"trainer": 1},
        cluster__placement_strategy="STRICT_SPREAD",
        checkpoint__dir=str(tmp_path),
        checkpoint__every_steps=STEPS,  # only after the last step: nothing a recovery could read
        checkpoint__max_failures=1,
    )
    original_step = TrainingSession.step
    removed: list[str] = []
    nodes_after: list[set[str]] = []

    def step_with_node_loss(session: TrainingSession):
        if not removed and session.step_count == 4:
            node_id = _node_of(session.workers[1])
            (node,) = [n for n in cluster.worker_nodes if n.node_id == node_id]
            cluster.remove_node(node)  # its raylet and every process on it are killed
            removed.append(node_id)
            cluster.add_node(num_cpus=2, resources={"trainer": 1})  # where the lost bundle can go
        elif removed and not nodes_after:
            nodes_after.append({_node_of(w) for w in session.workers})
        return original_step(session)

    TrainingSession.step = step_with_node_loss  # type: ignore[method-assign]
    try:
        result = train(config)
    finally:
        TrainingSession.step = original_step  # type: ignore[method-assign]

    assert result.restarts == 1 and result.live_recoveries == 1 and result.steps_recomputed == 0
    assert removed[0] not in nodes_after[0] and len(nodes_after[0]) == 2, "the lost bundle moved to the new node"
    reference = reference_train(config, STEPS)
    assert result.losses == reference.losses
