"""Live recovery (issue 42): a step that failed because a worker was lost, with every
state server alive, goes on from the servers' live state. No checkpoint is read and no
completed step is computed again.

1. **Refused** where the live state cannot carry the run (:func:`live_refusal`): device
   segments (``worker.optimizer_on_device_fraction``: their state died with the worker).
   A dead state server, or a standing no live state settles, is refused too. Each refusal
   recovers from the newest checkpoint instead, as before.
2. **The process group ends**: a torch process group cannot lose a member and go on.
   The workers that outlived the loss (not dead, not leaving on a preemption notice, not
   blocked in a collective with the lost one) leave it and stay: their processes, torch
   imported and data opened, join the next group. The others are killed, and only they
   are started again, in the same placement bundles; a dead or leaving worker's
   replacement starts at once, its process coming up while the rest is settled.
3. **The servers settle the step in flight**: once the lost worker's calls have ended,
   each reports where its segments stand and an update some segments committed and
   others not is finished with the terms it was committed with, and a delayed update
   committed nowhere with the terms its step reported
   (:mod:`~cargohold.services.core.settlement`).
4. **The next group joins at the settled update**: every worker builds its sharded model
   again and fetches the servers' weights; the run goes on from the step after the one
   that reached that update, with fp16 compute's loss scale as that step left it (the
   launcher's :mod:`.step_ledger` replays the scale's rules). With a delayed update the
   new group starts its pipeline afresh, as a run resumed from a checkpoint of that step
   does: its first step computes on the settled update's weights.
"""

from __future__ import annotations

import logging
from typing import Any

import ray

from cargohold.cluster.actor_calls import get_all
from cargohold.cluster.launcher import TrainingSession
from cargohold.cluster.schema.train import TrainConfig
from cargohold.cluster.step_ledger import StepEnd
from cargohold.services.core.errors import UnsettledError
from cargohold.services.core.settlement import settle

logger = logging.getLogger(__name__)

SURVIVOR_GRACE_S = 5.0
"""How long a worker whose step is still running after a peer was lost may take to end it
(gloo fails a collective with a dead peer within about a second on an idle machine; NCCL
waits) before it counts as blocked and is replaced too. The lost workers' replacements
start meanwhile, and take longer than this to come up."""


def live_refusal(config: TrainConfig) -> str | None:
    """Why a run with ``config`` cannot recover a lost worker live (None: it can)."""
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
    timeout = config.cluster.startup_wait_s
    get_all([s.address.remote() for s in session.servers], timeout, "checking that every state server is alive")
    lost = {rank for rank, call in enumerate(session.collective_calls) if _died(call)} | set(session.leaving)
    started = session.new_workers(lost)  # their processes start while the rest is settled
    kept: dict[int, Any] = {}
    try:
        kept = end_worker_group(session, surviving_workers(session))
        started |= session.new_workers(set(range(config.worker.num_workers)) - kept.keys() - started.keys())
        step, end = _settle_servers(session)
    except BaseException:  # the run restarts from a checkpoint: every worker goes
        for worker in [*kept.values(), *started.values()]:
            ray.kill(worker, no_restart=True)
        raise
    session.workers = [{**kept, **started}[rank] for rank in range(config.worker.num_workers)]
    session.leaving = []
    session.join_workers(end.updates, load=True, loss_scale=end.loss_scale)
    session.announce_metrics()
    session.step_count = step
    return step


def _settle_servers(session: TrainingSession) -> tuple[int, StepEnd]:
    """Once the lost workers' calls have ended, bring every segment to one update (the
    settled update); returns the step the run goes on after and where it stands then."""
    config, servers, run_id = session.config, session.servers, session.run_id
    timeout = config.cluster.startup_wait_s
    calls_s = config.state_server.rpc_timeout_s
    if not all(get_all([s.quiet.remote(calls_s) for s in servers], timeout + calls_s, "waiting for calls to end")):
        raise UnsettledError(f"a state server still had calls of the lost workers in flight after {calls_s}s")
    standings = get_all([s.standing.remote(run_id) for s in servers], timeout, "reading the segments' standing")
    assert session.ledger is not None, "a started session keeps its ledger"
    settlement = settle(standings, session.ledger.staged_terms)
    if settlement.finish is not None:
        finished = get_all(
            [s.finish_update.remote(run_id, settlement.update, settlement.finish) for s in servers],
            None,
            f"finishing update {settlement.update}",
        )
        logger.info("run %s: update %d finished on %d segments", run_id, settlement.update, sum(finished))
    return session.ledger.settle(settlement.update)


def surviving_workers(session: TrainingSession) -> set[int]:
    """The ranks whose workers can join the next process group: not leaving (a preemption
    notice), and where a step failed, not dead and not blocked in a collective."""
    calls, blocked = session.collective_calls, session.blocked_workers(SURVIVOR_GRACE_S)
    alive = set()
    for rank in range(len(session.workers)):
        if rank in session.leaving or rank in blocked:
            continue
        if not (calls and _died(calls[rank])):
            alive.add(rank)
    return alive


def _died(call: ray.ObjectRef) -> bool:
    """Whether the worker of a call that has ended died (a step that failed as a peer left
    its collectives leaves its worker alive); False for a call still running."""
    if not ray.wait([call], timeout=0)[0]:
        return False
    try:
        ray.get(call, timeout=0)
    except ray.exceptions.RayActorError:
        return True
    except Exception:
        return False
    return False


def end_worker_group(session: TrainingSession, keep: set[int]) -> dict[int, Any]:
    """End the workers' process group: the ranks of ``keep`` leave it and are returned by
    rank (one that cannot within the start-up timeout is killed too), the others are
    killed at once. Returns once Ray fails calls to the killed ones, after removing the
    weight folders they could not."""
    timeout = session.config.cluster.startup_wait_s
    workers = session.workers
    leaves = {rank: w.leave_group.remote() for rank, w in enumerate(workers) if rank in keep}
    killed = [w for rank, w in enumerate(workers) if rank not in keep]
    for worker in killed:
        ray.kill(worker, no_restart=True)
    kept = {}
    for rank, left in leaves.items():
        try:
            ray.get(left, timeout=timeout)
            kept[rank] = workers[rank]
        except Exception as error:  # dead after all, or stuck: replaced as the others are
            logger.warning("worker %d could not leave its process group (%s); replacing it", rank, error)
            ray.kill(workers[rank], no_restart=True)
            killed.append(workers[rank])
    for probe in [w.__ray_call__.remote(lambda actor: None) for w in killed]:
        try:
            ray.get(probe, timeout=timeout)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass  # dead, as asked
    session.workers = []
    session.sweep_worker_folders()
    logger.info("run %s: workers %s kept, %d replaced", session.run_id, sorted(kept), len(killed))
    return kept
