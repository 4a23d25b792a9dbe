"""The correctness references: plain torch.optim.AdamW(fused=True), on one process and
under FSDP2 at the same world size.

:func:`reference_train` — one process. It sees exactly the data the workers see (rank r's
batch of each step), averages the per-rank gradients, clips with
torch.nn.utils.clip_grad_norm_ and steps torch.optim.AdamW(fused=True) on fp32 master
weights. With ``data.micro_batches`` it accumulates each micro-batch's averaged gradient,
cast to fp32, in micro-batch order, as FSDP2 accumulates into fp32 ``.grad``. With a
bf16 compute dtype it computes on the bf16 copy of the masters.

:func:`fsdp_reference_train` — what a user would run instead of cargohold: the same model
``fully_shard``-ed per block and at the root (fp32 parameters, MixedPrecisionPolicy with
the compute and wire dtypes), torch.optim.AdamW(fused=True) on the sharded parameters, in
W processes over gloo (from three processes its collectives go through shared memory as
the workers' do: the order of a sum of three or more is theirs). Its state is returned in
cargohold's flat space.

:func:`grad_scaler_recipe` — torch's documented fp16 recipe, one process: fp32 master
weights and an fp16 copy that computes, GradScaler's ``scale``, ``unscale_``, then
``torch.nn.utils.clip_grad_norm_``, then its ``step`` of AdamW(fused=True) and ``update``.
Its clipping divides by clip_grad_norm_'s fp32 norm, where cargohold divides by the fp64
norm rounded to fp32 (``fp64_norm=True`` does that, as the other two do with
``norm="shards"``): docs/api.md, "fp16 compute: which loop is bitwise".
"""

from __future__ import annotations

import copy
import math
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ports import free_port

from cargohold.cluster.schema.io import from_dict
from cargohold.cluster.schema.train import TrainConfig
from cargohold.cluster.sections import config_layout, config_task, model_spec
from cargohold.services.core.layout import Layout, scatter_params
from cargohold.services.core.optim import clip_, clip_coefficient, global_norm_from_squares, sum_of_squares
from cargohold.services.core.wire import WIRE_DTYPES
from cargohold.services.data import dropout_seed
from cargohold.services.models.blocks import transformer_blocks
from cargohold.services.models.build import build_model
from cargohold.services.worker.model_setup import share_collectives
from cargohold.services.worker.param_groups import resolve_param_groups
from cargohold.services.worker.sharding import local_tensors, params_to_range, units_of

STATES = ("masters", "exp_avg", "exp_avg_sq")


@dataclass
class ReferenceResult:
    state: dict[str, dict[str, torch.Tensor]]
    """masters / exp_avg / exp_avg_sq, each by parameter name."""
    losses: list[float]
    evals: dict[int, float]
    """Held-out mean loss after each step asked for (``eval.*``)."""

    def flat(self, layout: Layout, which: str = "masters") -> torch.Tensor:
        """The tensors of ``which`` laid out in the flat space (zeros in padding)."""
        return scatter_params(layout, self.state[which])


@dataclass
class FlatReference:
    flats: dict[str, torch.Tensor]
    """masters / exp_avg / exp_avg_sq in the flat space."""
    losses: list[float]
    loss_scales: list[float] = field(default_factory=list)
    """fp16 compute: GradScaler's scale at each step, before its update."""
    skipped: list[int] = field(default_factory=list)
    """fp16 compute: the steps whose update GradScaler skipped."""

    def flat(self, layout: Layout, which: str = "masters") -> torch.Tensor:
        return self.flats[which]


def reference_train(
    config: TrainConfig,
    steps: int,
    *,
    threads: int = 1,
    eval_steps: Iterable[int] = (),
    device: str = "cpu",
    norm: str = "torch",
) -> ReferenceResult:
    """Train ``steps`` steps in this process; ``threads`` should equal the workers'.
    After each of ``eval_steps``, the mean loss over the held-out set (``eval.*``).
    ``device`` computes forward and backward there (as GPU workers do); the masters and
    AdamW stay on the CPU, as on the state servers. ``norm``: the global gradient norm
    that clipping divides by, torch's (``clip_grad_norm_``) or, for runs whose clipping
    scales the updates, the workers' (``"shards"``: the squares summed in fp64, whose
    last bits can differ from torch's fp32 norm)."""
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _train(config, steps, set(eval_steps), torch.device(device), norm)
    finally:
        torch.set_num_threads(previous_threads)


def _evaluate(config: TrainConfig, model: torch.nn.Module, weights: list[torch.Tensor]) -> float:
    """The held-out loss on ``weights``, summed as the workers sum it: each rank's batches
    in order (each mean scaled by its weight over the number of batches), then the ranks."""
    held_out = config_task(config).open_eval()
    assert held_out is not None
    count, world = held_out.num_batches, config.worker.num_workers
    with torch.no_grad():
        for low, weight in zip(model.parameters(), weights):
            low.copy_(weight)
    model.eval()
    rank_losses = [0.0] * world
    with torch.no_grad():
        for rank in range(world):
            for index in range(count):
                batch = held_out.batch(index, rank)
                device = next(model.parameters()).device
                _, loss = model(batch.inputs.to(device), batch.targets.to(device))
                scale = batch.weight / count
                rank_losses[rank] += float(loss * scale if scale != 1.0 else loss)
    model.train()
    return sum(rank_losses) / world


def _train(config: TrainConfig, steps: int, eval_steps: set[int], device: torch.device, norm: str) -> ReferenceResult:
    world, micro_batches = config.worker.num_workers, config.data.micro_batches
    compute = WIRE_DTYPES[config.worker.compute_dtype]
    wire = WIRE_DTYPES[config.worker.grad_wire_dtype]
    master_model = build_model(model_spec(config), config.data)
    names = [name for name, _ in master_model.named_parameters()]
    masters = list(master_model.parameters())
    model = copy.deepcopy(master_model).to(device=device, dtype=compute)
    # Weights after each update (index 0: the initial ones). Step t computes on those of
    # update t-1, or of t-2 with the delayed parameter update once past its warm-up (the
    # first delayed step still computes on t-1: nothing was in flight before it).
    history = [[m.detach().clone() for m in masters]]
    warm_up = config.worker.delayed_update_after_steps
    o = config.optim
    optimizer = torch_adamw(config, dict(zip(names, masters)))
    data = config_task(config).open_data()
    losses = []
    evals: dict[int, float] = {}
    scaler = _grad_scaler(config)
    for step in range(1, steps + 1):
        with torch.no_grad():
            lag = 2 if config.worker.delayed_update and step > warm_up + 1 else 1
            for low, weights in zip(model.parameters(), history[max(step - lag, 0)]):
                low.copy_(weights)
        accumulated: list[torch.Tensor] | None = None
        rank_losses = [0.0] * world
        for micro in range(micro_batches):
            summed: list[torch.Tensor] | None = None
            for rank in range(world):
                batch = data.batch(step, rank, micro)
                torch.manual_seed(dropout_seed(config.seed, step, rank, micro))
                model.zero_grad(set_to_none=True)
                _, loss = model(batch.inputs.to(device), batch.targets.to(device))
                scale = batch.weight / micro_batches  # as the workers do: the step's mean over counted tokens
                if scale != 1.0:
                    loss = loss * scale
                (scaler.scale(loss) if scaler is not None else loss).backward()
                rank_losses[rank] += float(loss.detach())
                grads = [p.grad.to(device="cpu", dtype=wire) for p in model.parameters()]
                summed = grads if summed is None else [a + b for a, b in zip(summed, grads)]
            assert summed is not None
            reduced = [(grad / world).to(torch.float32) for grad in summed]  # FSDP2's reduce-scatter, cast
            accumulated = reduced if accumulated is None else [a + r for a, r in zip(accumulated, reduced)]
        losses.append(sum(rank_losses) / world)
        assert accumulated is not None
        for master, grad in zip(masters, accumulated):
            master.grad = grad
        if scaler is not None:
            scaler.unscale_(optimizer)
        norm_of_squares = global_norm_from_squares(sum(sum_of_squares(m.grad) for m in masters))
        if o.max_grad_norm > 0 and norm == "shards" and math.isfinite(norm_of_squares):
            clip_([master.grad for master in masters], clip_coefficient(norm_of_squares, o.max_grad_norm))
        elif o.max_grad_norm > 0 and norm != "shards":
            torch.nn.utils.clip_grad_norm_(masters, o.max_grad_norm)
        set_lr(optimizer, o.lr_at(step, config.steps))
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        history.append([m.detach().clone() for m in masters])
        if step in eval_steps:
            assert not config.worker.delayed_update, "evaluates on the newest weights only"
            evals[step] = _evaluate(config, model, history[-1])
    state = [optimizer.state[p] for p in masters]
    return ReferenceResult(
        state={
            "masters": {n: p.detach().clone() for n, p in zip(names, masters)},
            "exp_avg": {n: s["exp_avg"].clone() for n, s in zip(names, state)},
            "exp_avg_sq": {n: s["exp_avg_sq"].clone() for n, s in zip(names, state)},
        },
        losses=losses,
        evals=evals,
    )


def _grad_scaler(config: TrainConfig) -> torch.amp.GradScaler | None:
    """torch's GradScaler with the config's ``tuning.optim.loss_scale`` for fp16 compute."""
    if config.worker.compute_dtype != "float16":
        return None
    rules = config.optim.loss_scale
    return torch.amp.GradScaler(
        "cpu",
        init_scale=rules.init_scale,
        growth_factor=rules.growth_factor,
        backoff_factor=rules.backoff_factor,
        growth_interval=rules.growth_interval,
    )


@dataclass
class RecipeStep:
    """One step of :func:`grad_scaler_recipe`."""

    loss: float
    scale: float
    """GradScaler's scale the step's loss was multiplied by."""
    skipped: bool
    """GradScaler skipped the update (the scaled gradients overflowed)."""
    norm: float
    """What clip_grad_norm_ returned: the fp32 norm of the unscaled gradients."""
    gradients: dict[str, torch.Tensor]
    """The fp16 copy's gradients, by parameter name, as backward left them (scaled)."""


@dataclass
class RecipeRun:
    steps: list[RecipeStep]
    state: dict[str, dict[str, torch.Tensor]]
    """masters / exp_avg / exp_avg_sq after the last step, each by parameter name."""


def grad_scaler_recipe(config: TrainConfig, steps: int, *, threads: int = 1, fp64_norm: bool = False) -> RecipeRun:
    """torch's documented fp16 loop on one process, nothing of cargohold's update in it:
    fp32 masters (``build_model``) with an fp16 copy that runs forward and backward on rank
    0's batches, the copy's gradients cast to fp32 as the masters' ``.grad``, then
    ``scaler.unscale_``, ``clip_grad_norm_(masters, optim.max_grad_norm)``,
    ``scaler.step`` (AdamW(fused=True), the config's param groups and lr schedule) and
    ``scaler.update``; the copy takes the masters' new values, rounded to fp16. ``threads``
    as in :func:`reference_train`. ``fp64_norm``: clip by the norm of all the gradients in
    fp64, rounded to fp32 (``clip_grads_with_norm_``), as cargohold does, instead."""
    if config.worker.num_workers != 1 or config.data.micro_batches != 1:
        raise ValueError("the recipe is one process and one batch a step: set worker.num_workers=1, micro_batches=1")
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _recipe(config, steps, fp64_norm)
    finally:
        torch.set_num_threads(previous_threads)


def _recipe(config: TrainConfig, steps: int, fp64_norm: bool) -> RecipeRun:
    master_model = build_model(model_spec(config), config.data)
    names = [name for name, _ in master_model.named_parameters()]
    masters = list(master_model.parameters())
    model = copy.deepcopy(master_model).to(torch.float16)
    optimizer = torch_adamw(config, dict(zip(names, masters)))
    scaler = _grad_scaler(config)
    assert scaler is not None, "the recipe is for worker.compute_dtype=float16"
    data = config_task(config).open_data()
    recorded = []
    for step in range(1, steps + 1):
        with torch.no_grad():
            for low, master in zip(model.parameters(), masters):
                low.copy_(master)
        batch = data.batch(step, 0, 0)
        torch.manual_seed(dropout_seed(config.seed, step, 0, 0))
        model.zero_grad(set_to_none=True)
        _, loss = model(batch.inputs, batch.targets)
        if batch.weight != 1.0:
            loss = loss * batch.weight
        scale = scaler.get_scale()
        scaler.scale(loss).backward()
        gradients = {name: p.grad.detach().clone() for name, p in zip(names, model.parameters())}
        for master, low in zip(masters, model.parameters()):
            master.grad = low.grad.to(torch.float32)
        scaler.unscale_(optimizer)
        if fp64_norm:
            norm = torch.cat([m.grad.reshape(-1) for m in masters]).double().norm().float()
            torch.nn.utils.clip_grads_with_norm_(masters, config.optim.max_grad_norm, norm)
        else:
            norm = torch.nn.utils.clip_grad_norm_(masters, config.optim.max_grad_norm)
        set_lr(optimizer, config.optim.lr_at(step, config.steps))
        scaler.step(optimizer)
        scaler.update()
        skipped = scaler.get_scale() < scale
        recorded.append(RecipeStep(float(loss.detach()), scale, skipped, float(norm), gradients))
    state = [optimizer.state[p] for p in masters]
    return RecipeRun(
        steps=recorded,
        state={
            "masters": {n: p.detach().clone() for n, p in zip(names, masters)},
            "exp_avg": {n: s["exp_avg"].clone() for n, s in zip(names, state)},
            "exp_avg_sq": {n: s["exp_avg_sq"].clone() for n, s in zip(names, state)},
        },
    )


def torch_adamw(config: TrainConfig, params: dict[str, torch.nn.Parameter]) -> torch.optim.AdamW:
    """torch's AdamW(fused=True) over ``params`` (by name) with the param groups the config
    gives them (``optim.no_decay``, ``optim.param_groups``): each group's weight decay,
    and its lr multiplier kept as ``lr_mult`` for :func:`set_lr`."""
    o = config.optim
    layout = config_layout(config)[2]
    resolved = resolve_param_groups(o, layout.params)
    groups = [
        {
            "params": [params[name] for name in resolved.members(index, layout)],
            "weight_decay": group.weight_decay,
            "lr_mult": group.lr_scale,
        }
        for index, group in enumerate(resolved.groups)
    ]
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.betas[0], o.betas[1]), eps=o.eps, fused=True)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Each group's lr for the step: the schedule's times the group's multiplier."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group["lr_mult"]


def fsdp_reference_train(config: TrainConfig, steps: int, *, norm: str = "torch") -> FlatReference:
    """FSDP2 + AdamW(fused=True) over ``config.worker.num_workers`` gloo processes; with
    fp16 compute, torch.amp.GradScaler with the config's ``tuning.optim.loss_scale`` (unscale_,
    then clipping, then its step and update). ``norm`` as in :func:`reference_train`."""
    world = config.worker.num_workers
    with tempfile.TemporaryDirectory(prefix="cargohold-fsdp-ref-") as folder:
        mp.start_processes(
            _fsdp_rank,
            args=(world, free_port(), config, steps, folder, norm),
            nprocs=world,
            start_method="spawn",
            join=True,
        )
        ranks = [torch.load(Path(folder) / f"rank{r}.pt") for r in range(world)]
    flats = {which: torch.cat([rank[which] for rank in ranks]) for which in STATES}
    return FlatReference(
        flats=flats, losses=ranks[0]["losses"], loss_scales=ranks[0]["loss_scales"], skipped=ranks[0]["skipped"]
    )


def _shard_norm_clip(params: list[torch.nn.Parameter], max_norm: float) -> None:
    """Clip as the workers do: the global norm from the local shards' squares summed in
    fp64 and all-reduced (not clip_grad_norm_'s fp32 norm)."""
    local = [p.grad.to_local().reshape(-1) for p in params if p.grad is not None]
    total = torch.tensor(sum(map(sum_of_squares, local)), dtype=torch.float64)
    dist.all_reduce(total)
    global_norm = global_norm_from_squares(float(total))
    if math.isfinite(global_norm):  # else GradScaler skips the step anyway
        clip_(local, clip_coefficient(global_norm, max_norm))


def _fsdp_rank(rank: int, world: int, port: int, config: TrainConfig, steps: int, folder: str, norm: str) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(config.worker.torch_threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model = build_model(model_spec(config), config.data)
        _, _, layout = config_layout(config)
        units = units_of(model, transformer_blocks(model), max_params=config.worker.max_unit_params)
        policy = MixedPrecisionPolicy(
            param_dtype=WIRE_DTYPES[config.worker.compute_dtype],
            reduce_dtype=WIRE_DTYPES[config.worker.grad_wire_dtype],
        )
        for unit in units[1:]:
            fully_shard(unit.module, mp_policy=policy)
        fully_shard(model, mp_policy=policy, reshard_after_forward=False)
        if world > 2:
            # The workers (one host) reduce through shared memory; from three ranks on the
            # order of the sum is theirs, not gloo's (services/worker/colocated_collectives.py).
            share_collectives(units, layout, config.worker, "cpu", config.run_id or "reference")
        o = config.optim
        params = [dict(model.named_parameters())[place.name] for place in layout.params]
        optimizer = torch_adamw(config, dict(model.named_parameters()))
        data = config_task(config).open_data()
        losses: list[float] = []
        loss_scales: list[float] = []
        skipped: list[int] = []
        micro_batches = config.data.micro_batches
        scaler = _grad_scaler(config)
        for step in range(1, steps + 1):
            step_loss = 0.0
            for micro in range(micro_batches):  # FSDP2 sums the micro-batches' reduced gradients
                batch = data.batch(step, rank, micro)
                torch.manual_seed(dropout_seed(config.seed, step, rank, micro))
                _, loss = model(batch.inputs, batch.targets)
                scale = batch.weight / micro_batches
                if scale != 1.0:
                    loss = loss * scale
                (scaler.scale(loss) if scaler is not None else loss).backward()
                step_loss += float(loss.detach())
            total = torch.tensor(step_loss, dtype=torch.float64)
            dist.all_reduce(total)
            losses.append(float(total) / world)
            if scaler is not None:
                loss_scales.append(scaler.get_scale())
                scaler.unscale_(optimizer)  # found_inf is all-reduced over the mesh by DTensor
            if o.max_grad_norm > 0 and norm == "shards":
                _shard_norm_clip(params, o.max_grad_norm)
            elif o.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(params, o.max_grad_norm)
            set_lr(optimizer, o.lr_at(step, config.steps))
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
                if scaler.get_scale() < loss_scales[-1]:
                    skipped.append(step)
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        state = [optimizer.state[p] for p in params]
        out: dict[str, object] = {"losses": losses, "loss_scales": loss_scales, "skipped": skipped}
        with torch.no_grad():
            for which, tensors in (
                ("masters", local_tensors(model, layout)),
                ("exp_avg", [s["exp_avg"].to_local().reshape(-1) for s in state]),
                ("exp_avg_sq", [s["exp_avg_sq"].to_local().reshape(-1) for s in state]),
            ):
                out[which] = params_to_range(layout, rank, tensors, torch.empty(layout.worker_size))
        torch.save(out, Path(folder) / f"rank{rank}.pt")
        dist.barrier()  # rank 0 hosts the store: no rank may leave while another still uses it
    finally:
        dist.destroy_process_group()


PARAM_GROUPS = [
    {"name": "embeddings", "params": ["wte.*", "wpe.*"], "lr_mult": 0.5},
    {"name": "head", "params": ["lm_head.weight"], "lr_mult": 2.0, "weight_decay": 0.3},
    {"name": "last-block-norms", "params": ["blocks.1.ln_*"], "lr_mult": 0.25},
]
"""Groups over :func:`tiny_config`'s GPT's parameters (``optim.param_groups``): a group
decaying per the rule, one with its own decay, one of norms (so no decay) at a quarter of
the lr."""

WORKER_SIDE_CASES = {
    # Strict ZeRO-3: every block gathered again for backward (by default the last is kept).
    "every-block-regathered": dict(worker__kept_gathered_units=0),
    "delayed-no-clip": dict(worker__delayed_update=True, optim__max_grad_norm=0.0, optim__nonfinite="ignore"),
    # ZeRO-2-like: blocks stay gathered from forward to backward; and recomputed activations.
    "bf16-no-reshard-checkpointed": dict(
        worker__compute_dtype="bfloat16", worker__reshard_after_forward=False, worker__activation_checkpointing="blocks"
    ),
    # Parameter offload: FSDP2's CPUOffloadPolicy (on CPU workers the copies are host to host).
    "2-servers-bf16-offload-params": dict(
        state_server__num_servers=2, worker__compute_dtype="bfloat16", worker__offload_params=True
    ),
    # Param groups: biases and norms without decay, lr multipliers; every segment holds
    # fragments of several groups, one kernel call each (torch: one AdamW param group each).
    "2-servers-param-groups": dict(
        state_server__num_servers=2, optim__no_decay="biases_and_norms", optim__param_groups=PARAM_GROUPS
    ),
}
"""Overrides of :func:`tiny_config` that vary only worker-side options (num_servers kept
where it changes the layout's segments): tests/test_step.py trains them in-process in the
default run, tests/test_training_contract.py through Ray in the slow run."""

DEVICE_SEGMENT_CASES = {
    # Clipping configured: the device segments stage their gradients and commit with the
    # norm, like the servers'; bf16 weights, param groups cutting through the segments.
    "half-on-device-2-servers-bf16-param-groups": dict(
        state_server__num_servers=2,
        worker__optimizer_on_device_fraction=0.5,
        worker__compute_dtype="bfloat16",
        optim__no_decay="biases_and_norms",
        optim__param_groups=PARAM_GROUPS,
    ),
    # No clipping: updates applied as pushed, during backward; the servers own nothing.
    "all-on-device-no-clip": dict(
        worker__optimizer_on_device_fraction=1.0, optim__max_grad_norm=0.0, optim__nonfinite="ignore"
    ),
    # The one-step delayed update: the device segments' weights arrive in the held buffer too.
    "quarter-on-device-delayed-update": dict(
        state_server__num_servers=2, worker__optimizer_on_device_fraction=0.25, worker__delayed_update=True
    ),
}
"""Overrides of :func:`tiny_config` that give each worker a share of the optimizer
(``worker.optimizer_on_device_fraction``): tests/test_step.py trains them in-process (the
device segments through a :class:`SplitPort`), tests/test_device_fraction.py through Ray."""


def tiny_config(**overrides) -> TrainConfig:
    """A model small enough that a 20-step run takes seconds on 2 cores."""
    data = {
        "steps": 20,
        "seed": 7,
        "model": {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 32},
        "data": {"batch_size": 4, "corpus_bytes": 100_000},
        "optim": {"lr": 0.01, "weight_decay": 0.1, "max_grad_norm": 1.0e6, "warmup_steps": 3, "schedule": "cosine"},
        "worker": {"num_workers": 2, "cpus": 1},
        "state_server": {"num_servers": 1, "cpus": 1},
    }
    for dotted, value in overrides.items():
        *parents, leaf = dotted.split("__")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return from_dict(TrainConfig, data)
