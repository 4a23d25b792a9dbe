"""What every process derives from the config about the model, and how a worker builds
its share of it: the meta-device model, its FSDP2 units and the layout (workers,
launcher, plan, tests), the sharded model with only local chunks allocated, and the
step's policy and exchange buffers.
"""

from __future__ import annotations

import os
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from cargohold.cluster.schema.optim import OptimConfig
from cargohold.cluster.schema.worker import DType, WorkerConfig
from cargohold.services.core.errors import ConfigError, TrainingError
from cargohold.services.core.layout import Layout
from cargohold.services.core.wire import WIRE_DTYPES
from cargohold.services.models.blocks import apply_activation_checkpointing
from cargohold.services.models.hf import HFCausalLM
from cargohold.services.worker.colocated_collectives import (
    SharedMemoryAllGather,
    SharedMemoryGroup,
    SharedMemoryReduceScatter,
    connect,
)
from cargohold.services.worker.sharding import (
    Unit,
    backward_gathered_units,
    check_unit_order,
    layout_for_units,
    shard_units,
    units_of,
)
from cargohold.services.worker.state_port import ExchangeBuffers
from cargohold.services.worker.step_policy import StepPolicy
from cargohold.services.worker.task import TrainingTask
from cargohold.services.worker.weight_files import WeightFiles, WeightObserver
from cargohold.services.worker.weight_window import WeightWindow


def resolve_device(worker: WorkerConfig) -> torch.device:
    """CUDA when the worker reserves GPUs (``worker.gpus`` above 0), else the CPU; a GPU
    worker that sees no CUDA device fails naming the key."""
    if not worker.on_gpus:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise TrainingError(
            f"worker.gpus={worker.gpus:g} asks for CUDA workers but this worker sees no CUDA device "
            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}; CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}); set worker.gpus=0 to train on CPUs"
        )
    return torch.device("cuda", torch.cuda.current_device())


def model_layout(task: TrainingTask, worker: WorkerConfig, num_servers: int) -> tuple[nn.Module, list[Unit], Layout]:
    """The meta-device model of ``task``, its FSDP2 units (``worker.max_unit_params``) and
    the layout over ``worker.num_workers`` workers and ``num_servers`` state servers that
    every process derives: workers, launcher, plan, tests."""
    with torch.device("meta"):
        model = task.build()
    units = units_of(model, task.blocks(model), max_params=worker.max_unit_params)
    layout = layout_for_units(
        model,
        units,
        num_workers=worker.num_workers,
        num_servers=num_servers,
        device_fraction=worker.optimizer_on_device_fraction,
    )
    return model, units, layout


def sharded_model(
    task: TrainingTask, worker: WorkerConfig, num_servers: int, device: torch.device
) -> tuple[nn.Module, list[Unit], Layout]:
    """The model of ``task`` sharded with FSDP2 (the process group must exist) as
    :func:`model_layout` lays it out, local shards allocated on ``device`` (host memory
    when offloaded) but not yet filled."""
    model, units, layout = model_layout(task, worker, num_servers)
    offload = params_in_host_memory(worker)
    if offload and device.type == "cuda":
        _check_pinned_memory()
    model.to(WIRE_DTYPES[worker.compute_dtype])  # FSDP2 keeps the shards in the dtype it finds
    if worker.activation_checkpointing == "blocks":
        apply_activation_checkpointing([block for _, block in task.blocks(model)])
    shard_units(
        units,
        compute_dtype=WIRE_DTYPES[worker.compute_dtype],
        reduce_dtype=WIRE_DTYPES[worker.grad_wire_dtype],
        reshard_after_forward=worker.reshard_after_forward,
        kept_gathered=worker.kept_gathered_units,
        offload=offload,
        pin_memory=device.type == "cuda",
    )
    model.to_empty(device="cpu" if offload else device)
    _set_buffers(task, model)
    check_unit_order(model, units)
    return model.train(), units, layout


def collectives_in_shared_memory(worker: WorkerConfig, device_type: str) -> bool:
    """Whether the workers try shared memory for FSDP2's collectives: several CPU workers
    with ``tuning.worker.shared_memory_collectives: auto``. Whether they all share a host is
    found when they start (:func:`colocated_collectives.connect`)."""
    return device_type == "cpu" and worker.num_workers > 1 and worker.shared_memory_collectives == "auto"


def share_collectives(
    units: list[Unit], layout: Layout, worker: WorkerConfig, device_type: str, run_id: str
) -> SharedMemoryGroup | None:
    """FSDP2's collectives of the sharded ``units`` through shared memory where
    :func:`collectives_in_shared_memory` and every worker is on this host, else gloo's
    (None); the regions are named for run ``run_id``. Collective: every rank of the
    default process group calls it."""
    world = dist.group.WORLD
    if world is None or not collectives_in_shared_memory(worker, device_type):
        return None
    shared = connect(world, largest_collective_bytes(layout, worker), run_id)
    if shared is not None:
        for unit in units:
            module = cast(FSDPModule, unit.module)
            module.set_custom_all_gather(SharedMemoryAllGather(shared))
            module.set_custom_reduce_scatter(SharedMemoryReduceScatter(shared))
    return shared


def largest_collective_bytes(layout: Layout, worker: WorkerConfig) -> int:
    """A unit's all-gather output or reduce-scatter input on one worker, the largest unit's
    (every worker's chunks, in the larger of the compute and wire dtypes)."""
    itemsize = max(WIRE_DTYPES[worker.compute_dtype].itemsize, WIRE_DTYPES[worker.grad_wire_dtype].itemsize)
    chunks = max(sum(place.padded_numel for place in layout.unit_params(u.index)) for u in layout.units)
    return chunks * worker.num_workers * itemsize


def check_compute_dtype(compute_dtype: DType, model: nn.Module) -> None:
    """Refuse fp16 compute (``worker.compute_dtype``) for a model that holds bf16
    parameters as built: their values may lie beyond fp16's range (65504), and a model
    made in bf16 was meant for it."""
    if compute_dtype != "float16":
        return
    bf16 = [name for name, param in model.named_parameters() if param.dtype == torch.bfloat16]
    if bf16:
        more = f" and {len(bf16) - 1} more" if len(bf16) > 1 else ""
        raise ConfigError(
            f"worker.compute_dtype=float16, but the model holds bfloat16 parameters ({bf16[0]!r}{more}): "
            "fp16 cannot hold bf16's range; set worker.compute_dtype=bfloat16"
        )


def params_in_host_memory(worker: WorkerConfig) -> bool:
    """The chunks live in host memory (FSDP2's CPU offload): asked for, or implied by
    weights on NVMe, which are read into host memory."""
    return worker.offload_params or worker.weights_nvme_path is not None


def weight_window(
    worker: WorkerConfig,
    model: nn.Module,
    units: list[Unit],
    layout: Layout,
    *,
    rank: int,
    run_id: str,
    observer: WeightObserver | None = None,
) -> WeightWindow | None:
    """With ``worker.weights_nvme_path``, the window the blocks' weights come into memory
    through (hooks on the sharded ``model``); None keeps every chunk in memory."""
    if worker.weights_nvme_path is None:
        return None
    itemsize = WIRE_DTYPES[worker.compute_dtype].itemsize
    sizes = [(u.stop - u.start) * itemsize for u in layout.units[1:]]
    files = WeightFiles(
        worker.weights_nvme_path,
        run_id,
        rank,
        largest_bytes=max(sizes, default=0),
        total_bytes=sum(sizes),
        observer=observer,
    )
    return WeightWindow(
        model,
        units,
        layout,
        rank,
        files,
        window=worker.weight_window,
        backward_gathered=backward_gathered_units(len(units), worker.reshard_after_forward, worker.kept_gathered_units),
    )


def _check_pinned_memory() -> None:
    """Offloaded shards live in page-locked memory; refuse clearly where there is none."""
    try:
        torch.empty(1, pin_memory=True)
    except RuntimeError as error:
        raise ConfigError(
            f"worker.offload_params needs pinned host memory, which this worker cannot "
            f"allocate ({error}); raise the memlock limit or set worker.offload_params=false"
        ) from error


def _set_buffers(task: TrainingTask, model: nn.Module) -> None:
    """Buffers made at construction (Llama's rotary frequencies) are garbage after
    ``to_empty``: recompute them as the task's build would."""
    with torch.device("meta"):
        shapes = task.build()
    if not any(True for _ in shapes.buffers()):
        return
    values = dict(task.buffer_values(shapes))
    if isinstance(model, HFCausalLM):
        model.set_buffers(values)
        return
    with torch.no_grad():
        for name, value in values.items():
            model.get_buffer(name).copy_(value)


def exchange_buffers(
    worker: WorkerConfig, push_dtype: DType, layout: Layout, *, shared_name: str | None = None, pin: bool = False
) -> ExchangeBuffers:
    """``tuning.worker.exchange_slots`` slots of the largest unit (gradients in
    ``push_dtype``, weights in the compute dtype), and the whole range's weights with the
    delayed update."""
    return ExchangeBuffers.allocate(
        layout.largest_unit,
        WIRE_DTYPES[push_dtype],
        WIRE_DTYPES[worker.compute_dtype],
        slots=worker.exchange_slots,
        held_numel=layout.worker_size if worker.delayed_update else 0,
        shared_name=shared_name,
        pin=pin,
    )


def step_policy(optim: OptimConfig, worker: WorkerConfig) -> StepPolicy:
    return StepPolicy(
        staged=optim.staged,
        nonfinite=optim.nonfinite,
        delayed_after=worker.delayed_update_after_steps if worker.delayed_update else None,
        loss_scale=optim.loss_scale.rules() if worker.compute_dtype == "float16" else None,
    )
