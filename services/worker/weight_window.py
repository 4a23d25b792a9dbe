"""Which units' chunks are in host memory when the weights live on NVMe
(``worker.weights_nvme_path``): a bounded window, read ahead in the order FSDP2 uses them.

FSDP2 reads a unit's chunks (its local shards) only when it all-gathers the unit: before
the unit's forward and, for the units it frees after their forward
(:func:`~cargohold.services.worker.sharding.backward_gathered_units`), again before its backward. So a
unit's chunks need host memory only from a little before each gather to just after it.
Between uses the chunks' storage is freed (``untyped_storage().resize_(0)``, what FSDP2
does to the gathered weights it reshards) and the unit's file (:class:`WeightFiles`)
holds them; a read brings them back into the same storage objects, so FSDP2's views stay
valid. The root unit (embeddings, final norm, head) stays in memory.

The order of one micro-batch's uses is known in advance; :mod:`.window_schedule` keeps
the bookkeeping (which units are in memory, which to read next). The hooks release a
forward use after the unit's forward and a backward use in FSDP2's reduce hook, after
the unit's gradients are reduced. Where FSDP2 gathers ahead of a hook's reach (in
backward it gathers unit b-1 while b computes, and the last unit from the root's
pre-backward) the hooks ask for those entries too, taking them out of turn if the window
has not reached them: prefetch is only a hint, correctness never depends on it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from cargohold.services.core.errors import TrainingError
from cargohold.services.core.layout import Layout
from cargohold.services.worker.sharding import ParamCopies, Unit, local_tensors
from cargohold.services.worker.weight_files import WeightFiles
from cargohold.services.worker.window_schedule import BACKWARD, FORWARD, Entry, WindowSchedule, pass_entries


@dataclass(frozen=True, slots=True)
class _ChunkStorage:
    """The storage of one chunk (FSDP2's padded local shard) and its sizes."""

    storage: torch.UntypedStorage
    nbytes: int
    """Allocated: the padded chunk."""
    used: int
    """Bytes up to the end of the chunk's own elements (FSDP2's local view starts the
    storage); the rest is padding."""


class WeightWindow:
    """The tiered units (every unit but the root) of one worker's sharded model."""

    def __init__(
        self,
        model: nn.Module,
        units: Sequence[Unit],
        layout: Layout,
        rank: int,
        files: WeightFiles,
        *,
        window: int,
        backward_gathered: Collection[int],
    ) -> None:
        """``backward_gathered``: the units FSDP2 gathers again for their backward, so
        read twice per micro-batch."""
        self.schedule = WindowSchedule(window)
        self.layout = layout
        self.rank = rank
        self.files = files
        self.backward_gathered = frozenset(backward_gathered)
        self.tiered = list(range(1, len(units)))
        for index in self.tiered:
            resizable_chunks(units[index].module)
        with torch.no_grad():
            self._targets = local_tensors(model, layout)
        self._copies = ParamCopies.of(layout, rank)
        self._storages = {u: self._unit_storages(u) for u in self.tiered}
        self._dtype = self._targets[0].dtype
        self._lock = threading.Lock()
        self._loads: dict[int, Future[None]] = {}
        """The read of every unit in memory (done or running), as the schedule's ``resident``."""
        self._phase = FORWARD
        self._with_backward = False
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weights-read")
        self._handles = [h for u in self.tiered for h in self._hook(units[u].module, u)]
        self._untouched = set(self.tiered)
        """Units whose chunks FSDP2 allocated (``to_empty``: no page touched yet) and no
        read has filled: freed once FSDP2's lazy initialisation has seen them allocated."""
        self._handles.append(units[0].module.register_forward_pre_hook(self._after_lazy_init))
        if self.tiered and self.tiered[-1] in self.backward_gathered:
            self._handles.append(units[0].module.register_forward_hook(self._after_root_forward, prepend=True))

    # --- sizes ----------------------------------------------------------------------
    @property
    def host_bytes(self) -> int:
        """The most host memory the units' weights take: ``window`` units in memory and
        the files' read buffers."""
        largest = max((sum(c.nbytes for c in self._storages[u]) for u in self.tiered), default=0)
        return self.schedule.window * largest + self.files.buffers.count * self.files.buffers.nbytes

    # --- files ----------------------------------------------------------------------
    def write(self, unit: int, source: torch.Tensor) -> None:
        """Store the weights of unit ``unit``, ``source`` laid out as its part of the worker's
        range (what a fetch brings); the unit must not be in memory."""
        with self._lock:
            if unit in self._loads:
                raise TrainingError(f"unit {unit}'s weights were written while the unit is in use")
        placed = self.layout.units[unit]
        self.files.write(unit, source[: placed.stop - placed.start])

    def read(self, unit: int, out: torch.Tensor) -> None:
        """The part of unit ``unit`` in the worker's range, from its file, into ``out``."""
        buffer = self.files.read(unit)
        try:
            out.copy_(buffer.tensor[: out.numel() * out.element_size()].view(out.dtype))
        finally:
            self.files.done(buffer)

    def free_all(self) -> None:
        """Give back every unit's chunks (after a pass that did not finish)."""
        with self._lock:
            self.schedule.reset()
            loads, self._loads = list(self._loads.values()), {}
        for load in loads:
            load.exception()
        for unit in self.tiered:
            self._free(unit)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self.free_all()
        self._reader.shutdown(wait=True)
        self.files.close()

    # --- the window -----------------------------------------------------------------
    def begin(self, *, backward: bool) -> None:
        """Lay out the uses of the next micro-batch (its forward, and its backward when
        there is one) and start reading the first units."""
        with self._lock:
            leftover = bool(self._loads)
        if leftover:  # a pass that raised part-way: start clean
            self.free_all()
        with self._lock:
            self._phase, self._with_backward = FORWARD, backward and bool(self.backward_gathered)
            regathered = self.backward_gathered if self._with_backward else frozenset()
            self._read(self.schedule.begin(pass_entries(self.tiered, backward=regathered)))

    def ensure(self, entry: Entry) -> None:
        """Return once the entry's unit is in memory, taking it out of turn if needed."""
        with self._lock:
            self._read(self.schedule.ensure(entry))
            load = self._loads[entry[1]]
        if not load.done():
            started = time.perf_counter()
            load.exception()
            self.files.observer.add_weight_wait(time.perf_counter() - started)
        load.result()

    def release(self, entry: Entry) -> None:
        """The entry's gather is done: free the unit if no other taken use needs it, and
        read the next ones into the room made."""
        with self._lock:
            freed, reads = self.schedule.release(entry)
            if freed is not None:
                load = self._loads.pop(freed)
                load.exception()  # a read still running must end before its storage goes
                self._free(freed)
            self._read(reads)

    def release_backward(self, unit: int) -> None:
        """FSDP2 reduced the gradients of unit ``unit``: its backward gather is long done."""
        if unit in self._storages and unit in self.backward_gathered:
            self.release((BACKWARD, unit))

    def _read(self, units: list[int]) -> None:
        for unit in units:
            self._loads[unit] = self._reader.submit(self._load, unit)

    # --- moving the chunks ----------------------------------------------------------
    def _unit_storages(self, unit: int) -> list[_ChunkStorage]:
        placed = self.layout.units[unit]
        return [
            _ChunkStorage(
                t.untyped_storage(),
                t.untyped_storage().nbytes(),
                int(t.storage_offset() + t.numel()) * t.element_size(),
            )
            for t in self._targets[placed.first_param : placed.stop_param]
        ]

    def _load(self, unit: int) -> None:
        buffer = self.files.read(unit)
        try:
            for chunk in self._storages[unit]:
                if chunk.storage.nbytes() != chunk.nbytes:
                    chunk.storage.resize_(chunk.nbytes)
                # The chunk's own bytes are copied below; only FSDP2's padding after them is zeroed.
                torch.empty(0, dtype=torch.uint8).set_(chunk.storage)[chunk.used :].zero_()
            placed = self.layout.units[unit]
            source = buffer.tensor[: (placed.stop - placed.start) * self._dtype.itemsize].view(self._dtype)
            with torch.no_grad():
                self._copies.into_params(source, self._targets, unit, source_start=placed.start)
        finally:
            self.files.done(buffer)

    def _free(self, unit: int) -> None:
        for chunk in self._storages[unit]:
            chunk.storage.resize_(0)

    # --- hooks ----------------------------------------------------------------------
    def _hook(self, module: nn.Module, unit: int) -> list[Any]:
        def before(_module: nn.Module, _args: Any) -> None:
            if self._phase == FORWARD or unit in self.backward_gathered:
                self.ensure((self._phase, unit))
            # else activation checkpointing's recompute of a unit kept gathered: no chunk read

        def after(_module: nn.Module, _args: Any, output: Any) -> None:
            if self._phase == BACKWARD:
                return  # activation checkpointing's recompute: the backward use is released later
            if torch.is_grad_enabled():  # the hook also marks backward's start for the recompute above
                for tensor in _grad_tensors(output):
                    tensor.register_hook(self._before_backward(unit))
            self.release((FORWARD, unit))

        return [
            module.register_forward_pre_hook(before, prepend=True),
            module.register_forward_hook(after, prepend=True),
        ]

    def _before_backward(self, unit: int) -> Callable[[torch.Tensor], None]:
        """Runs before FSDP2's pre-backward hook of the unit (registered earlier on the same
        tensors), which gathers the unit and prefetches the one before it."""

        def hook(_grad: torch.Tensor) -> None:
            self._phase = BACKWARD
            if unit in self.backward_gathered:
                self.ensure((BACKWARD, unit))
            if unit - 1 in self.backward_gathered:
                self.ensure((BACKWARD, unit - 1))

        return hook

    def _after_lazy_init(self, _module: nn.Module, _args: Any) -> None:
        """After FSDP2's root pre-forward (registered before this hook), whose first run
        re-pads every chunk, and would copy a freed one: free the allocations no read used."""
        if not self._untouched:
            return
        with self._lock:
            untouched, self._untouched = self._untouched - set(self._loads), set()
        for unit in untouched:
            self._free(unit)

    def _after_root_forward(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        """FSDP2's root pre-backward prefetches the last unit: have it in memory first."""
        if torch.is_grad_enabled() and self._phase == FORWARD and self._with_backward:
            self.ensure((BACKWARD, self.tiered[-1]))


def resizable_chunks(unit: nn.Module) -> None:
    """Give each chunk of a ``fully_shard``-ed ``unit`` a storage the window can free and
    re-allocate. FSDP2 pins offloaded chunks with ``Tensor.pin_memory()``, whose storage
    torch makes fixed-size; a chunk whose storage is fixed gets a fresh one of the same
    kind (``torch.empty(..., pin_memory=...)`` is resizable), with its values, viewed by
    both of FSDP2's tensors of the chunk (its padded data and the ``DTensor``'s local
    view). Before FSDP2's lazy initialisation, which then finds them the same storage."""
    fsdp_param_group = cast(FSDPModule, unit)._get_fsdp_state()._fsdp_param_group  # FSDP2's name for the unit's state
    if fsdp_param_group is None:
        return
    with torch.no_grad():
        for fsdp_param in fsdp_param_group.fsdp_params:
            data = fsdp_param._sharded_param_data
            if data.untyped_storage().resizable():
                continue
            fresh = torch.empty(data.numel(), dtype=data.dtype, pin_memory=data.is_pinned())
            fresh.copy_(data)
            local = cast(DTensor, fsdp_param.sharded_param)._local_tensor
            data.set_(fresh.untyped_storage(), 0, data.size(), data.stride())
            local.set_(fresh.untyped_storage(), local.storage_offset(), local.size(), local.stride())


def _grad_tensors(output: Any) -> list[torch.Tensor]:
    """The tensors in a module's output that will receive gradients."""
    leaves, _ = torch.utils._pytree.tree_flatten(output)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
