"""Live recovery (issue 42): a step that failed because a worker was lost, with every
state server alive, goes on from the servers' live state. No checkpoint is read and no
completed step is computed again.

1. **Refused** where the live state cannot carry the run (:func:`live_refusal`): fp16
   compute (the dynamic loss scale's history lives in the workers), a delayed update (the
   next step's forward needs the weights before the last update, which the servers no
   longer hold), device segments (``worker.optimizer_on_device_fraction``: their state
   died with the worker). A dead state server, or a standing no live state settles, is
   refused too. Each refusal recovers from the newest checkpoint instead, as before.
2. **Every worker is stopped**, the survivors too: a torch process group cannot lose a
   member and go on, so all of them are started again (in the same placement bundles).
3. **The servers settle the step in flight**: once the lost worker's calls have ended,
   each reports where its segments stand and an update some segments committed and
   others not is finished with the terms it was committed with
   (:mod:`~cargohold.services.core.settlement`).
4. **New workers join at the settled update** and fetch the servers' weights; the run
   goes on from the step after the one that reached that update.
"""

from __future__ import annotations

import logging

from cargohold.cluster.actor_calls import get_all
from cargohold.cluster.launcher import TrainingSession
from cargohold.cluster.schema.train import TrainConfig
from cargohold.services.core.errors import UnsettledError
from cargohold.services.core.settlement import settle

logger = logging.getLogger(__name__)


def live_refusal(config: TrainConfig) -> str | None:
    """Why a run with ``config`` cannot recover a lost worker live (None: it can)."""
    if config.worker.compute_dtype == "float16":
        return "fp16 compute: the dynamic loss scale's history lives in the workers"
    if config.worker.delayed_update:
        return "worker.delayed_update: the next step needs weights the servers no longer hold"
    if config.worker.optimizer_on_device_fraction > 0:
        return "worker.optimizer_on_device_fraction: the device segments' state was lost with the worker"
    return None


def replace_workers(session: TrainingSession) -> int:
    """Bring ``session`` back after a lost worker (see the module's docstring); returns the
    step it goes on from. Raises UnsettledError, or TrainingError (a state server did not
    answer), where the run must recover from a checkpoint instead."""
    config = session.config
    if reason := live_refusal(config):
        raise UnsettledError(reason)
    timeout = config.cluster.startup_timeout_s
    servers, run_id = session.servers, session.run_id
    get_all([s.address.remote() for s in servers], timeout, "checking that every state server is alive")
    session.stop_workers()
    calls_s = config.state_server.rpc_timeout_s
    if not all(get_all([s.quiet.remote(calls_s) for s in servers], timeout + calls_s, "waiting for calls to end")):
        raise UnsettledError(f"a state server still had calls of the lost workers in flight after {calls_s}s")
    standings = get_all([s.standing.remote(run_id) for s in servers], timeout, "reading the segments' standing")
    settlement = settle(standings)
    if settlement.finish is not None:
        finished = get_all(
            [s.finish_update.remote(run_id, settlement.update, settlement.finish) for s in servers],
            None,
            f"finishing update {settlement.update}",
        )
        logger.info("run %s: update %d finished on %d segments", run_id, settlement.update, sum(finished))
    reached = [s for s, updates in session.updates_after.items() if updates <= settlement.update]
    if not reached:
        raise UnsettledError(f"the servers stand at update {settlement.update}, behind every step the run recalls")
    step = max(reached)
    if session.updates_after[step] < settlement.update:  # the lost step's update was applied everywhere
        step += 1
        session.updates_after[step] = settlement.update
    for later in [s for s in session.updates_after if s > step]:
        del session.updates_after[later]
    session.workers = session.new_workers()
    session.join_workers(settlement.update, load=True)
    session.announce_metrics()
    session.step_count = step
    return step
