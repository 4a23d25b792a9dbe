"""Hugging Face transformers causal LMs (the ``hf`` config section) and weight export.

Tiny Llama and GPT-2 configs are written to temporary folders (nothing is downloaded);
the integration tests train them through real Ray actors and compare with the
single-process torch.optim.AdamW reference bitwise, then export and load the result with
transformers.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from reference import reference_train, tiny_config  # noqa: E402

from cargohold.cluster.export import (  # noqa: E402
    GPT_CONFIG_FILE,
    WEIGHTS_FILE,
    export_weights,
    load_exported_gpt,
    master_weights,
)
from cargohold.cluster.launcher import TrainingSession  # noqa: E402
from cargohold.cluster.schema.io import load_config  # noqa: E402
from cargohold.cluster.sections import config_layout, config_task, model_spec  # noqa: E402
from cargohold.services.core.errors import ConfigError, ExportError  # noqa: E402
from cargohold.services.core.layout import gather_params, scatter_params  # noqa: E402
from cargohold.services.models.build import build_model  # noqa: E402
from cargohold.services.models.hf import HFCausalLM, hf_name  # noqa: E402

pytestmark = pytest.mark.timeout(120)

LLAMA = dict(
    vocab_size=320,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=64,
)
# GPT-2 ties lm_head to the token embedding and has dropout 0.1 by default.
GPT2 = dict(vocab_size=300, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    transformers.LlamaConfig(**LLAMA).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gpt2")
    transformers.GPT2Config(**GPT2).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def gpt2_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A save_pretrained folder of a random tied GPT-2, and its weights by HF name."""
    path = tmp_path_factory.mktemp("gpt2-checkpoint")
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(transformers.GPT2Config(**GPT2))
    model.save_pretrained(path)
    return path, {name: p.detach().clone() for name, p in model.named_parameters()}


def _load(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """``model`` with every parameter set from ``weights`` (by name; tied ones once)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(weights[name])
    return model


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 256, (2, 17), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


# --- the model wrapper ------------------------------------------------------------------


def test_forward_is_the_transformers_model_with_unshifted_mean_loss(llama_dir: Path) -> None:
    model = config_task(tiny_config(hf__config_path=str(llama_dir))).build()
    assert isinstance(model, HFCausalLM) and isinstance(model.hf, transformers.LlamaForCausalLM)
    x, y = _batch()
    logits, loss = model.train()(x, y)
    assert torch.equal(logits, model.hf(input_ids=x).logits)
    assert logits.shape == (2, 16, LLAMA["vocab_size"])
    # Our batches are already shifted: no second shift inside, unlike transformers' loss.
    assert torch.equal(loss, F.cross_entropy(logits.float().flatten(0, 1), y.flatten()))
    assert model(x)[1] is None
    assert next(model.parameters()).dtype == torch.float32


def test_build_is_seeded_and_meta_gives_the_same_shapes(llama_dir: Path) -> None:
    config = tiny_config(hf__config_path=str(llama_dir))
    first, second = build_model(model_spec(config), config.data), build_model(model_spec(config), config.data)
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), second.parameters()))
    other = config_task(tiny_config(hf__config_path=str(llama_dir), seed=8)).build()
    assert not torch.equal(next(first.parameters()), next(other.parameters()))
    with torch.device("meta"):
        meta = build_model(model_spec(config), config.data)
    assert [(n, p.shape) for n, p in meta.named_parameters()] == [(n, p.shape) for n, p in first.named_parameters()]
    assert all(name.startswith("hf.") for name, _ in first.named_parameters())


def test_dropout_stays_off_in_train_mode(gpt2_dir: Path) -> None:
    model = config_task(tiny_config(hf__config_path=str(gpt2_dir))).build()
    assert model.hf.config.resid_pdrop > 0  # the config asks for dropout ...
    x, y = _batch()
    model.train()
    assert model.training and not model.hf.training  # ... the wrapper keeps it off
    assert torch.equal(model(x, y)[1], model(x, y)[1])
    assert torch.equal(model(x, y)[1], model.eval()(x, y)[1])


def test_tied_embedding_has_one_chunk_place_in_the_root_unit(gpt2_dir: Path) -> None:
    """A tied parameter is placed once, in the root unit, and survives the flat space."""
    config = tiny_config(hf__config_path=str(gpt2_dir))
    model = build_model(model_spec(config), config.data)
    assert model.hf.lm_head.weight is model.hf.transformer.wte.weight
    _, _, layout = config_layout(config)
    names = [place.name for place in layout.params]
    assert names.count("hf.transformer.wte.weight") == 1 and "hf.lm_head.weight" not in names
    assert "hf.transformer.wte.weight" in [place.name for place in layout.unit_params(0)]

    weights = gather_params(layout, scatter_params(layout, dict(model.named_parameters())))
    tied = _load(config_task(tiny_config(hf__config_path=str(gpt2_dir), seed=8)).build(), weights)
    assert tied.hf.lm_head.weight is tied.hf.transformer.wte.weight
    assert all(torch.equal(a, b) for a, b in zip(tied.parameters(), model.parameters()))


def test_buffers_stay_fp32_and_follow_the_input(llama_dir: Path) -> None:
    model = config_task(tiny_config(hf__config_path=str(llama_dir))).build()
    low = copy.deepcopy(model).to(torch.bfloat16)  # what the reference does for bf16 workers
    assert low.hf.model.rotary_emb.inv_freq.dtype == torch.bfloat16
    x, y = _batch()
    low(x, y)
    assert low.hf.model.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(low.hf.model.rotary_emb.inv_freq, model.hf.model.rotary_emb.inv_freq)


def test_checkpoint_dir_starts_from_its_weights(gpt2_checkpoint) -> None:
    path, saved = gpt2_checkpoint
    model = config_task(tiny_config(hf__checkpoint_dir=str(path), seed=99)).build()
    loaded = {hf_name(name): p for name, p in model.named_parameters()}
    assert loaded.keys() == saved.keys()  # named_parameters() lists the tied weight once
    for name, param in loaded.items():
        assert torch.equal(param, saved[name]), name
    assert model.hf.lm_head.weight is model.hf.transformer.wte.weight


# --- configuration ----------------------------------------------------------------------


def _write_config(path: Path, **overrides) -> str:
    transformers.LlamaConfig(**{**LLAMA, **overrides}).save_pretrained(path)
    return str(path)


def test_config_keys_load_from_yaml_and_overrides(tmp_path: Path, llama_dir: Path) -> None:
    config = load_config(None, [f"hf.config_path={llama_dir}", "data.block_size=64", f"export_dir={tmp_path}"])
    assert config.hf.config_path == str(llama_dir) and config.hf.enabled and config.export_dir == str(tmp_path)
    file_itself = load_config(None, [f"hf.config_path={llama_dir / 'config.json'}"])
    assert (
        file_itself.hf.enabled
        and build_model(model_spec(file_itself), file_itself.data).hf.config.vocab_size == LLAMA["vocab_size"]
    )
    assert not load_config().hf.enabled


@pytest.mark.parametrize(
    ("case", "keys"),
    [
        ("missing-config", ["hf.config_path"]),
        ("missing-checkpoint", ["hf.checkpoint_dir"]),
        ("checkpoint-is-a-file", ["hf.checkpoint_dir"]),
        ("both", ["hf.config_path", "hf.checkpoint_dir"]),
        ("small-vocab", ["hf.config_path", "vocab_size"]),
        ("block-too-long", ["data.block_size", "max_position_embeddings"]),
        ("gpt-block-size", ["model.block_size", "data.block_size"]),
        ("not-a-causal-lm", ["hf.config_path"]),
        ("not-json", ["hf.config_path"]),
        ("empty-export-dir", ["export_dir"]),
    ],
)
def test_bad_inputs_are_refused_naming_the_key(tmp_path: Path, llama_dir: Path, case: str, keys: list[str]) -> None:
    overrides = {  # built lazily: each case writes its own files into tmp_path
        "missing-config": lambda: [f"hf.config_path={tmp_path / 'absent'}"],
        "missing-checkpoint": lambda: [f"hf.checkpoint_dir={tmp_path / 'absent'}"],
        "checkpoint-is-a-file": lambda: [f"hf.checkpoint_dir={llama_dir / 'config.json'}"],
        "both": lambda: [f"hf.config_path={llama_dir}", f"hf.checkpoint_dir={llama_dir}"],
        "small-vocab": lambda: [f"hf.config_path={_write_config(tmp_path, vocab_size=200)}"],
        "block-too-long": lambda: [f"hf.config_path={llama_dir}", "data.block_size=65"],
        # the context comes from the model's config; the GPT's key is refused, not ignored
        "gpt-block-size": lambda: [f"hf.config_path={llama_dir}", "model.block_size=64"],
        "not-a-causal-lm": lambda: [f"hf.config_path={_vit(tmp_path)}"],
        "not-json": lambda: [f"hf.config_path={_garbage(tmp_path)}"],
        "empty-export-dir": lambda: ["export_dir=''"],
    }[case]()
    with pytest.raises(ConfigError) as error, torch.device("meta"):  # what every process does first
        config_task(load_config(None, overrides)).build()
    for key in keys:
        assert re.search(rf"(?<![\w.]){re.escape(key)}(?![\w])", str(error.value)), f"{key} not in {error.value}"


def _vit(path: Path) -> str:
    transformers.ViTConfig().save_pretrained(path)
    return str(path)


def _garbage(path: Path) -> str:
    (path / "config.json").write_text("{not json")
    return str(path / "config.json")


# --- export -----------------------------------------------------------------------------


def test_builtin_gpt_export_round_trips(tmp_path: Path) -> None:
    config = tiny_config(steps=3)
    _, _, layout = config_layout(config)
    assert [p.name for p in layout.params] != [
        n for n, _ in build_model(model_spec(config), config.data).named_parameters()
    ], "the layout orders parameters by unit, not as the model lists them"
    flat = reference_train(config, 3).flat(layout)
    assert export_weights(model_spec(config), config.data, layout, flat, tmp_path / "out") == tmp_path / "out"
    assert {p.name for p in (tmp_path / "out").iterdir()} == {WEIGHTS_FILE, GPT_CONFIG_FILE}

    loaded = load_exported_gpt(tmp_path / "out")
    assert loaded.config == config.model and not loaded.training
    weights = gather_params(layout, flat)
    assert [n for n, _ in loaded.named_parameters()] == [
        n for n, _ in build_model(model_spec(config), config.data).named_parameters()
    ]
    for name, param in loaded.named_parameters():
        assert torch.equal(weights[name], param), name
    fresh = _load(build_model(model_spec(config), config.data).eval(), weights)
    x, _ = _batch()
    assert torch.equal(loaded(x)[0], fresh(x)[0])


def test_export_refuses_other_weights_and_unreadable_exports(tmp_path: Path) -> None:
    config = tiny_config()
    _, _, layout = config_layout(config)
    with pytest.raises(ExportError, match="fp32"):
        export_weights(
            model_spec(config), config.data, layout, torch.zeros(layout.total, dtype=torch.bfloat16), tmp_path
        )
    with pytest.raises(ExportError, match="layout"):
        export_weights(
            model_spec(tiny_config(model__n_embd=32)), config.data, layout, torch.zeros(layout.total), tmp_path
        )
    with pytest.raises(ExportError, match=re.escape(str(tmp_path))):
        load_exported_gpt(tmp_path)


# --- training through Ray ---------------------------------------------------------------


def _train(config, export_dir: Path | None = None):
    _, _, layout = config_layout(config)
    with TrainingSession(config) as session:
        initial = session.all_worker_weights()
        losses = [session.step().loss for _ in range(config.steps)]
        weights = session.all_worker_weights()
        masters = master_weights(layout, session.server_masters())
    if export_dir is not None:
        export_weights(model_spec(config), config.data, layout, masters, export_dir)
    return layout, initial, losses, weights, masters


def _assert_matches_reference(config, layout, losses, weights, masters) -> None:
    reference = reference_train(config, config.steps)
    assert losses == reference.losses
    expected = reference.flat(layout)
    assert torch.equal(masters, expected), f"masters differ by {(masters - expected).abs().max():.3e}"
    assert torch.equal(weights, expected.to(weights.dtype))


def _assert_export_loads(export_dir: Path, config, layout, masters: torch.Tensor) -> torch.nn.Module:
    loaded = transformers.AutoModelForCausalLM.from_pretrained(export_dir, local_files_only=True)
    weights = gather_params(layout, masters)
    ours = {hf_name(name): tensor for name, tensor in weights.items()}
    named = dict(loaded.named_parameters())
    assert named.keys() == ours.keys()
    for name, tensor in ours.items():
        assert torch.equal(named[name], tensor), name
    fresh = _load(build_model(model_spec(config), config.data).eval(), weights)
    x, _ = _batch()
    assert torch.equal(loaded(input_ids=x).logits, fresh(x)[0])
    return loaded


@pytest.mark.integration
def test_llama_trains_bitwise_and_exports_for_transformers(ray_local, llama_dir: Path, tmp_path: Path) -> None:
    config = tiny_config(hf__config_path=str(llama_dir), export_dir=str(tmp_path / "export"))
    layout, _, losses, weights, masters = _train(config, tmp_path / "export")
    _assert_matches_reference(config, layout, losses, weights, masters)
    assert losses[-1] < losses[0] - 0.5, f"the loss should fall visibly: {losses[0]:.3f} -> {losses[-1]:.3f}"
    assert type(_assert_export_loads(tmp_path / "export", config, layout, masters)).__name__ == "LlamaForCausalLM"


@pytest.mark.integration
def test_tied_checkpoint_trains_bitwise_in_bf16_and_exports_tied(ray_local, gpt2_checkpoint, tmp_path: Path) -> None:
    path, saved = gpt2_checkpoint
    config = tiny_config(hf__checkpoint_dir=str(path), steps=8, worker__compute_dtype="bfloat16")
    layout, initial, losses, weights, masters = _train(config, tmp_path / "export")
    for name, value in gather_params(layout, initial).items():
        assert torch.equal(value, saved[hf_name(name)].to(value.dtype)), name
    _assert_matches_reference(config, layout, losses, weights, masters)
    assert losses[-1] < losses[0]
    loaded = _assert_export_loads(tmp_path / "export", config, layout, masters)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight


@pytest.mark.integration
def test_train_writes_export_dir_from_the_masters(ray_local, tmp_path: Path) -> None:
    """The launcher's end of run: ``export_dir`` set, the built-in GPT exported."""
    from cargohold.cluster.supervise import train

    config = tiny_config(steps=3, export_dir=str(tmp_path / "export"))
    train(config)
    expected = reference_train(config, config.steps).state["masters"]
    loaded = load_exported_gpt(tmp_path / "export")
    for name, param in loaded.named_parameters():
        assert torch.equal(expected[name], param), name
