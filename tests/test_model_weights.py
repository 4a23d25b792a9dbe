"""Reading transformers checkpoints one tensor (or a few rows) at a time
(services/models/weights.py), checked against ``from_pretrained`` in fp32: single-file,
sharded and bf16 checkpoints of a tiny tied GPT-2 written to tmp_path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from cargohold.services.core.errors import ConfigError, LayoutError
from cargohold.services.models.weights import INDEX_FILE, checkpoint_rows, checkpoint_tensors, tensor_files

transformers = pytest.importorskip("transformers")

GPT2 = dict(vocab_size=300, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)


def _save(path: Path, dtype: torch.dtype = torch.float32, **save_options) -> Path:
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(transformers.GPT2Config(**GPT2))
    model.to(dtype).save_pretrained(path, **save_options)
    return path


@pytest.fixture(scope="module", params=["single", "sharded", "bf16"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "sharded":
        _save(path, max_shard_size="20KB")
        assert len(set(json.loads((path / INDEX_FILE).read_text())["weight_map"].values())) > 3
    else:
        _save(path, torch.bfloat16 if request.param == "bf16" else torch.float32)
    return path


def _pretrained(path: Path) -> dict[str, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    assert model.lm_head.weight is model.transformer.wte.weight
    return {name: p.detach() for name, p in model.named_parameters()}


def test_tensors_equal_from_pretrained_in_fp32(checkpoint: Path) -> None:
    expected = _pretrained(checkpoint)
    names = list(reversed(expected))  # any order the caller asks for
    got = list(checkpoint_tensors(checkpoint, names))
    assert [name for name, _ in got] == names
    for name, value in got:
        assert value.dtype == torch.float32 and value.device.type == "cpu"
        assert torch.equal(value, expected[name]), name
    if checkpoint.name.startswith("bf16"):  # really bf16 on disk, cast exactly
        with safe_open(checkpoint / "model.safetensors", framework="pt") as f:
            assert {f.get_slice(name).get_dtype() for name in f.keys()} == {"BF16"}


def test_rows_are_the_rows_of_the_tensor(checkpoint: Path) -> None:
    expected = _pretrained(checkpoint)
    embedding = expected["transformer.wte.weight"]  # (300, 32)
    for rows in [(0, 150), (150, 300), (7, 8), (300, 300)]:
        assert torch.equal(checkpoint_rows(checkpoint, "transformer.wte.weight", rows), embedding[rows[0] : rows[1]])
    bias = expected["transformer.h.1.mlp.c_fc.bias"]
    assert torch.equal(checkpoint_rows(checkpoint, "transformer.h.1.mlp.c_fc.bias", (3, 40)), bias[3:40])
    with pytest.raises(LayoutError, match=r"rows \[290, 301\) are not rows of transformer.wte.weight"):
        checkpoint_rows(checkpoint, "transformer.wte.weight", (290, 301))


def test_a_missing_tensor_names_the_tensor_and_the_folder(checkpoint: Path) -> None:
    with pytest.raises(ConfigError, match=rf"lm_head.weight is not in the checkpoint at {checkpoint}"):
        list(checkpoint_tensors(checkpoint, ["transformer.wte.weight", "lm_head.weight"]))  # tied: saved once
    with pytest.raises(ConfigError, match=rf"nope is not in the checkpoint at {checkpoint}"):
        checkpoint_rows(checkpoint, "nope", (0, 1))


def test_a_folder_without_safetensors_is_refused(tmp_path: Path) -> None:
    transformers.GPT2Config(**GPT2).save_pretrained(tmp_path)  # config.json only
    with pytest.raises(ConfigError, match=rf"checkpoint folder {tmp_path} holds no model.safetensors"):
        list(checkpoint_tensors(tmp_path, ["transformer.wte.weight"]))
    assert "transformer.wte.weight" in tensor_files(_save(tmp_path / "saved"))
