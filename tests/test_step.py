"""The worker step without Ray or a network: FSDP2 over gloo, the state servers' registry
and staging in the worker's own process (LocalPort). World size 1 in this process, 2
under torch.multiprocessing; each bitwise against plain AdamW on one process."""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ports import free_port
from reference import DEVICE_SEGMENT_CASES, WORKER_SIDE_CASES, reference_train, tiny_config
from step_runs import assert_matches_reference, gloo_group, run_ranks, train_in_process

from cargohold.cluster.sections import config_layout, config_task, model_spec, port_config
from cargohold.services.data import dropout_seed
from cargohold.services.models.build import build_model, parameter_values
from cargohold.services.worker.device_port import LocalPort
from cargohold.services.worker.model_setup import exchange_buffers, sharded_model, step_policy
from cargohold.services.worker.param_groups import resolve_param_groups
from cargohold.services.worker.state_port import ExchangeBuffers
from cargohold.services.worker.step import ShardedStep

STRATEGIES = {
    "staged": dict(),
    "immediate": dict(optim__max_grad_norm=0.0, optim__nonfinite="ignore", worker__exchange_slots=1),
    "delayed": dict(worker__delayed_update=True, worker__delayed_update_after_steps=2),
    # Gradient accumulation: three micro-batches summed in fp32, one push per step.
    "accumulated": dict(data__micro_batches=3),
    "accumulated-immediate-bf16-wire": dict(
        data__micro_batches=2, optim__max_grad_norm=0.0, optim__nonfinite="ignore", worker__grad_wire_dtype="bfloat16"
    ),
    "accumulated-delayed": dict(data__micro_batches=2, worker__delayed_update=True),
    # Clipping that scales every update (the norms are ~1): each commit runs during the next step.
    "delayed-clipped": dict(
        worker__delayed_update=True, worker__delayed_update_after_steps=1, optim__max_grad_norm=0.05
    ),
    # Units below a block: the embeddings, attention, the MLP's projections and the head apart.
    "split-units-clipped": dict(worker__max_unit_params=20_000, optim__max_grad_norm=0.05),
    # The worker-side variants of tests/test_training_contract.py's CASES (there in the slow
    # run, through Ray).
    **WORKER_SIDE_CASES,
    # A share of the optimizer on each worker (tests/test_device_fraction.py through Ray).
    **DEVICE_SEGMENT_CASES,
}


def _train_all(rank: int, world: int, port: int, folder: str) -> None:
    """One rank of each strategy in turn, in one process group (one spawn per world size)."""
    with gloo_group(rank, world, port):
        for name, overrides in STRATEGIES.items():
            train_in_process(rank, tiny_config(steps=6, worker__num_workers=world, **overrides), Path(folder) / name)


@pytest.mark.parametrize("world", [1, 2])
def test_step_without_ray_matches_adamw_bitwise(world: int) -> None:
    """Each strategy equals the single-process reference: losses, the registry's masters
    and moments, the workers' weights."""
    with tempfile.TemporaryDirectory(prefix="cargohold-step-") as folder:
        results = run_ranks(_train_all, world, folder, STRATEGIES)
    for name, ranks in results.items():
        config = tiny_config(steps=6, worker__num_workers=world, **STRATEGIES[name])
        layout = config_layout(config)[2]
        clipping = config.optim.max_grad_norm < 1  # scales every update: clipped by the workers' norm
        reference = reference_train(config, config.steps, norm="shards" if clipping else "torch")
        if clipping:
            assert min(ranks[0]["norms"]) > config.optim.max_grad_norm, (name, ranks[0]["norms"])
        assert_matches_reference(name, ranks, layout, reference)


GATE_S = 20.0
"""How long the gated commit waits for its step to return before going on regardless."""


class _GatedPort:
    """A LocalPort whose CommitStep of update ``gated`` waits until the step that staged it
    has returned, recording the order of what happened: whether each commit saw the step
    return first, and whether each push of the next update found its segment committed."""

    def __init__(self, inner: LocalPort, gated: int) -> None:
        self.inner = inner
        self.gated = gated
        self.returned = threading.Event()
        self.committed: set[int] = set()
        self.record: list[tuple] = []

    def register(self, segment, initial):
        return self.inner.register(segment, initial)

    def update(self, segment, update, *, gradient, terms, out=None):
        if gradient is not None and update == self.gated + 1:
            self.record.append(("push", segment.segment_id, segment.segment_id in self.committed))
        if gradient is None and update == self.gated:
            self.record.append(("commit", segment.segment_id, self.returned.wait(timeout=GATE_S)))
        applied = self.inner.update(segment, update, gradient=gradient, terms=terms, out=out)
        if gradient is None and update == self.gated:
            self.committed.add(segment.segment_id)
        return applied

    def fetch(self, segment, update, out):
        self.inner.fetch(segment, update, out)

    def close(self) -> None:
        self.inner.close()


def _overlap(rank: int, port: int, folder: str, config) -> None:
    """Three steps with clipping on (and the delayed update past step 1, or not); the
    commit of update 2 is held until step 2 has returned."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        model, units, layout = sharded_model(
            config_task(config), config.worker, config.state_server.num_servers, torch.device("cpu")
        )
        gated = _GatedPort(
            LocalPort(port_config(config), "run", resolve_param_groups(config.optim, layout.params)), gated=2
        )
        policy = step_policy(config.optim, config.worker)
        step = ShardedStep(
            model,
            units,
            layout,
            0,
            gated,
            exchange_buffers(config.worker, config.push_dtype, layout),
            policy,
            device=torch.device("cpu"),
        )
        with torch.device("meta"):
            shapes = build_model(model_spec(config), config.data)
        step.register(lambda names: parameter_values(model_spec(config), shapes, names))
        data = config_task(config).open_data()
        losses = []
        for number in range(1, config.steps + 1):
            seeds = [dropout_seed(config.seed, number, 0, 0)]
            report = step.run(
                number, [data.batch(number, 0, 0)], config.optim.lr_at(number, config.steps), dropout_seeds=seeds
            )
            losses.append(report.loss)
            gated.record.append(("returned", number))
            if number == gated.gated:
                gated.returned.set()
        step.close()
        torch.save({"losses": losses, "record": gated.record}, Path(folder) / "overlap.pt")
    finally:
        dist.destroy_process_group()


OVERLAPS = {
    # The delayed update: the commit overlaps the next step's forward and backward.
    "delayed": tiny_config(
        steps=3,
        worker__num_workers=1,
        worker__delayed_update=True,
        worker__delayed_update_after_steps=1,
        optim__max_grad_norm=0.05,
    ),
    # The staged update: each unit's commit, fetch and adoption overlap the units before
    # it in the next step's forward, which waits for the unit's own before gathering it.
    "staged": tiny_config(steps=3, worker__num_workers=1, optim__max_grad_norm=0.05),
}


@pytest.mark.parametrize("config", OVERLAPS.values(), ids=OVERLAPS.keys())
def test_a_clipped_update_commits_after_its_step_returns(config) -> None:
    """With clipping (staged pushes), step t returns before its CommitStep runs: the
    servers' AdamW overlaps step t+1's compute (all of it with the delayed update, the
    forward up to each unit without), a segment's next push waits for its own commit,
    and the losses still equal the reference."""
    with tempfile.TemporaryDirectory(prefix="cargohold-step-") as folder:
        mp.start_processes(_overlap, args=(free_port(), folder, config), nprocs=1, start_method="spawn", join=True)
        result = torch.load(Path(folder) / "overlap.pt")
    record = result["record"]
    commits = [entry for entry in record if entry[0] == "commit"]
    pushes = [entry for entry in record if entry[0] == "push"]
    assert commits and all(waited for _, _, waited in commits), f"a commit ran inside step 2: {record}"
    assert pushes and all(committed for _, _, committed in pushes), f"a push overtook its commit: {record}"
    assert result["losses"] == reference_train(config, config.steps, norm="shards").losses


def test_exchange_buffers_lay_slots_and_held_weights_apart_in_one_shared_region() -> None:
    """Every view is aligned, none overlaps another, and a co-located server finds each
    by (path, offset) in the one region; slots go round as they are given back."""
    buffers = ExchangeBuffers.allocate(
        1000, torch.bfloat16, torch.float32, slots=2, held_numel=3000, shared_name="test-exchange"
    )
    try:
        views = [t for slot in buffers.slots for t in (slot.grads, slot.weights)] + [buffers.held]
        assert [v.numel() for v in views] == [1024, 1024, 1024, 1024, 3000]  # slots rounded up to 64
        spans = sorted(
            (buffers.shared_ref(v)[1], buffers.shared_ref(v)[1] + v.numel() * v.element_size()) for v in views
        )
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
        assert all(start % 64 == 0 for start, _ in spans)
        assert buffers.nbytes == spans[-1][1] == os.stat(buffers.region.path).st_size
        first = buffers.acquire()
        second = buffers.acquire()
        assert first is not second
        buffers.release(first)
        assert buffers.acquire() is first
        name = os.readlink(buffers.region.path)
        assert name.startswith("/memfd:cargohold-test-exchange-"), name
    finally:
        buffers.close()
    assert buffers.region.bytes.numel() == 0  # unmapped, and the memfd closed
