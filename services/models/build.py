"""The model a config names, and its initial values one parameter (or module) at a time.

:func:`build_model` gives the whole fp32 model (under ``torch.device("meta")`` only its
shapes); :func:`parameter_values` gives, for any list of parameter names, the same values
without building the whole model: seeded per module
(:func:`~cargohold.services.models.init.initial_values`) or read from the checkpoint
(:func:`~cargohold.services.models.weights.checkpoint_tensors`); :func:`buffer_values`
gives the buffers a meta build lacks. Every worker derives the same values for the same
names, so each can fill its own FSDP2 shards alone.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from cargohold.cluster.schema.data import DataConfig
from cargohold.services.core.errors import ConfigError
from cargohold.services.models.dimensions import check_model_fits_data
from cargohold.services.models.gpt import GPT
from cargohold.services.models.hf import build_hf_model, hf_name
from cargohold.services.models.init import Rule, init_order, init_rule, initial_values, initialize, module_seed
from cargohold.services.models.spec import ModelSpec
from cargohold.services.models.weights import checkpoint_tensors, tensor_files


def build_model(model: ModelSpec, data: DataConfig) -> nn.Module:
    """The transformers causal LM that ``model.hf`` names, else the built-in GPT: in fp32
    on the CPU with the checkpoint's weights or :func:`initialize`'s from ``model.seed``;
    under ``torch.device("meta")`` shapes only (nothing drawn, nothing read). Refused first
    when ``data`` cannot train it (:func:`check_model_fits_data`). The caller's RNG state
    is left as it was."""
    on_meta = torch.get_default_device().type == "meta"
    check_model_fits_data(model, data)
    with torch.random.fork_rng(devices=[]):  # construction draws torch's default inits
        built = build_hf_model(model.hf) if model.hf.enabled else GPT(model.gpt)
    if not on_meta and model.hf.checkpoint_dir is None:
        initialize(built, model.seed)
    return built


def parameter_values(
    model: ModelSpec, model_on_meta: nn.Module, names: Iterable[str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, fp32 CPU tensor)`` for each of ``names`` (default: every parameter, in
    ``named_parameters()`` order) of ``model_on_meta`` (``build_model(model, ...)`` built on
    the meta device, not sharded), bitwise what ``build_model(model, ...)`` holds; one
    parameter (or one module's) in memory at a time."""
    if model.hf.checkpoint_dir is None:
        yield from initial_values(model_on_meta, model.seed, names)
        return
    wanted = list(names) if names is not None else [name for name, _ in model_on_meta.named_parameters()]
    stored = _stored_names(Path(model.hf.checkpoint_dir), model_on_meta)
    in_checkpoint = [stored.get(name, hf_name(name)) for name in wanted]
    for name, (_, value) in zip(wanted, checkpoint_tensors(Path(model.hf.checkpoint_dir), in_checkpoint), strict=True):
        yield name, value


def buffer_values(seed: int, model_on_meta: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, CPU tensor)`` of every buffer of ``model_on_meta``, as the model built with
    seed ``seed`` holds it. Buffers are made at construction (Llama's rotary ``inv_freq``): a meta build
    has none and FSDP2's ``to_empty`` leaves them uninitialised. Each module's are
    recomputed by its initialisation rule (transformers' recomputes rotary frequencies)."""
    rule = init_rule(model_on_meta)
    for name, module in init_order(model_on_meta):
        keys = [key for key, buffer in module._buffers.items() if buffer is not None]
        if not keys:
            continue
        # Run the rule on two differently filled copies: a buffer it does not compute differs.
        zeros, ones = (_buffers_by_rule(rule, seed, name, module, keys, fill) for fill in (0, 1))
        for key in keys:
            qualified = f"{name}.{key}" if name else key
            if not torch.equal(zeros[key], ones[key]):
                raise ConfigError(
                    f"the initialisation rule of {type(model_on_meta).__name__} does not compute "
                    f"buffer {qualified}, so a model built on the meta device cannot be given it"
                )
            yield qualified, zeros[key]


def _buffers_by_rule(
    rule: Rule, seed: int, name: str, module: nn.Module, keys: list[str], fill: int
) -> dict[str, torch.Tensor]:
    clone = copy.deepcopy(module)  # parameters stay on meta
    for key in keys:
        built = clone._buffers[key]
        assert built is not None, f"{name} has no buffer {key}"
        clone._buffers[key] = torch.full_like(built, fill, device="cpu")
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(module_seed(seed, name))
        rule(name, clone)
    return {key: value for key in keys if (value := clone._buffers[key]) is not None}


def _stored_names(checkpoint_dir: Path, model: nn.Module) -> dict[str, str]:
    """Parameter name -> the name the checkpoint stores it under. A tied parameter is
    saved once, under one of its names (``save_pretrained`` drops the others)."""
    stored = tensor_files(checkpoint_dir).keys()
    named = list(model.named_parameters(remove_duplicate=False))
    aliases: dict[int, list[str]] = {}
    for name, param in named:
        aliases.setdefault(id(param), []).append(hf_name(name))
    return {name: next((a for a in aliases[id(param)] if a in stored), hf_name(name)) for name, param in named}
