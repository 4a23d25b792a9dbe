"""The export of an ``hf`` model round-trips through transformers: the folder holds the
weights, the tokenizer the data was tokenized with and the generation config, in the
``save_pretrained`` layout, and ``AutoModelForCausalLM`` plus ``AutoTokenizer`` read
from it alone give the logits of the trained masters, bitwise.

The masters come from the single-process reference, which equals what cargohold's state
servers hold bitwise (tests/test_training_contract.py); tests/test_finetune_example.py
takes them from a real run's checkpoint instead.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from data_fixtures import conversation, make_tokenizer, tiny_llama, write_chat  # noqa: E402
from reference import reference_train, tiny_config  # noqa: E402

from cargohold.cluster.export import export_weights  # noqa: E402
from cargohold.cluster.sections import config_layout, model_spec  # noqa: E402
from cargohold.services.core.layout import gather_params  # noqa: E402
from cargohold.services.models.build import build_model  # noqa: E402

pytestmark = pytest.mark.timeout(120)

VOCAB = 384


def _chat_config(tmp_path: Path, **overrides):
    data = {
        "format": "chat",
        "path": str(write_chat(tmp_path / "chat.jsonl", 100)),
        "cache_dir": str(tmp_path / "cache"),
    }
    return tiny_config(**{f"data__{k}": v for k, v in data.items()}, **overrides)


def _trained_logits(config, masters: torch.Tensor, layout, ids: torch.Tensor) -> torch.Tensor:
    model = build_model(model_spec(config), config.data).eval()
    weights = gather_params(layout, masters)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(weights[name])
        return model(ids)[0]


def test_export_loads_with_transformers_alone_and_gives_the_masters_logits(tmp_path: Path) -> None:
    # No bos/eos in the model's config: the generation config takes the tokenizer's.
    model_dir = tiny_llama(make_tokenizer(tmp_path / "model"), VOCAB, bos_token_id=None, eos_token_id=None)
    config = _chat_config(tmp_path, hf__config_path=str(model_dir), steps=3)
    _, _, layout = config_layout(config)
    masters = reference_train(config, config.steps).flat(layout)
    out = export_weights(model_spec(config), config.data, layout, masters, tmp_path / "export")

    files = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= files, files
    assert "tokenizer_config.json" in files, files

    original = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    messages = conversation(random.Random(5))
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert ids == original.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert tokenizer.eos_token_id == original.eos_token_id
    assert tokenizer.decode(ids) == original.decode(ids)

    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    batch = torch.tensor([ids])
    with torch.no_grad():
        logits = loaded(input_ids=batch).logits
    expected = _trained_logits(config, masters, layout, batch)
    assert torch.equal(logits, expected), f"logits differ by {(logits - expected).abs().max():.3e}"
    untrained = _trained_logits(config, reference_train(config, 1).flat(layout), layout, batch)
    assert not torch.equal(logits, untrained), "the logits tell trained weights apart"

    assert loaded.generation_config.eos_token_id == original.eos_token_id
    assert loaded.generation_config.bos_token_id is None  # the tokenizer has none either
    prompt = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, return_tensors="pt")
    more = loaded.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert more.shape[1] > prompt["input_ids"].shape[1], "the export generates"


def test_a_checkpoints_generation_config_is_kept(tmp_path: Path) -> None:
    source = tmp_path / "checkpoint"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(tiny_llama(tmp_path / "shape", VOCAB))
    )
    model.generation_config = transformers.GenerationConfig(
        eos_token_id=[1, 4], max_new_tokens=7, do_sample=True, temperature=0.5
    )
    model.save_pretrained(source)
    make_tokenizer(source)
    config = _chat_config(tmp_path, hf__checkpoint_dir=str(source))
    _, _, layout = config_layout(config)
    out = export_weights(model_spec(config), config.data, layout, torch.zeros(layout.total), tmp_path / "export")
    saved = json.loads((out / "generation_config.json").read_text())
    assert saved["eos_token_id"] == [1, 4] and saved["max_new_tokens"] == 7 and saved["temperature"] == 0.5
    assert (out / "tokenizer.json").is_file()


def test_byte_level_data_exports_no_tokenizer(tmp_path: Path) -> None:
    """Byte ids are not the tokenizer's: the model folder's tokenizer stays behind."""
    model_dir = tiny_llama(make_tokenizer(tmp_path / "model"), VOCAB)
    config = tiny_config(hf__config_path=str(model_dir))
    _, _, layout = config_layout(config)
    out = export_weights(model_spec(config), config.data, layout, torch.zeros(layout.total), tmp_path / "export")
    assert (out / "model.safetensors").is_file()
    assert not [p.name for p in out.iterdir() if p.name.startswith("tokenizer")]
