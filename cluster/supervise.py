"""Drive a run to its end: the steps, checkpoints as configured, and recovery after a
failure (``checkpoint.max_failures``): a lost worker replaced from the state servers'
live state where it can be (:mod:`.live_recovery`), else every actor restarted from the
latest checkpoint.

:class:`~cargohold.cluster.launcher.TrainingSession` owns one attempt's actors; this
module decides when to checkpoint, what a failed save does (``checkpoint.on_save_error``)
and what a failed attempt restarts from.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from cargohold.cluster.claims import claimed_folders
from cargohold.cluster.export import master_weights
from cargohold.cluster.launcher import PendingCheckpoint, SavedCheckpoint, TrainingSession
from cargohold.cluster.live_recovery import replace_workers
from cargohold.cluster.resume import resolve_resume
from cargohold.cluster.schema.train import TrainConfig
from cargohold.cluster.sections import config_task
from cargohold.services.checkpoint import CheckpointDir
from cargohold.services.core.errors import CheckpointError, TrainingError
from cargohold.services.core.node import node_ip
from cargohold.services.metrics.launcher import LauncherMetrics
from cargohold.services.worker.step_report import EvalReport, StepReport
from cargohold.services.worker.task import TrainingTask

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class TrainResult:
    run_id: str
    resumed_run_id: str | None = None
    """The run whose checkpoint this one resumed (``checkpoint.resume``); None: a fresh start."""
    first_step: int | None = None
    """The step training started after (0, or a resumed checkpoint's); losses[i] is the
    loss of step first_step + i + 1."""
    losses: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    skipped_steps: list[int] = field(default_factory=list)
    """Steps whose update was skipped: a non-finite gradient norm (``optim.nonfinite:
    skip``), or with fp16 compute scaled gradients that overflowed."""
    loss_scale: float | None = None
    """fp16 compute: the dynamic loss scale of the last step."""
    server_addresses: list[str] = field(default_factory=list)
    metrics_addresses: list[str] = field(default_factory=list)
    worker_resident_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes rank 0 holds for training, by kind (weights, exchange)."""
    checkpoints: list[Path] = field(default_factory=list)
    checkpoint_stall_seconds: list[float] = field(default_factory=list)
    """How long each checkpoint held training up (the snapshot, not the writing)."""
    restarts: int = 0
    live_recoveries: int = 0
    """Of the restarts, those that replaced the workers from the state servers' live state
    (no checkpoint read, no completed step computed again: :mod:`.live_recovery`)."""
    recovery_seconds: list[float] = field(default_factory=list)
    """From each failure's restart to training again."""
    preemptions: int = 0
    """Preemption notices the run acted on: the workers replaced at a step boundary
    (:mod:`.live_recovery`), no failure counted."""
    steps_recomputed: int = 0
    """Completed steps the recoveries computed again: those after the checkpoint a restart
    resumed (none for a live recovery)."""
    evals: list[EvalReport] = field(default_factory=list)
    """Validations on the held-out set (``eval.*``), in step order; the last is after the
    last step."""
    data_documents: dict[str, int] = field(default_factory=dict)
    """With rows of whole documents (``data.packing``): documents kept, sequences and their
    padding tokens, and the over-long ones truncated, dropped, split, or dropped for having
    no counted target left (``data.overlong``)."""

    def rewind(self, step: int) -> int:
        """Forget what came after ``step``: a recovery goes on from there. Returns how many
        completed steps that forgot (they are computed again), counted in
        :attr:`steps_recomputed`."""
        done = step - (self.first_step or 0)
        forgotten = max(0, len(self.losses) - done)
        self.steps_recomputed += forgotten
        del self.losses[done:], self.step_seconds[done:]
        self.skipped_steps = [s for s in self.skipped_steps if s <= step]
        self.evals = [e for e in self.evals if e.step <= step]
        return forgotten


def train(
    config: TrainConfig,
    on_step: Callable[[StepReport], None] | None = None,
    *,
    on_eval: Callable[[EvalReport], None] | None = None,
    on_checkpoint: Callable[[Path], None] | None = None,
    metrics: LauncherMetrics | None = None,
    task: TrainingTask | None = None,
) -> TrainResult:
    """Run ``config.steps`` steps, taking checkpoints and validating as configured; on an
    actor failure restart everything from the latest checkpoint, up to
    ``checkpoint.max_failures``.

    ``on_step``, ``on_eval`` and ``on_checkpoint`` are called after each step, each
    validation, and each checkpoint that is complete (with its folder). ``task``: what to
    train, by default the model and data the config names.

    ``metrics``: where to count checkpoints, failures and recoveries and show the
    validation loss; by default the run serves its own (when metrics are enabled) until
    it ends."""
    on_main_thread = threading.current_thread() is threading.main_thread()
    if on_main_thread:
        signal.signal(signal.SIGUSR1, _request_checkpoint)
        terminate = signal.signal(signal.SIGTERM, _terminated)
    own_metrics = metrics is None
    if metrics is None:
        metrics = LauncherMetrics()
        if config.metrics.enabled:
            metrics.start(host=node_ip(), port=config.metrics.port_for("launcher", config.worker.num_workers, config))
            logger.info("launcher metrics on %s", metrics.address)
    try:
        return _train(config, _Callbacks(on_step, on_eval, on_checkpoint), metrics, task or config_task(config))
    finally:
        if own_metrics:
            metrics.stop()
        if on_main_thread:
            signal.signal(signal.SIGTERM, terminate)


@dataclass(frozen=True, slots=True)
class _Callbacks:
    on_step: Callable[[StepReport], None] | None
    on_eval: Callable[[EvalReport], None] | None
    on_checkpoint: Callable[[Path], None] | None


def _train(config: TrainConfig, callbacks: _Callbacks, metrics: LauncherMetrics, task: TrainingTask) -> TrainResult:
    with claimed_folders(config):  # checkpoint.dir and export_dir are this run's until it ends
        return _attempts(config, callbacks, metrics, task)


def _attempts(config: TrainConfig, callbacks: _Callbacks, metrics: LauncherMetrics, task: TrainingTask) -> TrainResult:
    """The run's attempts: the first, then a restart after each actor failure."""
    ckpt = config.checkpoint
    store = CheckpointDir(Path(ckpt.dir), keep_last=ckpt.keep_last, owners=set()) if ckpt.dir else None
    start = resolve_resume(ckpt.resume, store)
    resume = start
    result = TrainResult(run_id="")
    if start is not None:
        result.resumed_run_id = resumed_run(start, store)
    while True:
        try:
            _train_session(config, task, store, resume, result, callbacks, metrics)
            return result
        except TrainingError as error:
            metrics.record_failure()
            if result.restarts >= ckpt.max_failures:
                raise
            result.restarts += 1
            resume = _restart_point(store, result, start)
            logger.warning(
                "run failed (%s); restart %d of %d from %s",
                error,
                result.restarts,
                ckpt.max_failures,
                resume or "the initial state (no checkpoint of this run has landed)",
            )


def resumed_run(checkpoint: Path, store: CheckpointDir | None) -> str:
    """The run id of the checkpoint a run resumes, logged; the store counts that run's
    checkpoints as its own (this run continues it, so it prunes them in turn)."""
    run_id = CheckpointDir(checkpoint.parent).load(checkpoint).run_id
    logger.info("resuming run %s from %s", run_id, checkpoint)
    if store is not None and store.owners is not None and checkpoint.parent.resolve() == store.root.resolve():
        store.own(run_id)
    return run_id


def _restart_point(store: CheckpointDir | None, result: TrainResult, start: Path | None) -> Path | None:
    """Where a restart resumes: the newest checkpoint this run committed that is still
    complete, else where the run started (None: the initial state, step 0). Never a
    checkpoint of another run that happens to share ``checkpoint.dir``."""
    if store is not None:
        for path in reversed(result.checkpoints):
            try:
                return store.resolve(str(path))
            except CheckpointError as error:
                logger.warning("not restarting from %s: %s", path, error)
    return start


def _train_session(
    config: TrainConfig,
    task: TrainingTask,
    store: CheckpointDir | None,
    resume: Path | None,
    result: TrainResult,
    callbacks: _Callbacks,
    metrics: LauncherMetrics,
) -> None:
    every = config.checkpoint.every_steps
    recovering = time.perf_counter()
    with TrainingSession(config, resume=resume, task=task) as session:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, _terminated)  # again: ray.init, when the session started Ray, set its own
        if result.first_step is None:
            result.first_step = session.step_count
        recomputed = result.rewind(session.step_count)  # a recovery from a checkpoint repeats what came after
        if result.restarts:
            result.recovery_seconds.append(time.perf_counter() - recovering)
            metrics.observe_recovery(result.recovery_seconds[-1], recomputed)
        result.run_id = session.run_id
        if store is not None:
            store.own(session.run_id)
        result.server_addresses = list(session.server_addresses)
        result.metrics_addresses = session.metrics_addresses() + ([metrics.address] if metrics.serving else [])
        result.worker_resident_bytes = session.worker_resident_bytes()
        result.data_documents = dict(session.data_documents)
        metrics.observe_documents(session.data_documents)
        saves = _Saves(session, store, config, result, metrics, callbacks.on_checkpoint)
        try:
            while session.step_count < config.steps:
                try:
                    report = session.step()
                except TrainingError as error:
                    saves.recover()  # a checkpoint begun before the failure lands first (the servers are alive)
                    if not _recovered_live(session, error, result, metrics):
                        raise
                    continue
                result.losses.append(report.loss)
                result.step_seconds.append(report.seconds)
                if report.skipped:
                    result.skipped_steps.append(report.step)
                result.loss_scale = report.loss_scale
                if callbacks.on_step is not None:
                    callbacks.on_step(report)
                if _evaluates(config, session):
                    evaluation = session.evaluate()
                    result.evals.append(evaluation)
                    metrics.observe_eval(evaluation.step, evaluation.loss, evaluation.perplexity)
                    if callbacks.on_eval is not None:
                        callbacks.on_eval(evaluation)
                saves.finish()  # a pending checkpoint's files were written while this step ran
                if session.leaving:
                    _replace_on_notice(session, result, metrics)
                if store is not None and (
                    session.step_count == config.steps or _take_request() or (every and session.step_count % every == 0)
                ):
                    saves.begin()
            saves.finish()
        except BaseException:  # an actor failure, Ctrl-C, SIGTERM, a callback's exception...
            saves.recover()  # ...leaves no half-written checkpoint: the newest complete one resumes
            raise
        if config.export_dir is not None:
            task.export(
                session.layout, master_weights(session.layout, session.server_masters()), Path(config.export_dir)
            )


def _recovered_live(
    session: TrainingSession, error: TrainingError, result: TrainResult, metrics: LauncherMetrics
) -> bool:
    """Replace the workers of ``session`` after ``error`` from the state servers' live
    state (:mod:`.live_recovery`), within ``checkpoint.max_failures``; False where the run
    must restart from a checkpoint instead (the reason logged)."""
    limit = session.config.checkpoint.max_failures
    if result.restarts >= limit:
        return False
    started = time.perf_counter()
    before = session.step_count
    try:
        step = replace_workers(session)
    except TrainingError as refusal:  # UnsettledError too: the restart from a checkpoint counts the failure
        logger.warning("step %d failed (%s); no live recovery: %s", before + 1, error, refusal)
        return False
    metrics.record_failure()
    result.restarts += 1
    result.live_recoveries += 1
    if step - (result.first_step or 0) > len(result.losses):  # the lost step's update landed; its report did not
        result.losses.append(float("nan"))
        result.step_seconds.append(float("nan"))
    recomputed = result.rewind(step)  # 0: the servers stand after the last completed step
    result.recovery_seconds.append(time.perf_counter() - started)
    metrics.observe_recovery(result.recovery_seconds[-1], recomputed, live=True)
    logger.warning(
        "step %d failed (%s); workers replaced from the state servers' live state (recovery %d of %d), "
        "going on after step %d",
        before + 1,
        error,
        result.restarts,
        limit,
        step,
    )
    return True


def _replace_on_notice(session: TrainingSession, result: TrainResult, metrics: LauncherMetrics) -> None:
    """Some workers reported a preemption notice with their last step: replace the workers
    now, from the state servers' live state, before the leaving ones are gone (a planned
    loss: no failure is counted). Where the live state cannot carry the run, the run goes
    on and the loss, when it comes, recovers as any failure does."""
    leaving, step = session.leaving, session.step_count
    started = time.perf_counter()
    try:
        session.settle()  # the step's updates land first: nothing is left to settle
        replace_workers(session)
    except TrainingError as refusal:
        logger.warning("worker(s) %s leaving after step %d; not replaced now: %s", leaving, step, refusal)
        return
    result.preemptions += 1
    metrics.record_preemption()
    logger.warning(
        "worker(s) %s leaving (preemption notice) after step %d: workers replaced from the state servers' "
        "live state in %.1fs",
        leaving,
        step,
        time.perf_counter() - started,
    )


def _evaluates(config: TrainConfig, session: TrainingSession) -> bool:
    """Whether validation runs after the session's step: every ``eval_every_steps`` of
    the task (``eval.every_steps``) and after the last, when the task has held-out data."""
    step, every = session.step_count, session.task.eval_every_steps
    return session.validates and (step == config.steps or (every > 0 and step % every == 0))


class _Saves:
    """A session's checkpoints under ``checkpoint.on_save_error``; at most one is pending
    (begun, its files written while the next step runs).

    A save that fails, whether starting it (its folder cannot be created) or finishing it,
    leaves no folder behind and then either stops the run with a CheckpointError (``stop``:
    not an actor failure, so ``max_failures`` does not restart it) or is logged while
    training goes on (``continue``). However the session ends early (an actor failure,
    Ctrl-C, SIGTERM, an exception from a callback) :meth:`recover` finishes the pending
    checkpoint where every server still has its files, else discards it, so neither a
    restart nor a later resume meets a half-written one.
    """

    def __init__(
        self,
        session: TrainingSession,
        store: CheckpointDir | None,
        config: TrainConfig,
        result: TrainResult,
        metrics: LauncherMetrics,
        on_checkpoint: Callable[[Path], None] | None = None,
    ) -> None:
        self._session, self._store, self._config = session, store, config
        self._result, self._metrics = result, metrics
        self._on_checkpoint = on_checkpoint
        self._pending: PendingCheckpoint | None = None

    def begin(self) -> None:
        assert self._store is not None, "checkpoints are only taken with checkpoint.dir set"
        step = self._session.step_count
        try:
            self._pending = self._session.checkpoint_begin(self._store)
        except (CheckpointError, TrainingError) as error:
            self._failed(step, error)
            return
        self._result.checkpoint_stall_seconds.append(self._pending.stall_seconds)

    def finish(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None or self._store is None:
            return
        try:
            saved = self._session.checkpoint_finish(self._store, pending)
        except (CheckpointError, TrainingError) as error:
            self._failed(pending.step, error)
            return
        self._landed(pending, saved)

    def recover(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None or self._store is None:
            return
        timeout = self._config.state_server.rpc_timeout_s
        try:
            saved = self._session.checkpoint_finish(self._store, pending, timeout=timeout)
        except (CheckpointError, TrainingError) as error:
            logger.warning("the checkpoint of step %d, begun before the failure, is discarded: %s", pending.step, error)
            return
        logger.info("the checkpoint of step %d, begun before the failure, is complete", pending.step)
        self._landed(pending, saved)

    def _landed(self, pending: PendingCheckpoint, saved: SavedCheckpoint) -> None:
        seconds = time.perf_counter() - pending.started
        self._metrics.observe_checkpoint(pending.stall_seconds, seconds, saved.written_bytes, saved.linked_bytes)
        self._result.checkpoints.append(saved.path)
        if self._on_checkpoint is not None:
            self._on_checkpoint(saved.path)

    def _failed(self, step: int, error: CheckpointError | TrainingError) -> None:
        """Apply the save policy to ``error``; an actor failure is raised as it is."""
        if not _is_save_error(error):
            raise error
        if self._config.checkpoint.on_save_error == "stop":
            if isinstance(error, CheckpointError):
                raise error
            raise CheckpointError(f"checkpoint of step {step} not written: {error}") from error
        logger.warning("checkpoint of step %d not written, training goes on: %s", step, error)


_checkpoint_requested = threading.Event()


def _request_checkpoint(signum: int, frame: object) -> None:
    _checkpoint_requested.set()


def _terminated(signum: int, frame: object) -> None:
    """SIGTERM ends the run the way Ctrl-C does, through every ``finally``: the pending
    checkpoint is finished or discarded and the actors are stopped (exit status 143)."""
    raise SystemExit(128 + signum)


def _take_request() -> bool:
    """True once after SIGUSR1 asked for a checkpoint (on demand, e.g. before maintenance)."""
    if _checkpoint_requested.is_set():
        _checkpoint_requested.clear()
        return True
    return False


def _is_save_error(error: BaseException | None) -> bool:
    """A checkpoint write failed (here or, reported through Ray, on a state server)."""
    while error is not None:
        if isinstance(error, CheckpointError):
            return True
        error = getattr(error, "cause", None) or error.__cause__
    return False
