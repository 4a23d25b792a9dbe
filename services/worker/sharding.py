"""FSDP2 on a worker: which parameters form each ``fully_shard`` unit, the layout that
follows from them, sharding a meta-device model, and moving values between FSDP2's local
shards and a worker's range of the flat space.

The units are the model's transformer blocks plus the root (every parameter outside a
block); with ``worker.max_unit_params`` blocks above the bound are split below (attention
and MLP, or their projections) and the embeddings and head are units of their own, as
torchtitan does, so that what a step holds on the device is bounded by a unit no larger
than the bound rather than by a block. Unit order in the layout: the root first, then
the others in forward order; a unit's parameters in ``named_parameters()`` order, which
is the order FSDP2 gives the unit's parameters and so the order of its reduce-scatter
output.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors

from cargohold.services.core.errors import TrainingError
from cargohold.services.core.layout import DEFAULT_ALIGN, ChunkPlace, Layout, build_layout

ROOT = ""
"""The root unit's name: the parameters outside every block."""


@dataclass(frozen=True, slots=True)
class Unit:
    """One ``fully_shard`` unit: its qualified name and its parameters' names."""

    name: str
    module: nn.Module
    param_names: tuple[str, ...]


def units_of(model: nn.Module, blocks: Sequence[tuple[str, nn.Module]], *, max_params: int = 0) -> list[Unit]:
    """The root unit, then one unit per block in forward order; with ``max_params`` (> 0)
    the units :func:`split_modules` finds instead of the blocks. Tied parameters belong to
    the first unit that holds them (``named_parameters`` yields a shared parameter once)."""
    names = {id(p): name for name, p in model.named_parameters()}
    modules = list(blocks) if max_params <= 0 else split_modules(model, blocks, max_params)
    in_unit: dict[str, str] = {}
    units = []
    for unit_name, module in modules:
        own = tuple(names[id(p)] for p in module.parameters() if names.get(id(p), "").startswith(unit_name + "."))
        if not own:
            raise TrainingError(f"block {unit_name!r} holds no parameters of its own; FSDP2 cannot shard it")
        in_unit.update(dict.fromkeys(own, unit_name))
        units.append(Unit(unit_name, module, own))
    root = tuple(name for name, _ in model.named_parameters() if name not in in_unit)
    return [Unit(ROOT, model, root), *units]


SMALL_UNIT_SHARE = 64
"""A module holding under ``max_params / SMALL_UNIT_SHARE`` parameters (a norm, a bias)
is not worth a unit of its own (a collective and hooks each pass): it stays in the root."""


def split_modules(
    model: nn.Module, blocks: Sequence[tuple[str, nn.Module]], max_params: int
) -> list[tuple[str, nn.Module]]:
    """The modules to ``fully_shard`` so that no unit holds more than ``max_params``
    parameters where the model allows it, in definition order (forward order for
    transformers: embeddings, each block's attention then MLP, head).

    Walking down from the root: a block within the bound is one unit; a module above it is
    split into its children (a leaf above it stays one unit: the embeddings of a large
    vocabulary); a module outside the blocks within the bound is a unit of its own (the
    embeddings, the head) unless it is small (``SMALL_UNIT_SHARE``), when it stays in the
    root like a block's norms. Never a unit: a module holding the blocks or a container
    without a forward (``ModuleList``), and a module with a parameter tied to another
    module (both must be gathered together: they stay in the root)."""
    names = {id(p): name for name, p in model.named_parameters()}
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    block_ids = {id(block) for _, block in blocks}
    found: list[tuple[str, nn.Module]] = []

    def own_size(module: nn.Module, name: str) -> tuple[int, bool]:
        own = [p for p in module.parameters() if names.get(id(p), "").startswith(name + ".")]
        return sum(p.numel() for p in own), any(owners[id(p)] > 1 for p in own)

    def visit(module: nn.Module, prefix: str) -> None:
        for child_name, child in module.named_children():
            name = f"{prefix}.{child_name}" if prefix else child_name
            size, tied = own_size(child, name)
            if size == 0:
                continue
            holds_blocks = any(id(m) in block_ids for m in child.modules() if m is not child)
            container = isinstance(child, (nn.ModuleList, nn.ModuleDict))
            divisible = any(True for _ in child.children())
            if holds_blocks or container or tied or (size > max_params and divisible):
                visit(child, name)
            elif id(child) in block_ids or size * SMALL_UNIT_SHARE >= max_params:
                found.append((name, child))

    visit(model, "")
    return found


def layout_for_units(
    model: nn.Module,
    units: Sequence[Unit],
    *,
    num_workers: int,
    num_servers: int,
    align: int = DEFAULT_ALIGN,
    device_fraction: float = 0.0,
) -> Layout:
    """The layout of ``units`` (works on a meta-device model)."""
    params = dict(model.named_parameters())
    return build_layout(
        ((name, tuple(params[name].shape)) for unit in units for name in unit.param_names),
        num_workers=num_workers,
        num_servers=num_servers,
        align=align,
        unit_sizes=[len(unit.param_names) for unit in units],
        unit_names=[unit.name for unit in units],
        device_fraction=device_fraction,
    )


def shard_units(
    units: Sequence[Unit],
    *,
    compute_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: bool,
    kept_gathered: int,
    offload: bool,
    pin_memory: bool,
) -> None:
    """``fully_shard`` each block, then the root (``units[0]``), in place.

    Weights are held and gathered in ``compute_dtype``; gradients are reduced in
    ``reduce_dtype``. With ``reshard_after_forward`` each unit is freed after its forward
    and gathered again for its backward, except the last ``kept_gathered`` units
    (:func:`backward_gathered_units`). With ``offload`` the sharded weights and gradients
    live in host memory (pinned if ``pin_memory``) and FSDP2 copies each unit to the
    device for its forward and backward."""
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=reduce_dtype)
    offload_policy = CPUOffloadPolicy(pin_memory=pin_memory) if offload else OffloadPolicy()
    regathered = backward_gathered_units(len(units), reshard_after_forward, kept_gathered)
    for index, unit in enumerate(units[1:], start=1):
        fully_shard(
            unit.module, mp_policy=policy, reshard_after_forward=index in regathered, offload_policy=offload_policy
        )
    # The root's parameters (embeddings, head) are needed first in backward: keep them.
    fully_shard(units[0].module, mp_policy=policy, reshard_after_forward=False, offload_policy=offload_policy)


def backward_gathered_units(count: int, reshard_after_forward: bool, kept_gathered: int) -> range:
    """The units (their indices in the layout; the root, 0, is never among them) that FSDP2 frees after
    their forward and gathers again for their backward, of ``count`` units in forward
    order: none without ``reshard_after_forward``, else all but the last ``kept_gathered``."""
    return range(1, max(1, count - kept_gathered)) if reshard_after_forward else range(0)


def divisor_after_reduce_hook(reduce_dtype: torch.dtype, device_type: str) -> float | None:
    """What FSDP2 divides a unit's reduced gradients by after running its all-reduce hook
    (``set_all_reduce_hook``, where cargohold pushes them), or None. fp32 and bf16 average
    in the reduce-scatter itself; for fp16 (overflow risk) FSDP2 splits the 1/W into a
    division before the collective and one after it, the second coming after the hook:
    1.5 at W=3, 2 at W=4 (none at W=2). FSDP2's own rule, private in torch 2.13 (pinned),
    asked as FSDP2 asks it: the default process group, no gradient divide factor set."""
    _, after, _, _ = _get_gradient_divide_factors(dist.group.WORLD, None, reduce_dtype, device_type)
    return after if after is not None and after != 1 else None


def local_tensors(model: nn.Module, layout: Layout) -> list[torch.Tensor]:
    """Each parameter's local shard (FSDP2's storage, in layout order), flattened: writing
    into them changes what the next all-gather sends."""
    params = dict(model.named_parameters())
    return [_local(params[place.name]).view(-1) for place in layout.params]


@dataclass(frozen=True, slots=True)
class ParamCopies:
    """Where each of a worker's local chunks lies in its range, worked out once from the
    layout: the copy of a unit's fetched weights into FSDP2's local shards, every update,
    reads no layout."""

    spans: tuple[tuple[tuple[int, int, int], ...], ...]
    """By unit: (parameter index, offset in the worker's range, elements) of each of its
    parameters this worker holds rows of."""

    @classmethod
    def of(cls, layout: Layout, worker: int) -> ParamCopies:
        return cls(
            tuple(
                tuple(
                    (index, place.offset, place.local_numel(worker))
                    for index, place in enumerate(layout.unit_params(unit.index), start=unit.first_param)
                    if place.local_numel(worker)
                )
                for unit in layout.units
            )
        )

    def into_params(
        self, source: torch.Tensor, targets: Sequence[torch.Tensor], unit: int, source_start: int = 0
    ) -> None:
        """Copy ``source``, the part of the worker's range from ``source_start`` on, into
        the local shards of unit ``unit`` among ``targets`` (layout order)."""
        for index, offset, numel in self.spans[unit]:
            at = offset - source_start
            targets[index].copy_(source[at : at + numel], non_blocking=True)


def params_to_range(
    layout: Layout, worker: int, sources: Sequence[torch.Tensor], out: torch.Tensor, unit: int | None = None
) -> torch.Tensor:
    """The local shards ``sources`` (layout order) laid into a worker-range tensor ``out``
    (padding zero); only the parameters of unit ``unit`` when given (the rest of ``out``
    untouched)."""
    places = layout.params if unit is None else layout.unit_params(unit)
    first = 0 if unit is None else layout.units[unit].first_param
    if unit is None:
        out.zero_()
    for index, place in enumerate(places, start=first):
        numel = place.local_numel(worker)
        if numel:
            out[place.offset : place.offset + numel].copy_(sources[index])
    return out


def padding_gaps(places: Iterable[ChunkPlace], start: int, stop: int) -> list[tuple[int, int]]:
    """Parts of a unit's range ``[start, stop)`` that no parameter's chunk covers (the
    alignment padding), relative to ``start``: what the step zeroes in a reused exchange slot."""
    gaps, at = [], start
    for place in places:
        if place.offset > at:
            gaps.append((at - start, place.offset - start))
        at = place.offset + place.padded_numel
    if stop > at:
        gaps.append((at - start, stop - start))
    return gaps


def check_unit_order(model: nn.Module, units: Sequence[Unit]) -> None:
    """Refuse to train if FSDP2 ordered a unit's parameters otherwise than the layout
    (its reduce-scatter output would then be read at the wrong offsets)."""
    params = dict(model.named_parameters())
    for unit in units:
        fsdp_param_group = getattr(cast(FSDPModule, unit.module)._get_fsdp_state(), "_fsdp_param_group", None)
        got = [id(p.sharded_param) for p in fsdp_param_group.fsdp_params] if fsdp_param_group is not None else []
        if got != [id(params[name]) for name in unit.param_names]:
            raise TrainingError(
                f"FSDP2 holds the parameters of unit {unit.name or '<root>'!r} in another order "
                "than the layout; cannot map its reduced gradients"
            )


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if hasattr(param, "to_local") else param.data


def drop_grad(param: torch.Tensor) -> None:
    """A post-accumulate-grad hook: FSDP2's sharded gradient is dropped unread (the
    reduced chunks were copied into an exchange slot by the all-reduce hook)."""
    param.grad = None
