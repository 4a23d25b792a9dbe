"""build_model and parameter_values (services/models/build.py): the values a worker
computes for any list of parameter names equal, bitwise, what the whole model holds, for
the built-in GPT, a transformers model built from its config (Llama; GPT-2 with tied
embeddings) and one loaded from a save_pretrained checkpoint."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from test_model_init import max_bytes_per_value

from cargohold.cluster.schema.io import from_dict
from cargohold.cluster.schema.train import TrainConfig
from cargohold.cluster.sections import config_task, model_spec
from cargohold.services.core.errors import ConfigError
from cargohold.services.models.build import buffer_values, build_model, parameter_values
from cargohold.services.models.gpt import GPT
from cargohold.services.models.init import initialize, module_seed

LLAMA = dict(
    vocab_size=320,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=64,
)
# GPT-2 ties lm_head to the token embedding.
GPT2 = dict(vocab_size=300, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)


def _config(seed: int = 7, **hf: str) -> TrainConfig:
    model = {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 32}
    return from_dict(TrainConfig, {"seed": seed, "model": model, "hf": hf})


def _meta(config: TrainConfig) -> torch.nn.Module:
    with torch.device("meta"):
        return build_model(model_spec(config), config.data)


def _assert_values_are_the_built_model(config: TrainConfig, names: list[str] | None = None) -> torch.nn.Module:
    full = build_model(model_spec(config), config.data)
    params = dict(full.named_parameters())
    got = list(parameter_values(model_spec(config), _meta(config), names))
    assert [name for name, _ in got] == (names if names is not None else list(params))
    for name, value in got:
        assert value.dtype == torch.float32 and torch.equal(value, params[name]), name
    return full


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama_dir(transformers, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    transformers.LlamaConfig(**LLAMA).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def gpt2_dir(transformers, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gpt2")
    transformers.GPT2Config(**GPT2).save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["fp32", "bf16-sharded"])
def gpt2_checkpoint(request, transformers, tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A save_pretrained folder of a random tied GPT-2, and its fp32 weights by HF name."""
    path = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(transformers.GPT2Config(**GPT2))
    if request.param == "fp32":
        model.save_pretrained(path)
    else:
        model.to(torch.bfloat16).save_pretrained(path, max_shard_size="20KB")
    return path, {name: p.detach().float() for name, p in model.named_parameters()}


# --- the built-in GPT ---------------------------------------------------------------------


def test_gpt_is_initialize_of_the_seed_and_meta_is_shapes_only() -> None:
    config = _config()
    state = torch.get_rng_state()
    built, meta = build_model(model_spec(config), config.data), _meta(config)
    assert torch.equal(torch.get_rng_state(), state)  # building draws nothing from the caller's RNG
    expected = GPT(config.model)
    initialize(expected, config.seed)
    for (name, a), (_, b) in zip(built.named_parameters(), expected.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert all(p.is_meta for p in meta.parameters())
    assert [(n, p.shape) for n, p in meta.named_parameters()] == [(n, p.shape) for n, p in built.named_parameters()]


def test_gpt_values_are_the_built_model() -> None:
    _assert_values_are_the_built_model(_config())
    _assert_values_are_the_built_model(_config(seed=3), ["blocks.1.attn.c_proj.weight", "wpe.weight", "ln_f.bias"])


# --- transformers from a config -----------------------------------------------------------


@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_transformers_from_config_values_are_the_built_model(model: str, llama_dir: Path, gpt2_dir: Path) -> None:
    config = _config(config_path=str(llama_dir if model == "llama" else gpt2_dir))
    full = _assert_values_are_the_built_model(config)
    names = [name for name, _ in full.named_parameters()]
    _assert_values_are_the_built_model(config, names[::-3])
    assert all(name.startswith("hf.") for name in names)


def test_tied_embedding_keeps_lm_heads_init_and_parents_rescale_projections(gpt2_dir: Path) -> None:
    full = config_task(_config(config_path=str(gpt2_dir))).build()
    assert full.hf.lm_head.weight is full.hf.transformer.wte.weight
    names = [name for name, _ in full.named_parameters()]
    assert "hf.transformer.wte.weight" in names and "hf.lm_head.weight" not in names
    # lm_head is initialised after the embedding (children first, in order): its draw wins.
    torch.manual_seed(module_seed(7, "hf.lm_head"))
    assert torch.equal(full.hf.transformer.wte.weight, torch.empty(300, 32).normal_(0.0, 0.02))
    # GPT2Attention owns no parameter, but its rule redraws c_proj's weight after c_proj's own.
    torch.manual_seed(module_seed(7, "hf.transformer.h.1.attn"))
    expected = torch.empty(32, 32).normal_(0.0, 0.02 / math.sqrt(2 * GPT2["n_layer"]))
    assert torch.equal(full.hf.transformer.h[1].attn.c_proj.weight, expected)


def test_transformers_init_overwrites_to_empty_garbage_and_ignores_skip_flags(llama_dir: Path) -> None:
    config = _config(config_path=str(llama_dir))
    built = build_model(model_spec(config), config.data)
    model = _meta(config).to_empty(device="cpu")
    with torch.no_grad():
        for tensor in (*model.parameters(), *model.buffers()):
            tensor.fill_(float("nan"))
    next(model.parameters())._is_hf_initialized = True  # what from_pretrained leaves on loaded tensors
    initialize(model, config.seed)
    for (name, a), (_, b) in zip(model.named_parameters(), built.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    # The rotary embedding's rule recomputes its buffers too.
    assert torch.equal(model.hf.model.rotary_emb.inv_freq, built.hf.model.rotary_emb.inv_freq)
    other = config_task(_config(seed=8, config_path=str(llama_dir))).build()
    assert all(not torch.equal(a, b) for a, b in zip(built.parameters(), other.parameters()) if a.std() > 0)


def test_transformers_values_hold_about_one_module_at_a_time(gpt2_dir: Path) -> None:
    meta = _meta(_config(config_path=str(gpt2_dir)))
    most, largest = max_bytes_per_value(meta, 7)
    assert 0 < most <= largest  # the tied embedding, replayed by both of its modules, is held once


# --- transformers from a checkpoint -------------------------------------------------------


def test_checkpoint_values_are_its_weights(gpt2_checkpoint) -> None:
    path, saved = gpt2_checkpoint
    config = _config(seed=99, checkpoint_dir=str(path))
    full = _assert_values_are_the_built_model(config)
    assert full.hf.lm_head.weight is full.hf.transformer.wte.weight
    loaded = {name.removeprefix("hf."): p for name, p in full.named_parameters()}
    assert loaded.keys() == saved.keys()
    for name, value in saved.items():
        assert torch.equal(loaded[name], value.bfloat16().float() if "bf16" in path.name else value), name


# --- buffers, and the worker's whole flow -------------------------------------------------


@pytest.mark.parametrize("source", ["gpt", "llama", "gpt2"])
def test_a_meta_build_filled_from_the_values_is_the_built_model(source: str, llama_dir: Path, gpt2_dir: Path) -> None:
    hf = {"gpt": {}, "llama": {"config_path": str(llama_dir)}, "gpt2": {"config_path": str(gpt2_dir)}}[source]
    _assert_meta_fill_is_the_built_model(_config(**hf), source)


def test_a_meta_build_filled_from_a_checkpoint_is_the_built_model(gpt2_checkpoint) -> None:
    _assert_meta_fill_is_the_built_model(_config(checkpoint_dir=str(gpt2_checkpoint[0])), "checkpoint")


def _assert_meta_fill_is_the_built_model(config: TrainConfig, source: str) -> None:
    """What a worker does (unsharded here): build on meta, ``to_empty``, fill parameters
    and buffers from the values; the forward is then the built model's, bitwise. (A plain
    ``to_empty`` unties tied parameters, FSDP2's does not: fill every alias here.)"""
    built, meta = build_model(model_spec(config), config.data), _meta(config)
    buffers = dict(buffer_values(config.seed, meta))
    assert buffers.keys() == dict(built.named_buffers()).keys()
    if source == "llama":
        assert buffers.keys() == {"hf.model.rotary_emb.inv_freq", "hf.model.rotary_emb.original_inv_freq"}
    by_id: dict[int, list[str]] = {}
    for name, param in meta.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    aliases = {names[0]: names for names in by_id.values()}
    values = list(parameter_values(model_spec(config), meta))
    model = meta.to_empty(device="cpu")
    with torch.no_grad():
        for name, value in values:
            for alias in aliases[name]:
                model.get_parameter(alias).copy_(value)
        for name, value in buffers.items():
            model.get_buffer(name).copy_(value)
    for name, buffer in built.named_buffers():
        assert torch.equal(model.get_buffer(name), buffer), name
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(model.eval()(x, x)[1], built.eval()(x, x)[1])


def test_a_buffer_no_rule_computes_is_refused() -> None:
    class Counter(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(2, 2)
            self.register_buffer("steps", torch.zeros((), dtype=torch.long))

        def init_module(self, name: str, module: torch.nn.Module) -> None:
            if isinstance(module, torch.nn.Linear):
                torch.nn.init.zeros_(module.weight)

    with torch.device("meta"):
        model = Counter()
    with pytest.raises(ConfigError, match="does not compute buffer steps"):
        list(buffer_values((_config()).seed, model))
