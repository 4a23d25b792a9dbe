"""Workers' nodes lost mid-run, on a Ray cluster of several nodes on this machine
(ray.cluster_utils). A node removed: its worker dies with it, the state servers (on a node
of their own) keep the state, Ray places the lost bundle on a node added after the loss,
and the run goes on live from the servers, ending bitwise where the uninterrupted run
ends. A node drained for preemption (what the spot manifest's preStop hook does) before
its worker is given the notice: the replacement waits for the node to go. The same paths
on one node, in the default run: tests/test_live_recovery.py."""

from __future__ import annotations

import threading
import time

import pytest
import ray
from actor_faults import notice_in_the_next_forward
from ray.cluster_utils import Cluster
from ray.core.generated import autoscaler_pb2
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


def _pinned_config(**more):
    """The tiny run with its state server on the "hold" node and a worker on each
    "trainer" node."""
    return tiny_config(
        steps=STEPS,
        state_server__resources={"hold": 1},
        worker__resources={"trainer": 1},
        cluster__placement_strategy="STRICT_SPREAD",
        **more,
    )


def _node_of(actor) -> str:
    return ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))


def test_a_removed_worker_node_is_replaced_live_and_the_run_ends_bitwise(
    three_nodes: Cluster, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = three_nodes
    config = _pinned_config(
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

    monkeypatch.setattr(TrainingSession, "step", step_with_node_loss)
    result = train(config)

    assert result.restarts == 1 and result.live_recoveries == 1 and result.steps_recomputed == 0
    assert removed[0] not in nodes_after[0] and len(nodes_after[0]) == 2, "the lost bundle moved to the new node"
    reference = reference_train(config, STEPS)
    assert result.losses == reference.losses


def test_a_notice_on_a_drained_node_waits_for_its_bundle_to_move_and_ends_bitwise(
    three_nodes: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """deploy/kuberay/raycluster-spot.yaml's preStop hook, on this machine: worker 1's node
    is drained for preemption (as `ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION`
    does), then the worker gets SIGTERM in the middle of step 5. It finishes the step and
    leaves; its replacement is not started on the drained node (Ray places nothing new
    there) but waits until the node is gone (removed 5 s later, as the pod is when the
    hook's wait ends) and Ray has moved the bundle to a spare node. The run goes on live,
    counting a preemption and no failure, and ends bitwise where the uninterrupted run
    ends."""
    cluster = three_nodes
    config = _pinned_config()

    def reclaim(node_id: str) -> None:
        (node,) = [n for n in cluster.worker_nodes if n.node_id == node_id]
        cluster.remove_node(node)

    original_step = TrainingSession.step
    drained: list[str] = []
    removal: list[threading.Timer] = []
    nodes_after: list[set[str]] = []

    def step_with_reclaim(session: TrainingSession):
        if not drained and session.step_count == 4:
            node_id = _node_of(session.workers[1])
            # The spare node joins now, from the main thread (Ray's Node sets a signal
            # handler, which a timer's thread may not): nothing goes there while the
            # drained node holds the bundle.
            cluster.add_node(num_cpus=2, resources={"trainer": 1})
            gcs = ray._raylet.GcsClient(address=cluster.address)
            reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
            accepted, why = gcs.drain_node(node_id, reason, "spot reclaim", int(time.time() * 1000) + 60_000)
            assert accepted, why
            drained.append(node_id)
            notice_in_the_next_forward(session.workers[1])
            removal.append(threading.Timer(5.0, reclaim, [node_id]))
            removal[0].start()
        elif drained and session.step_count == 5 and not nodes_after:
            nodes_after.append({_node_of(w) for w in session.workers})
        return original_step(session)

    monkeypatch.setattr(TrainingSession, "step", step_with_reclaim)
    try:
        result = train(config)
    finally:
        for timer in removal:
            timer.join()

    assert result.preemptions == 1 and result.restarts == 0 and result.steps_recomputed == 0
    assert drained[0] not in nodes_after[0] and len(nodes_after[0]) == 2, "the replacement waited for a live node"
    reference = reference_train(config, STEPS)
    assert result.losses == reference.losses
