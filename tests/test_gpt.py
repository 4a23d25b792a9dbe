import dataclasses
import math

import pytest
import torch

from cargohold.cluster.schema.model import GPTConfig
from cargohold.services.core.errors import ConfigError
from cargohold.services.data import batch_for_step, load_tokens
from cargohold.services.models.gpt import GPT, num_parameters
from cargohold.services.models.init import initialize

TINY = GPTConfig(block_size=32, n_layer=2, n_head=4, n_embd=64)


def _tiny_model(seed: int = 0, config: GPTConfig = TINY) -> GPT:
    model = GPT(config)
    initialize(model, seed)  # GPT-2's rule; test_model_init.py tests it
    return model


def test_default_config_has_about_ten_million_parameters() -> None:
    with torch.device("meta"):
        model = GPT(GPTConfig())
    count = num_parameters(model)
    print(f"default GPTConfig: {count:,} parameters")
    assert 9_000_000 <= count <= 12_000_000


def test_forward_shapes_and_loss_is_log_vocab_at_init() -> None:
    model = _tiny_model(config=GPTConfig())
    idx = torch.randint(0, 256, (2, 128))
    logits, loss = model(idx, idx)
    assert logits.shape == (2, 128, 256)
    assert loss is not None and loss.shape == ()
    # std-0.02 weights give near-uniform predictions over the 256 bytes.
    assert loss.item() == pytest.approx(math.log(256), abs=0.15)
    assert model(idx)[1] is None


def test_attention_is_causal() -> None:
    model = _tiny_model().eval()
    idx = torch.randint(0, 256, (1, 16))
    changed = idx.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 256
    before, _ = model(idx)
    after, _ = model(changed)
    torch.testing.assert_close(before[0, :10], after[0, :10])
    assert not torch.allclose(before[0, 10:], after[0, 10:])


def test_every_parameter_is_a_distinct_tensor() -> None:
    model = _tiny_model()
    named = list(model.named_parameters(remove_duplicate=False))
    storages = {p.untyped_storage().data_ptr() for _, p in named}
    assert len(storages) == len(named)
    assert model.lm_head.weight.shape == model.wte.weight.shape  # same shape, still untied


def test_meta_device_construction_matches_real_shapes() -> None:
    with torch.device("meta"):
        meta = GPT(TINY)
    real = _tiny_model()
    assert all(p.is_meta for p in meta.parameters())
    assert [(n, p.shape) for n, p in meta.named_parameters()] == [(n, p.shape) for n, p in real.named_parameters()]
    assert num_parameters(meta) == num_parameters(real)
    assert list(meta.buffers()) == []


def test_bfloat16_forward_and_backward() -> None:
    model = _tiny_model().to(torch.bfloat16)
    idx = torch.randint(0, 256, (2, 32))
    logits, loss = model(idx, idx)
    assert logits.dtype == torch.bfloat16
    assert loss is not None and torch.isfinite(loss)
    assert loss.item() == pytest.approx(math.log(256), abs=0.15)
    loss.backward()
    assert model.wte.weight.grad is not None
    assert model.wte.weight.grad.dtype == torch.bfloat16


def test_adamw_on_generated_corpus_reduces_loss() -> None:
    model = _tiny_model()
    tokens = load_tokens(None, 20_000, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(40):
        x, y = batch_for_step(tokens, step=step, rank=0, world_size=1, batch_size=16, seq_len=32, seed=0)
        _, loss = model(x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(256), abs=0.15)
    assert sum(losses[-5:]) / 5 < losses[0] - 2.0, losses


def test_sequence_longer_than_block_size_is_rejected() -> None:
    with pytest.raises(ConfigError, match="block_size"):
        _tiny_model()(torch.zeros(1, TINY.block_size + 1, dtype=torch.long))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("vocab_size", 0),
        ("block_size", -1),
        ("n_layer", 0),
        ("n_head", 0),
        ("n_embd", 0),
        ("n_embd", 100),  # not divisible by the default 6 heads
        ("n_layer", 2.5),
        ("dropout", 1.0),
        ("dropout", -0.1),
        ("bias", 1),
    ],
)
def test_invalid_config_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"model.{field}"):
        GPTConfig(**{field: value})


def test_config_is_frozen_and_keyword_only() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        TINY.n_layer = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        GPTConfig(256)  # type: ignore[misc]
