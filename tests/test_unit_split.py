"""``worker.max_unit_params``: which modules become FSDP2 units when blocks are split below
(pure, on meta-device models), and that the plan's device figures follow the largest unit."""

from __future__ import annotations

import pytest
import torch
from reference import tiny_config

from cargohold.cluster.plan.run import plan_run
from cargohold.cluster.schema.model import GPTConfig
from cargohold.services.models.blocks import transformer_blocks
from cargohold.services.models.gpt import GPT
from cargohold.services.worker.sharding import ROOT, units_of

transformers = pytest.importorskip("transformers")


def _llama(*, tied: bool, layers: int = 2):
    from cargohold.services.models.hf import HFCausalLM

    config = transformers.LlamaConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    with torch.device("meta"):
        return HFCausalLM(transformers.AutoModelForCausalLM.from_config(config))


def _sizes(model, units) -> dict[str, int]:
    params = dict(model.named_parameters())
    return {unit.name: sum(params[n].numel() for n in unit.param_names) for unit in units}


def test_without_a_bound_each_block_is_a_unit_and_the_rest_is_the_root() -> None:
    model = _llama(tied=False)
    units = units_of(model, transformer_blocks(model))
    assert [u.name for u in units] == [ROOT, "hf.model.layers.0", "hf.model.layers.1"]
    assert set(units[0].param_names) == {"hf.model.embed_tokens.weight", "hf.model.norm.weight", "hf.lm_head.weight"}


def test_a_llama_block_splits_into_attention_and_the_mlp_projections_in_forward_order() -> None:
    model = _llama(tied=False)
    # A block: attention 4 x 64 x 64 = 16,384; MLP 3 x 64 x 256 = 49,152; two norms of 64.
    units = units_of(model, transformer_blocks(model), max_params=20_000)
    sizes = _sizes(model, units)
    per_block = ["self_attn", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    assert list(sizes) == [
        ROOT,
        "hf.model.embed_tokens",
        *(f"hf.model.layers.{i}.{part}" for i in range(2) for part in per_block),
        "hf.lm_head",
    ]
    # The embeddings and head (64,000 each) cannot be split: a leaf above the bound stays whole.
    assert sizes["hf.model.embed_tokens"] == sizes["hf.lm_head"] == 64_000
    assert sizes["hf.model.layers.0.self_attn"] == 16_384 and sizes["hf.model.layers.1.mlp.up_proj"] == 16_384
    # The norms (2 per block and the final one) are too small for units of their own.
    assert sizes[ROOT] == 5 * 64
    assert all(name.endswith("norm.weight") for name in units[0].param_names)
    # Every parameter in exactly one unit.
    names = [n for u in units for n in u.param_names]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())


def test_a_block_within_the_bound_stays_whole_and_the_embeddings_become_units() -> None:
    model = _llama(tied=False)
    units = units_of(model, transformer_blocks(model), max_params=100_000)
    assert [u.name for u in units] == [
        ROOT,
        "hf.model.embed_tokens",
        "hf.model.layers.0",
        "hf.model.layers.1",
        "hf.lm_head",
    ]


def test_tied_embeddings_stay_in_the_root_with_the_head() -> None:
    model = _llama(tied=True)
    units = units_of(model, transformer_blocks(model), max_params=20_000)
    names = [u.name for u in units]
    assert "hf.model.embed_tokens" not in names and "hf.lm_head" not in names
    assert "hf.model.embed_tokens.weight" in units[0].param_names
    assert names[1] == "hf.model.layers.0.self_attn"


def test_the_built_in_gpt_splits_the_same_way() -> None:
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=2, n_embd=64, n_head=2, block_size=512))
    units = units_of(model, transformer_blocks(model), max_params=20_000)
    names = [u.name for u in units]
    assert names == [
        ROOT,
        "wte",
        "wpe",
        *(f"blocks.{i}.{part}" for i in range(2) for part in ("attn", "mlp.c_fc", "mlp.c_proj")),
        "lm_head",
    ]


def test_the_plan_sizes_the_device_by_the_largest_unit_not_the_block() -> None:
    whole = tiny_config(model__n_layer=4, model__n_embd=128, data__block_size=32)
    split = tiny_config(model__n_layer=4, model__n_embd=128, data__block_size=32, worker__max_unit_params=40_000)
    plans = {name: plan_run(config) for name, config in (("whole", whole), ("split", split))}
    # wte, wpe, head, and per block: the attention's two projections and the MLP's two.
    assert plans["split"].worker.units == 3 + 4 * 4 and plans["whole"].worker.units == 4
    assert plans["split"].worker.largest_unit <= plans["whole"].worker.largest_unit / 2.9
    for figure in ("gathered_bytes", "gradient_bytes"):
        assert getattr(plans["split"].worker, figure) < getattr(plans["whole"].worker, figure) / 2, figure
    assert plans["split"].worker.buffers["exchange"] < plans["whole"].worker.buffers["exchange"] / 2
