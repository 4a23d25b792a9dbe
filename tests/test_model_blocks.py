"""Transformer blocks and activation checkpointing (services/models/blocks.py): block
discovery on GPT and transformers models, bitwise-equal gradients with and without
checkpointing (alone and under a real 2-process FSDP2 group), and the memory it saves."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ports import free_port
from torch import nn

from cargohold.cluster.schema.model import GPTConfig
from cargohold.services.core.errors import ConfigError
from cargohold.services.models.blocks import apply_activation_checkpointing, transformer_blocks
from cargohold.services.models.gpt import GPT
from cargohold.services.models.init import initialize

pytestmark = pytest.mark.timeout(120)


def _gpt(dropout: float = 0.0, n_layer: int = 2) -> GPT:
    model = GPT(GPTConfig(n_layer=n_layer, n_embd=64, n_head=2, block_size=32, dropout=dropout))
    initialize(model, 7)
    return model


def _batch(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(seed))


def _loss_and_grads(model: nn.Module, x: torch.Tensor, seed: int = 5) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)  # dropout masks
    _, loss = model.train()(x, x)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def test_gpt_blocks_in_forward_order_and_on_meta() -> None:
    model = _gpt(n_layer=3)
    blocks = transformer_blocks(model)
    assert [name for name, _ in blocks] == ["blocks.0", "blocks.1", "blocks.2"]
    assert all(block is model.blocks[i] for i, (_, block) in enumerate(blocks))
    with torch.device("meta"):
        meta = GPT(GPTConfig(n_layer=3))
    assert [name for name, _ in transformer_blocks(meta)] == ["blocks.0", "blocks.1", "blocks.2"]


def test_transformers_decoder_layers_are_found_on_meta() -> None:
    transformers = pytest.importorskip("transformers")
    from cargohold.services.models.hf import HFCausalLM

    llama = transformers.LlamaConfig(
        vocab_size=320,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    gpt2 = transformers.GPT2Config(vocab_size=300, n_positions=64, n_embd=32, n_layer=2, n_head=2)
    with torch.device("meta"):
        models = [HFCausalLM(transformers.AutoModelForCausalLM.from_config(c)) for c in (llama, gpt2)]
    assert [n for n, _ in transformer_blocks(models[0])] == [f"hf.model.layers.{i}" for i in range(3)]
    assert [n for n, _ in transformer_blocks(models[1])] == ["hf.transformer.h.0", "hf.transformer.h.1"]


def test_a_model_without_repeated_blocks_is_refused() -> None:
    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(2, 2), nn.LayerNorm(2)])  # two classes
            self.acts = nn.ModuleList([nn.ReLU(), nn.ReLU()])  # no parameters

    for model in (nn.Sequential(nn.Linear(2, 2)), Mixed()):
        with pytest.raises(ConfigError, match=rf"{type(model).__name__} has no repeated block list .* FSDP2"):
            transformer_blocks(model)


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_checkpointing_changes_no_loss_gradient_or_name(dropout: float) -> None:
    plain = _gpt(dropout)
    checkpointed = copy.deepcopy(plain)
    apply_activation_checkpointing([block for _, block in transformer_blocks(checkpointed)])
    assert [n for n, _ in checkpointed.named_parameters()] == [n for n, _ in plain.named_parameters()]
    x = _batch()
    loss, grads = _loss_and_grads(plain, x)
    loss_ac, grads_ac = _loss_and_grads(checkpointed, x)
    assert torch.equal(loss, loss_ac)
    for name, grad in grads.items():
        assert torch.equal(grad, grads_ac[name]), name
    if dropout:  # the masks really are random: another seed gives another loss
        assert not torch.equal(_loss_and_grads(copy.deepcopy(plain), x, seed=6)[0], loss)


def test_checkpointing_a_transformers_model_changes_no_gradient() -> None:
    transformers = pytest.importorskip("transformers")
    from cargohold.services.models.hf import HFCausalLM

    config = transformers.LlamaConfig(
        vocab_size=320,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    plain = HFCausalLM(transformers.AutoModelForCausalLM.from_config(config))
    checkpointed = copy.deepcopy(plain)
    apply_activation_checkpointing([block for _, block in transformer_blocks(checkpointed)])
    x = _batch()
    loss, grads = _loss_and_grads(plain, x)
    loss_ac, grads_ac = _loss_and_grads(checkpointed, x)
    assert torch.equal(loss, loss_ac)
    assert all(torch.equal(grad, grads_ac[name]) for name, grad in grads.items())


def _saved_activation_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct non-parameter storages kept for backward: what autograd
    saves, plus each block's input, which checkpointing keeps (by reference) to recompute."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    hooks = [block.register_forward_pre_hook(lambda _, args: pack(args[0])) for _, block in transformer_blocks(model)]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        _, loss = model(x, x)
    loss.backward()
    for hook in hooks:
        hook.remove()
    return sum(saved.values())


def test_checkpointing_keeps_far_fewer_activations() -> None:
    plain = _gpt(n_layer=6)
    checkpointed = copy.deepcopy(plain)
    apply_activation_checkpointing([block for _, block in transformer_blocks(checkpointed)])
    x = _batch()
    without, with_ac = _saved_activation_bytes(plain, x), _saved_activation_bytes(checkpointed, x)
    print(f"saved activations: {without:,} bytes without checkpointing, {with_ac:,} with")
    # What remains is outside the blocks: embeddings, final norm, head and loss.
    assert with_ac < without / 4


def _sharded_run(rank: int, port: int, out: Path) -> None:
    """On each rank: the same model with and without checkpointing, both ``fully_shard``ed
    after (per block, then the root), one step on the rank's batch."""
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        results = {}
        for dropout in (0.0, 0.2):
            for ac in (False, True):
                model = _gpt(dropout)
                blocks = [block for _, block in transformer_blocks(model)]
                if ac:
                    apply_activation_checkpointing(blocks)
                for block in blocks:
                    fully_shard(block)
                fully_shard(model)
                loss, grads = _loss_and_grads(model, _batch(seed=rank), seed=10 + rank)
                results[dropout, ac] = loss, {name: grad.to_local().clone() for name, grad in grads.items()}
        torch.save(results, out / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_checkpointing_composes_with_fully_shard_applied_after(tmp_path: Path) -> None:
    mp.spawn(_sharded_run, args=(free_port(), tmp_path), nprocs=2)
    losses = set()
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        for dropout in (0.0, 0.2):
            (loss, grads), (loss_ac, grads_ac) = results[dropout, False], results[dropout, True]
            assert torch.equal(loss, loss_ac), (rank, dropout)
            assert grads.keys() == grads_ac.keys() and len(grads) == 29
            for name, grad in grads.items():
                assert torch.equal(grad, grads_ac[name]), (rank, dropout, name)
            losses.add(loss.item())
        # Each rank holds its half of the rows: the shards differ, their shapes add up.
        assert results[0.0, True][1]["wte.weight"].shape == (128, 64)
    assert len(losses) == 4  # two ranks' batches, two dropout settings: really different runs
