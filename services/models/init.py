"""Deterministic initialisation one module at a time, so a shard can be initialised alone.

Each module is initialised by its model's *rule* (:meth:`GPT.init_module
<cargohold.services.models.gpt.GPT.init_module>`; for :class:`HFCausalLM
<cargohold.services.models.hf.HFCausalLM>` the transformers model's own
``_init_weights(module)``) with torch's global RNG seeded by :func:`module_seed` of
(seed, the module's qualified name), so its values do not depend on other modules.
:func:`initialize` runs the rules over a materialised model; :func:`initial_values`
gives the same values, bitwise, for a meta-device model, one rule's tensors at a time.

Modules are visited children first (transformers' own order): a parent's rule may
rewrite its children's parameters (GPT-2's attention and MLP rescale their ``c_proj``)
and must win. A tied parameter (one ``Parameter`` in two modules) keeps the value of the
*last* rule that writes it: for transformers' tied embeddings, ``lm_head``'s.
"""

from __future__ import annotations

import copy
import hashlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from itertools import groupby

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from cargohold.services.core.errors import ConfigError
from cargohold.services.models.hf import HFCausalLM

Rule = Callable[[str, nn.Module], None]
"""Initialises one module (given its qualified name) from torch's global RNG."""


def module_seed(seed: int, name: str) -> int:
    """A stable seed in [0, 2**63) for the module named ``name`` (sha256, not ``hash()``,
    which Python salts per process)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def init_rule(model: nn.Module) -> Rule:
    """The initialisation rule of ``model``."""
    if isinstance(model, HFCausalLM):
        return _hf_rule(model)
    rule = getattr(model, "init_module", None)
    if not callable(rule):
        raise ConfigError(
            f"{type(model).__name__} has no initialisation rule: cargohold initialises "
            "the built-in GPT and transformers models (hf.*)"
        )
    return rule


def init_order(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module once, with its qualified name, children before their parent."""
    order: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()

    def visit(name: str, module: nn.Module) -> None:
        seen.add(id(module))
        for child_name, child in module.named_children():
            if id(child) not in seen:
                visit(f"{name}.{child_name}" if name else child_name, child)
        order.append((name, module))

    visit("", model)
    return order


def initialize(model: nn.Module, seed: int) -> None:
    """Initialise a materialised model in place; the caller's RNG state is kept."""
    rule = init_rule(model)
    for tensor in (*model.parameters(), *model.buffers()):  # transformers' init skips flagged tensors
        if hasattr(tensor, "_is_hf_initialized"):
            delattr(tensor, "_is_hf_initialized")
    with _own_rng(), torch.no_grad():
        for name, module in init_order(model):
            torch.manual_seed(module_seed(seed, name))
            rule(name, module)


def initial_values(
    model: nn.Module, seed: int, names: Iterable[str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, value)`` of each parameter ``names`` lists (default: all, in
    ``named_parameters()`` order) of the meta-device, unsharded ``model``, as fp32 CPU
    tensors equal to what :func:`initialize` gives; only the tensors one rule writes are
    held at a time."""
    if any(not p.is_meta for p in model.parameters()):
        raise ValueError("initial_values needs a model built on the meta device")
    rule = init_rule(model)
    written, writers = _trace_writes(model, rule)
    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules(remove_duplicate=False))
    wanted = list(names) if names is not None else [name for name, _ in model.named_parameters()]
    for name in wanted:
        if not writers.get(id(params[name])):  # KeyError for a name the model lacks
            raise ConfigError(f"no initialisation rule of {type(model).__name__} writes {name}")
    # Consecutive parameters written by the same rules (a Linear's weight and bias) share one replay.
    for chain, grouped in groupby(wanted, key=lambda name: writers[id(params[name])]):
        run = list(grouped)
        values = {id(params[n]): torch.full(params[n].shape, float("nan"), dtype=params[n].dtype) for n in run}
        with _own_rng(), torch.no_grad():
            for writer in chain:
                torch.manual_seed(module_seed(seed, writer))
                rule(writer, _materialised(modules[writer], written[writer], values))
        for n in run:
            value = values[id(params[n])]
            if value.isnan().any():
                raise ConfigError(
                    f"the initialisation rule of {type(model).__name__} leaves part of {n} "
                    "unwritten; initial_values cannot compute it module by module"
                )
            yield n, value.to(torch.float32)


class _WriteRecorder(TorchDispatchMode):
    """Records the storages that ops write in place (``_cdata``: the storage object; meta
    tensors have one each, shared by their views)."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        for index, argument in enumerate(func._schema.arguments):
            if argument.alias_info is not None and argument.alias_info.is_write:
                tensor = kwargs.get(argument.name, args[index] if index < len(args) else None)
                if isinstance(tensor, torch.Tensor):
                    self.storages.add(tensor.untyped_storage()._cdata)
        return func(*args, **kwargs)


_Writes = tuple[dict[str, frozenset[int]], dict[int, tuple[str, ...]]]
_TRACES: weakref.WeakKeyDictionary[nn.Module, _Writes] = weakref.WeakKeyDictionary()


def _trace_writes(model: nn.Module, rule: Rule) -> _Writes:
    """Module name -> ids of the parameters its rule writes in place (views included;
    a rule that *assigns* a new tensor is not seen), and parameter id -> the modules whose
    rules write it, in init order. Found by running each rule on the meta model (no data:
    nothing changes); kept per model, as the worker asks for one FSDP2 unit at a time."""
    if model in _TRACES:
        return _TRACES[model]
    by_storage = {p.untyped_storage()._cdata: id(p) for p in model.parameters()}
    written: dict[str, frozenset[int]] = {}
    writers: dict[int, tuple[str, ...]] = {}
    with _own_rng(), torch.no_grad():
        for name, module in init_order(model):
            with _WriteRecorder() as recorder:
                rule(name, module)
            written[name] = frozenset(by_storage[s] for s in recorder.storages if s in by_storage)
            for pid in written[name]:
                writers[pid] = (*writers.get(pid, ()), name)
    _TRACES[model] = written, writers
    return written, writers


def _materialised(module: nn.Module, written: frozenset[int], values: dict[int, torch.Tensor]) -> nn.Module:
    """A copy of meta ``module`` in which the parameters its rule writes (ids of the
    originals) are CPU tensors: those in ``values`` share its storage, the rest are NaN."""
    clone = copy.deepcopy(module)
    original = {
        id(c): id(o)
        for (_, o), (_, c) in zip(
            module.named_parameters(remove_duplicate=False), clone.named_parameters(remove_duplicate=False), strict=True
        )
    }
    real: dict[int, nn.Parameter] = {}
    for sub in clone.modules():
        for key, param in sub._parameters.items():
            if param is None:
                continue
            pid = original.get(id(param))
            if pid in written:
                if pid not in real:
                    data = values[pid] if pid in values else torch.full(param.shape, float("nan"), dtype=param.dtype)
                    real[pid] = nn.Parameter(data, requires_grad=param.requires_grad)
                sub._parameters[key] = real[pid]
    return clone


def _hf_rule(model: HFCausalLM) -> Rule:
    """transformers' ``_init_weights`` of the nearest enclosing ``PreTrainedModel`` (what
    ``initialize_weights`` dispatches for composite models), without its skip flags."""
    from transformers import PreTrainedModel

    owners: dict[str, PreTrainedModel] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        owner = module if isinstance(module, PreTrainedModel) else owners.get(name.rpartition(".")[0])
        if owner is not None:
            owners[name] = owner

    def rule(name: str, module: nn.Module) -> None:
        owner = owners.get(name)
        if owner is not None:  # the wrapper itself has nothing to initialise
            owner._init_weights(module)

    return rule


def _own_rng() -> AbstractContextManager[None]:
    """Seeding inside this leaves the caller's CPU (and initialised CUDA) RNG as it was."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    return torch.random.fork_rng(devices=devices)
