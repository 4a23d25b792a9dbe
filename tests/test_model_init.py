"""Per-module seeded initialisation (services/models/init.py) on the built-in GPT and on
small hand-made models; transformers models are covered in test_model_build.py."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from cargohold.cluster.schema.model import GPTConfig
from cargohold.services.core.errors import ConfigError
from cargohold.services.models.gpt import GPT
from cargohold.services.models.init import init_order, initial_values, initialize, module_seed

TINY = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=64)


def _initialized(config: GPTConfig = TINY, seed: int = 7) -> GPT:
    model = GPT(config)
    initialize(model, seed)
    return model


def _on_meta(config: GPTConfig = TINY) -> GPT:
    with torch.device("meta"):
        return GPT(config)


def test_module_seed_is_stable_across_processes_and_in_range() -> None:
    # Pinned: a salted hash() would change with PYTHONHASHSEED, and every worker must agree.
    assert module_seed(0, "wte") == 5726198959261232025
    assert module_seed(7, "blocks.0.attn.c_proj") == 8658761324016445185
    seeds = {module_seed(seed, name) for seed in range(5) for name in ("wte", "wpe", "blocks.0.ln_1", "")}
    assert len(seeds) == 20 and all(0 <= s < 2**63 for s in seeds)


def test_initialize_is_deterministic_and_keeps_the_callers_rng() -> None:
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first = _initialized(seed=7)
    torch.manual_seed(999)  # the caller's RNG state does not matter ...
    second = _initialized(seed=7)
    for (name, a), (_, b) in zip(first.named_parameters(), second.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert not torch.equal(first.wte.weight, _initialized(seed=8).wte.weight)
    torch.manual_seed(123)
    model = GPT(TINY)
    after_build = torch.get_rng_state()
    initialize(model, 7)
    assert torch.equal(torch.get_rng_state(), after_build)  # ... and is left as it was
    assert not torch.equal(state, after_build)  # (construction itself draws torch's defaults)


def test_a_module_depends_only_on_seed_name_and_shape() -> None:
    two, three = _initialized(TINY), _initialized(GPTConfig(block_size=32, n_layer=3, n_head=2, n_embd=64))
    assert torch.equal(two.wte.weight, three.wte.weight)
    assert torch.equal(two.blocks[1].attn.c_attn.weight, three.blocks[1].attn.c_attn.weight)
    # The residual projections' std depends on the depth, so these differ (by the factor only).
    ratio = two.blocks[0].mlp.c_proj.weight / three.blocks[0].mlp.c_proj.weight
    torch.testing.assert_close(ratio, torch.full_like(ratio, math.sqrt(6 / 4)))


def test_gpt2_rule_values() -> None:
    model = _initialized(GPTConfig(n_layer=8), seed=0)
    residual = torch.cat([b.mlp.c_proj.weight.flatten() for b in model.blocks])
    assert residual.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert model.blocks[0].mlp.c_fc.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.wte.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.count_nonzero(model.blocks[0].attn.c_attn.bias) == 0
    assert torch.equal(model.ln_f.weight, torch.ones(384)) and torch.count_nonzero(model.ln_f.bias) == 0
    # Exactly one draw per module, from the module's own seed.
    torch.manual_seed(module_seed(0, "blocks.3.attn.c_proj"))
    expected = torch.empty(384, 384).normal_(0.0, 0.02 / math.sqrt(16))
    assert torch.equal(model.blocks[3].attn.c_proj.weight, expected)


def test_initial_values_on_meta_equal_initialize_bitwise() -> None:
    full = _initialized(seed=7)
    values = list(initial_values(_on_meta(), 7))
    assert [name for name, _ in values] == [name for name, _ in full.named_parameters()]
    for (name, value), param in zip(values, full.parameters(), strict=True):
        assert value.device.type == "cpu" and value.dtype == torch.float32
        assert torch.equal(value, param), name
    some = ["lm_head.weight", "blocks.1.mlp.c_proj.bias", "wte.weight", "blocks.0.ln_2.weight"]
    got = list(initial_values(_on_meta(), 7, some))
    assert [name for name, _ in got] == some
    params = dict(full.named_parameters())
    assert all(torch.equal(value, params[name]) for name, value in got)


class _AllocatedBytes(TorchDispatchMode):
    """Bytes of the CPU tensors created (factory ops) while active; in-place writes are free."""

    FACTORIES = {torch.ops.aten.empty.memory_format, torch.ops.aten.full.default, torch.ops.aten.empty_strided.default}

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        if func in self.FACTORIES and out.device.type == "cpu":
            self.bytes += out.numel() * out.element_size()
        return out


def max_bytes_per_value(model: nn.Module, seed: int) -> tuple[int, int]:
    """The most bytes allocated while computing one value, and the largest module's own."""
    largest = max(sum(p.numel() * 4 for p in m.parameters(recurse=False)) for m in model.modules())
    values = initial_values(model, seed)
    most = 0
    while True:
        with _AllocatedBytes() as counter:
            item = next(values, None)
        if item is None:
            return most, largest
        most = max(most, counter.bytes)


def test_initial_values_hold_about_one_module_at_a_time() -> None:
    config = GPTConfig(block_size=32, n_layer=4, n_head=2, n_embd=128)
    most, largest = max_bytes_per_value(_on_meta(config), 0)
    total = sum(p.numel() * 4 for p in _on_meta(config).parameters())
    assert 0 < most <= largest < total / 4


def test_modules_without_a_rule_or_unwritten_parameters_are_refused() -> None:
    with pytest.raises(ConfigError, match="Linear has no initialisation rule"):
        initialize(nn.Linear(2, 2), 0)

    class Partial(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self.scale = nn.Parameter(torch.ones(4))

        def init_module(self, name: str, module: nn.Module) -> None:
            if isinstance(module, nn.Linear):
                module.weight[0].normal_()  # only the first row
                module.bias.zero_()

    with torch.device("meta"):
        partial = Partial()
    with pytest.raises(ConfigError, match="writes scale"):
        list(initial_values(partial, 0, ["scale"]))
    with pytest.raises(ConfigError, match="leaves part of proj.weight unwritten"):
        list(initial_values(partial, 0, ["proj.weight"]))
    assert torch.equal(dict(initial_values(partial, 0, ["proj.bias"]))["proj.bias"], torch.zeros(4))
    with pytest.raises(KeyError, match="absent"):
        list(initial_values(partial, 0, ["absent"]))
    with pytest.raises(ValueError, match="meta device"):
        list(initial_values(GPT(TINY), 0))


def test_init_order_visits_children_before_parents_once() -> None:
    model = _on_meta()
    names = [name for name, _ in init_order(model)]
    assert len(names) == len(set(names)) == len(list(model.modules()))
    assert names[-1] == ""
    assert names.index("blocks.0.attn.c_proj") < names.index("blocks.0.attn") < names.index("blocks.0")
