"""One attempt at a run on Ray: connect (or start an in-process cluster), reserve a
placement group that keeps state servers next to the workers, start the actors, step
them, take checkpoints, and tear everything down, on success or failure.
:mod:`cargohold.cluster.supervise` drives a whole run with it, restarts included.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cargohold.cluster.actor_calls import get_all
from cargohold.cluster.connect import check_budget_on_cluster, connect_ray, resolve_auth_token
from cargohold.cluster.plan.budget import check_budget_memory
from cargohold.cluster.plan.run import budgeted_config
from cargohold.cluster.prometheus_sd import Target, write_file_sd
from cargohold.cluster.resume import check_resume, restored_loss_scale
from cargohold.cluster.schema.io import to_dict
from cargohold.cluster.schema.train import TrainConfig
from cargohold.cluster.sections import config_layout, config_task, port_config
from cargohold.cluster.step_ledger import StepEnd, StepLedger
from cargohold.cluster.sweep import sweep_tier_folders
from cargohold.services.checkpoint import MANIFEST_NAME, CheckpointDir, Manifest
from cargohold.services.checkpoint.manifest import LossScaleRecord
from cargohold.services.checkpoint.reshard import layout_record, saved_layout, segment_runs
from cargohold.services.core.errors import CheckpointError, TrainingError
from cargohold.services.core.layout import Segment
from cargohold.services.core.loss_scale import LossScaleState
from cargohold.services.core.node import node_memory_bytes
from cargohold.services.data.rows import DocumentRows
from cargohold.services.server.state_server import StateServer
from cargohold.services.transport.auth import tls_files
from cargohold.services.worker.actor import TrainingWorker
from cargohold.services.worker.host_allocator import worker_allocator, worker_env
from cargohold.services.worker.model_setup import check_compute_dtype, step_policy
from cargohold.services.worker.param_groups import resolve_param_groups
from cargohold.services.worker.state_port import segment_spec
from cargohold.services.worker.step_report import EvalReport, StepReport
from cargohold.services.worker.task import TrainingTask
from cargohold.services.worker.weight_files import check_weights_root

logger = logging.getLogger(__name__)

BLOCKED_GRACE_S = 1.0
"""At teardown after a failed step: how long a worker's step may still take to end on its
own before it counts as blocked in a collective."""

Holder = tuple[Any, tuple[Segment, ...]]
"""An actor holding segments' state (a state server, or a worker with device segments)
and those segments."""


@dataclass(frozen=True, slots=True)
class PendingCheckpoint:
    step: int
    updates: int
    started: float
    """time.perf_counter() when it began."""
    stall_seconds: float
    loss_scale: LossScaleState | None = None
    """fp16 compute: the workers' dynamic loss scale at the checkpoint."""


@dataclass(frozen=True, slots=True)
class SavedCheckpoint:
    path: Path
    written_bytes: int
    """Bytes written or copied into it."""
    linked_bytes: int
    """Bytes of NVMe-tier files hard-linked into it: kept, not moved."""


class TrainingSession:
    """The actors of one run. ``start()``, then ``step()`` repeatedly, then ``close()``.

    Usable as a context manager; tests use it to inspect weights and server state
    between steps.
    """

    def __init__(self, config: TrainConfig, *, resume: Path | None = None, task: TrainingTask | None = None) -> None:
        """``resume``: a complete checkpoint folder to restore the servers' state from.
        ``task``: what to train (by default the model and data the config names)."""
        self.task = task or config_task(config)
        if config.cluster.address is None and not ray.is_initialized():  # the run's Ray starts on this machine
            check_budget_memory(config, node_memory_bytes(), "this machine")
            if config.worker.weights_nvme_path is not None:
                check_weights_root(config.worker.weights_nvme_path)  # as each worker will at its start
        config = budgeted_config(config, self.task)  # the host budget's split, kept by every process
        self.config = config
        self.resume = resume
        model, _, self.layout = config_layout(config, self.task)
        check_compute_dtype(config.worker.compute_dtype, model)  # before any actor starts
        self.param_groups = resolve_param_groups(config.optim, self.layout.params)  # bad patterns: before any actor
        data = self.task.open_data()  # refuses bad data before any actor starts; fills the cache the workers read
        self.data_documents: dict[str, int] = data.summary() if isinstance(data, DocumentRows) else {}
        """With rows of whole documents: what their placement made of the documents."""
        self.validates = self.task.open_eval() is not None  # the same for held-out data
        self.run_id = config.run_id or f"run-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        self.step_count = 0
        self.leaving: list[int] = []  # ranks whose last step reported a preemption notice
        self.ledger: StepLedger | None = None
        """Where the run stood after each recent step (:mod:`.step_ledger`): where a live
        recovery's settled update puts the run (:mod:`.live_recovery`)."""
        self.servers: list = []
        self.workers: list = []
        self.server_addresses: list[str] = []
        self._server_nodes: list[str] = []
        self._worker_generation = 0
        """How many times the workers were started (a live recovery starts them again)."""
        self._placement: PlacementGroup | None = None
        self._owns_ray = False
        self.collective_calls: list = []
        """The workers' calls of the last step, evaluation or settle, until every one ended."""
        self._auth_token = resolve_auth_token(config.security.auth_token_env)

    def __enter__(self) -> TrainingSession:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        cfg = self.config
        manifest = check_resume(self.resume, cfg, self.layout) if self.resume is not None else None
        self._owns_ray = connect_ray(cfg)
        if cfg.cluster.address is not None or not self._owns_ray:  # a cluster this machine need not hold
            check_budget_on_cluster(cfg)
        timeout = cfg.cluster.startup_wait_s
        worker_bundle = {"CPU": cfg.worker.cpus, "GPU": cfg.worker.gpus, **cfg.worker.resources}
        server_bundle = {"CPU": cfg.state_server.cpus, **cfg.state_server.resources}
        bundles = [server_bundle] * cfg.state_server.num_servers + [worker_bundle] * cfg.worker.num_workers
        self._placement = placement_group(
            [{k: v for k, v in b.items() if v} for b in bundles], strategy=cfg.cluster.placement_strategy
        )
        if not self._placement.wait(timeout_seconds=timeout):
            raise TrainingError(
                f"Ray could not place {len(bundles)} bundles ({cfg.state_server.num_servers} state servers "
                f"x {server_bundle}, {cfg.worker.num_workers} workers x {worker_bundle}) within {timeout}s "
                f"(tuning.cluster.startup_timeout_s) with strategy {cfg.cluster.placement_strategy}; lower "
                "worker.cpus/state_server.cpus or add nodes"
            )

        server_cls = ray.remote(StateServer)
        self.servers = [
            server_cls.options(
                num_cpus=cfg.state_server.cpus,
                resources=dict(cfg.state_server.resources),
                scheduling_strategy=self._on_bundle(i),
                name=f"{self.run_id}-state-server-{i}",
            ).remote(
                cfg.state_server,
                run_id=self.run_id,
                server_index=i,
                metrics_enabled=cfg.metrics.enabled,
                metrics_port=cfg.metrics.port_for("state_server", i, cfg),
                auth_token=self._auth_token,
                tls=tls_files(cfg.security),
            )
            for i in range(cfg.state_server.num_servers)
        ]
        # The workers start (a process each, torch imported, the data opened) while the
        # servers do: they need the servers' addresses only to form their process group.
        self.workers = list(self.new_workers().values())
        self.server_addresses = get_all([s.address.remote() for s in self.servers], timeout, "starting state servers")
        self._server_nodes = get_all([s.node_id.remote() for s in self.servers], timeout, "starting state servers")

        update = 0
        if self.resume is not None and manifest is not None:
            update, self.step_count = self._restore(self.resume, manifest, self._server_holders(), timeout)
            if device_holders := self._worker_holders():
                self._restore(self.resume, manifest, device_holders, timeout)
        rules = step_policy(self.config.optim, self.config.worker).loss_scale  # as every worker's
        scale = restored_loss_scale(manifest)
        self.join_workers(update, load=self.resume is not None, loss_scale=scale)
        if rules is not None and scale is None:
            scale = LossScaleState(rules.init_scale)
        self.ledger = StepLedger(self.step_count, StepEnd(update, scale), rules)
        logger.info(
            "run %s: %d workers, %d state servers at %s",
            self.run_id,
            len(self.workers),
            len(self.servers),
            ", ".join(self.server_addresses),
        )
        self.announce_metrics()

    def announce_metrics(self) -> None:
        """Log every actor's metrics endpoint and write them for Prometheus's file-based
        discovery (``metrics.file_sd_path``); again when replaced workers serve new ones."""
        targets = self.metrics_targets()
        logger.info("metrics endpoints: %s", ", ".join(f"{t.role}-{t.index} {t.address}" for t in targets))
        if self.config.metrics.file_sd_path:
            write_file_sd(self.config.metrics.file_sd_path, self.run_id, targets)

    def _on_bundle(self, index: int) -> PlacementGroupSchedulingStrategy:
        assert self._placement is not None, "the placement group is reserved first"
        return PlacementGroupSchedulingStrategy(placement_group=self._placement, placement_group_bundle_index=index)

    def new_workers(self, ranks: Iterable[int] | None = None) -> dict[int, Any]:
        """A worker actor for each of ``ranks`` (None: every rank), by rank, each on its
        rank's bundle of the placement group: a lost worker's replacement takes its bundle
        again (Ray places a bundle whose node went away elsewhere when it can). Their
        processes start in the background; the first call to one waits for it."""
        cfg = self.config
        self._worker_generation += 1
        suffix = "" if self._worker_generation == 1 else f"-{self._worker_generation}"
        worker_cls = ray.remote(TrainingWorker)
        return {
            rank: worker_cls.options(
                num_cpus=cfg.worker.cpus,
                num_gpus=cfg.worker.gpus,
                resources=dict(cfg.worker.resources),
                scheduling_strategy=self._on_bundle(cfg.state_server.num_servers + rank),
                name=f"{self.run_id}-worker-{rank}{suffix}",
                runtime_env={"env_vars": worker_env(worker_allocator(cfg.worker, cfg.cluster))},
            ).remote(cfg, rank=rank, run_id=self.run_id, auth_token=self._auth_token, task=self.task)
            for rank in (range(cfg.worker.num_workers) if ranks is None else ranks)
        }

    def join_workers(self, update: int, *, load: bool, loss_scale: LossScaleState | None = None) -> None:
        """Form the workers' process group, connect them to the servers and register their
        segments, which must stand at ``update``; ``load``: then fetch the servers' weights
        (a restore, a replacement), with the dynamic loss scale ``loss_scale`` (fp16)."""
        timeout = self.config.cluster.startup_wait_s
        host, port = get_all(self.workers[0].rendezvous_address.remote(), timeout, "starting workers")
        get_all(
            [w.init_process_group.remote(host, port, self.server_addresses, self._server_nodes) for w in self.workers],
            timeout,
            "forming the worker process group",
        )
        if load:  # the servers hold the segments: the workers only check them and read their update
            joins = [w.join_segments.remote() for w in self.workers]
            steps = set(get_all(joins, timeout, "joining the segments the servers hold"))
        else:
            steps = set(get_all([w.register_segments.remote() for w in self.workers], timeout, "registering segments"))
        if steps != {update}:
            raise TrainingError(f"workers' segments are at updates {sorted(steps)}, expected {update}")
        if load:
            get_all([w.load_weights.remote(loss_scale) for w in self.workers], timeout, "loading the servers' weights")

    def _restore(self, directory: Path, manifest: Manifest, holders: list[Holder], timeout: float) -> tuple[int, int]:
        """Restore the segments of ``holders`` (servers, or workers' device segments) from
        a checkpoint (checked by :func:`~cargohold.cluster.resume.check_resume`),
        whatever layout saved it; returns (updates, data step)."""
        saved = saved_layout(manifest, str(directory / MANIFEST_NAME))
        get_all(
            [
                actor.restore.remote(
                    str(directory),
                    manifest.to_json(),
                    [
                        (
                            segment_spec(port_config(self.config), self.run_id, seg, self.param_groups),
                            segment_runs(saved, self.layout, seg),
                        )
                        for seg in segments
                    ],
                )
                for actor, segments in holders
            ],
            timeout,
            f"restoring {directory}",
        )
        logger.info(
            "run %s: restored %s (step %d, %d updates)", self.run_id, directory, manifest.step, manifest.updates
        )
        return manifest.updates, manifest.step

    def _holders(self) -> list[Holder]:
        """Every actor that holds segments' state, with its segments: the state servers,
        then the workers with device segments (an actor with none is left out)."""
        return self._server_holders() + self._worker_holders()

    def _server_holders(self) -> list[Holder]:
        held = [(server, self.layout.segments_of_server(i)) for i, server in enumerate(self.servers)]
        return [(actor, segments) for actor, segments in held if segments]

    def _worker_holders(self) -> list[Holder]:
        held = [(worker, self.layout.device_segments(rank)) for rank, worker in enumerate(self.workers)]
        return [(actor, segments) for actor, segments in held if segments]

    def checkpoint_begin(self, store: CheckpointDir) -> PendingCheckpoint:
        """Snapshot every server's state as of the current step; the files are written
        in the background (RAM tier) while training goes on. On failure nothing of the
        checkpoint is left: whatever a server began has ended, the folder is gone."""
        started = time.perf_counter()
        step = self.step_count
        directory = store.begin(step)
        begun = []
        try:
            self.settle()
            begun = [h.checkpoint_begin.remote(self.run_id, str(directory), step) for h, _ in self._holders()]
            updates = set(get_all(begun, None, f"checkpointing step {step}"))
            if len(updates) != 1:
                raise TrainingError(f"segments are at different updates {sorted(updates)} at step {step}")
            scales = set(get_all([w.loss_scale.remote() for w in self.workers], None, "reading the loss scale"))
            if len(scales) != 1:
                raise TrainingError(f"workers hold different loss scales {sorted(map(str, scales))} at step {step}")
        except BaseException:  # a failure, or Ctrl-C / SIGTERM while the servers begin
            if begun:
                self._ignore_outcomes(begun + [h.checkpoint_wait.remote() for h, _ in self._holders()])
            _discard(store, step)
            raise
        return PendingCheckpoint(
            step=step,
            updates=updates.pop(),
            started=started,
            stall_seconds=time.perf_counter() - started,
            loss_scale=scales.pop(),
        )

    def checkpoint_finish(
        self, store: CheckpointDir, pending: PendingCheckpoint, *, timeout: float | None = None
    ) -> SavedCheckpoint:
        """Wait for the servers' files (up to ``timeout`` seconds), then write the
        manifest: the checkpoint is complete. On failure its folder is gone."""
        waits = [h.checkpoint_wait.remote() for h, _ in self._holders()]
        try:
            waited = get_all(waits, timeout, f"writing checkpoint {pending.step}")
            records = [r for rs, _ in waited for r in rs]
            manifest = Manifest(
                step=pending.step,
                updates=pending.updates,
                run_id=self.run_id,
                config=to_dict(self.config),
                model_signature=tuple((p.name, p.shape) for p in self.layout.params),
                layout=layout_record(self.layout),
                total=self.layout.total,
                segments=tuple(sorted((record for record, _ in records), key=lambda r: r.start)),
                files=tuple(file for _, file in records),
                loss_scale=(
                    LossScaleRecord(scale=pending.loss_scale.scale, growth_tracker=pending.loss_scale.growth_tracker)
                    if pending.loss_scale is not None
                    else None
                ),
            )
            path = store.commit(pending.step, manifest)
        except BaseException:  # a failure, or Ctrl-C / SIGTERM while the files are written
            self._ignore_outcomes(waits)  # no server still writes into the folder
            _discard(store, pending.step)
            raise
        linked = sum(n for _, n in waited)
        total = sum(f.nbytes for f in manifest.files)
        logger.info(
            "checkpoint of step %d written to %s (%d bytes, %d of them hard-linked from the NVMe tier)",
            pending.step,
            path,
            total,
            linked,
        )
        return SavedCheckpoint(path=path, written_bytes=total - linked, linked_bytes=linked)

    def _ignore_outcomes(self, refs: list) -> None:
        """Wait (up to ``tuning.state_server.rpc_timeout_s``) for calls of a checkpoint being
        given up to end; their errors are expected (a dead server, a failed save, nothing
        begun) and dropped."""
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.config.state_server.rpc_timeout_s)
        for ref in ready:
            try:
                ray.get(ref)
            except Exception as error:  # the checkpoint is given up either way
                logger.debug("a call of a checkpoint being given up failed: %s", error)

    def step(self) -> StepReport:
        """Run the next step on every worker; returns rank 0's report."""
        step = self.step_count + 1
        reports: list[StepReport] = self._on_workers(lambda w: w.train_step.remote(step), f"step {step}")
        self.leaving = [r.rank for r in reports if r.leaving]
        self.step_count = step
        assert self.ledger is not None, "the session is started first"
        self.ledger.record(step, skipped=reports[0].skipped, terms=reports[0].terms)
        return reports[0]

    def evaluate(self) -> EvalReport:
        """Validate every worker's model on the held-out set after the current step;
        returns rank 0's report (the loss is the same on every rank)."""
        step = self.step_count
        reports: list[EvalReport] = self._on_workers(lambda w: w.evaluate.remote(step), f"evaluating step {step}")
        return reports[0]

    def worker_weights(self, rank: int = 0) -> torch.Tensor:
        """Worker ``rank``'s range of the flat space: its newest weights, compute dtype."""
        return ray.get(self.workers[rank].local_weights.remote())

    def all_worker_weights(self) -> torch.Tensor:
        """The whole flat space of the workers' newest weights (ranges are in rank order)."""
        return torch.cat(ray.get([w.local_weights.remote() for w in self.workers]))

    def server_snapshots(self) -> list[dict[int, dict[str, torch.Tensor]]]:
        """Every server's full fp32 state by segment id, then every worker's of its device
        segments (tests: it is 12 bytes a parameter)."""
        self.settle()
        return ray.get([h.snapshot.remote(self.run_id) for h, _ in self._holders()])

    def server_masters(self) -> list[dict[int, torch.Tensor]]:
        """Every segment's fp32 master weights by segment id, a dict per holder (servers,
        then workers' device segments; 4 bytes a parameter; export)."""
        self.settle()
        return ray.get([h.masters.remote(self.run_id) for h, _ in self._holders()])

    def settle(self) -> None:
        """Wait for the updates the workers still have in flight: :meth:`step` returns
        before its units' updates end (each unit's next forward waits for its own), so the
        servers' state, and the transfers the metrics count, lag a step behind until this
        returns. Reading the servers' state here settles first."""
        self._on_workers(lambda w: w.settle.remote(), "settling the updates in flight")

    def _on_workers(self, call: Callable[[Any], Any], what: str) -> list:
        """``call`` on every worker (calls that meet in collectives); their results.
        Remembered until all end, so that :meth:`close` can tell a worker still blocked
        in a collective with a peer whose call failed."""
        self.collective_calls = [call(w) for w in self.workers]
        results = get_all(self.collective_calls, None, what)
        self.collective_calls = []
        return results

    def sweep_worker_folders(self) -> None:
        """Forget the workers' calls and remove the weight folders of workers that were
        killed (a live recovery), which they could not."""
        self.collective_calls = []
        if self._placement is not None:
            sweep_tier_folders(self.config, self.run_id, self._placement, len(self.servers), servers_too=False)

    def blocked_workers(self, grace_s: float = BLOCKED_GRACE_S) -> set[int]:
        """Ranks whose last collective call is still running ``grace_s`` after another one
        failed: it waits in a collective for a peer that left it, and would until gloo's or
        NCCL's own timeout (half an hour)."""
        calls = self.collective_calls
        if not calls:
            return set()
        ended, _ = ray.wait(calls, num_returns=len(calls), timeout=grace_s)
        return {rank for rank, ref in enumerate(calls) if ref not in ended}

    def metrics_targets(self) -> list[Target]:
        """Every actor's metrics endpoint, state servers first."""
        roles = [("state_server", i) for i in range(len(self.servers))] + [
            ("worker", r) for r in range(len(self.workers))
        ]
        addresses = ray.get([a.metrics_address.remote() for a in self.servers + self.workers])
        return [Target(address=a, role=role, index=i) for a, (role, i) in zip(addresses, roles) if a]

    def metrics_addresses(self) -> list[str]:
        return [t.address for t in self.metrics_targets()]

    def worker_resident_bytes(self) -> dict[str, int]:
        return ray.get(self.workers[0].resident_bytes.remote())

    def close(self) -> None:
        """Stop actors and release the placement group; shut Ray down if we started it.
        A worker still blocked in a collective after a failed step is killed at once (its
        shutdown would wait behind the step); the sweep removes what it leaves."""
        blocked = self.blocked_workers()
        self.collective_calls = []
        for rank in sorted(blocked):
            logger.warning("worker %d is blocked in a collective with a failed peer: stopping it", rank)
            ray.kill(self.workers[rank])
        stops = [(w, "shutdown") for rank, w in enumerate(self.workers) if rank not in blocked]
        for actor, method in stops + [(s, "stop") for s in self.servers]:
            try:
                ray.get(getattr(actor, method).remote(), timeout=30)
            except Exception as error:  # teardown must go on; the cause was already raised
                logger.warning("teardown of an actor failed: %s", error)
            ray.kill(actor)
        servers, self.workers, self.servers = len(self.servers), [], []
        if self._placement is not None:
            sweep_tier_folders(self.config, self.run_id, self._placement, servers)
            remove_placement_group(self._placement)
            self._placement = None
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = False


def _discard(store: CheckpointDir, step: int) -> None:
    """Remove the partial folder of a checkpoint that will not be committed; a failure
    only warns (the folder is never read, and the next commit removes it)."""
    try:
        store.abort(step)
    except CheckpointError as error:
        logger.warning("%s", error)
