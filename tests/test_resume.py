"""Resuming compares the configuration a checkpoint was saved with (its manifest holds it
whole) with the run's own, before any actor starts: a key that would give the saved state
another meaning is refused naming it and both values (exit status 2), any other changed
key is warned about in one line. Real checkpoints on disk; no Ray starts."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import ray
import yaml
from checkpoints import random_data, save_layout
from reference import tiny_config

from cargohold.cluster import cli
from cargohold.cluster.resume import BEFORE_STATE_DTYPE, REFUSED, Change, check_resume, config_changes
from cargohold.cluster.schema.io import to_dict, to_user_dict
from cargohold.cluster.sections import config_layout
from cargohold.services.checkpoint import CheckpointDir
from cargohold.services.core.errors import ConfigError, ResumeRefusedError
from cargohold.services.data import generate_corpus

pytestmark = pytest.mark.timeout(120)
BASE = {"steps": 8, "metrics__port": None}


def _saved(root: Path, *, without: tuple[str, str] | None = None, **overrides) -> Path:
    """A checkpoint of step 2 of the tiny model, its manifest holding the config (less the
    key ``without``, (section, key), as in a checkpoint saved before that key existed)."""
    config = tiny_config(**{**BASE, **overrides})
    _, _, layout = config_layout(config)
    saved = to_dict(config)
    if without is not None:
        del saved[without[0]][without[1]]
    return save_layout(CheckpointDir(root), 2, layout, random_data(layout.total, 2), saved)


def _check(path: Path, **overrides):
    config = tiny_config(**{**BASE, "checkpoint__resume": str(path), **overrides})
    return check_resume(path, config, config_layout(config)[2])


REFUSALS = {
    "model.n_head": ({"model__n_head": 4}, "2", "4"),  # the same shapes: only the config tells
    "model.n_embd": ({"model__n_embd": 32}, "64", "32"),
    "optim.betas": ({"optim__betas": [0.9, 0.99]}, "[0.9, 0.999]", "[0.9, 0.99]"),
    "data.seed": ({"data__seed": 5}, "1234", "5"),
    "seed": ({"seed": 8}, "7", "8"),
}


@pytest.mark.parametrize("key", REFUSALS)
def test_a_key_that_changes_what_the_state_means_is_refused(tmp_path: Path, key: str) -> None:
    path = _saved(tmp_path)
    overrides, saved, now = REFUSALS[key]
    with pytest.raises(ResumeRefusedError) as refused:
        _check(path, **overrides)
    assert isinstance(refused.value, ConfigError)
    message = str(refused.value)
    assert message.startswith(f"checkpoint.resume: {path} was saved with a configuration this run cannot resume")
    assert f"{key} is {saved} there and {now} here ({REFUSED[key]})" in message


def test_the_command_exits_2_naming_the_key_before_anything_starts(tmp_path: Path, capsys) -> None:
    path = _saved(tmp_path / "ckpt")
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(to_user_dict(tiny_config(**BASE))))
    status = cli.main(["train", "--config", str(config_file), "--resume", str(path), "--set", "model.n_head=4"])
    assert status == 2
    err = capsys.readouterr().err
    assert "bad configuration: checkpoint.resume:" in err and "model.n_head is 2 there and 4 here" in err
    assert not ray.is_initialized()


def test_other_changed_keys_are_warned_about_in_one_line(tmp_path: Path, caplog) -> None:
    path = _saved(tmp_path)
    with caplog.at_level(logging.WARNING, logger="cargohold.cluster.resume"):
        assert _check(path).step == 2
    assert not caplog.records, "an unchanged config (but checkpoint.resume) resumes silently"
    changed = {
        "steps": 16,
        "optim__lr": 0.02,
        "optim__schedule": "constant",
        "worker__num_workers": 1,
        "state_server__num_servers": 3,
        "worker__compute_dtype": "bfloat16",
        "model__dropout": 0.1,
        "optim__no_decay": "biases_and_norms",
        "optim__param_groups": [{"name": "emb", "params": ["wte.*"], "lr_mult": 0.5}],
    }
    with caplog.at_level(logging.WARNING, logger="cargohold.cluster.resume"):
        assert _check(path, **changed).step == 2
    (record,) = caplog.records
    assert record.levelname == "WARNING"
    assert record.getMessage().count(" -> ") == len(changed)
    for shown in (
        "steps: 8 -> 16",
        "optim.lr: 0.01 -> 0.02",
        'optim.schedule: "cosine" -> "constant"',
        "worker.num_workers: 2 -> 1",
        "state_server.num_servers: 1 -> 3",
        'worker.compute_dtype: "float32" -> "bfloat16"',
        "model.dropout: 0.0 -> 0.1",
        'optim.no_decay: "none" -> "biases_and_norms"',
        'optim.param_groups: [] -> [{"lr_mult": 0.5, "name": "emb", "params": ["wte.*"], "weight_decay": null}]',
    ):
        assert shown in record.getMessage()
    assert "checkpoint.resume" not in record.getMessage()


def test_keys_compare_as_json_values_and_sections_only_are_descended() -> None:
    """1, 1.0, true and "1" differ; a mapping-valued key (worker.resources) is one value; a
    key only one side knows (removed or added since) is listed as absent there."""
    config = tiny_config(**BASE)
    saved = to_dict(config)
    saved["model"]["bias"] = 1
    saved["worker"]["resources"] = {"cargohold_gpu": 1}
    saved["optim"]["retired_key"] = 0.5
    del saved["metrics"]["file_sd_path"]
    assert config_changes(saved, config) == [
        Change("metrics.file_sd_path", "absent", "null"),
        Change("model.bias", "1", "true"),
        Change("optim.retired_key", "0.5", "absent"),
        Change("worker.resources", '{"cargohold_gpu": 1}', "{}"),
    ]


@pytest.mark.parametrize("kind", ["float32", "blockwise8"])
def test_a_checkpoint_from_before_state_dtype_is_said_to_hold_fp32_moments(tmp_path: Path, caplog, kind) -> None:
    """Its config lacks optim.state_dtype: the warning says its moments are fp32, and only
    a run of another kind is told they are converted."""
    path = _saved(tmp_path, without=("optim", "state_dtype"))
    with caplog.at_level(logging.WARNING, logger="cargohold.cluster.resume"):
        assert _check(path, optim__state_dtype=kind).step == 2
    messages = [record.getMessage() for record in caplog.records]
    assert f'optim.state_dtype: {BEFORE_STATE_DTYPE} -> "{kind}"' in messages[-1]
    assert "fp32 moments" in BEFORE_STATE_DTYPE
    converted = [m for m in messages if "converted" in m]
    if kind == "float32":
        assert not converted, "fp32 moments resumed as fp32 are not converted"
    else:
        (line,) = converted
        assert f'optim.state_dtype is {BEFORE_STATE_DTYPE} there and "blockwise8" here' in line


def test_a_checkpoint_from_before_optim_betas_compares_its_two_rates_as_betas(tmp_path: Path) -> None:
    """Its config holds optim.beta1 and optim.beta2: they are this run's optim.betas, so
    equal rates resume silently and another beta2 is refused naming optim.betas."""
    config = tiny_config(**BASE)
    saved = to_dict(config)
    beta1, beta2 = saved["optim"].pop("betas")
    saved["optim"].update(beta1=beta1, beta2=beta2)
    assert config_changes(saved, config) == []
    saved["optim"]["beta2"] = 0.95
    assert config_changes(saved, config) == [Change("optim.betas", "[0.9, 0.95]", "[0.9, 0.999]")]


def test_a_checkpoint_from_before_data_path_read_bytes_compares_its_corpus_path_as_data_path(tmp_path: Path) -> None:
    """Its config holds the bytes format's text file as data.corpus_path (data.path null):
    the same file resumes silently, another is refused naming data.path."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(generate_corpus(1000, seed=0))
    config = tiny_config(**BASE, data__path=str(corpus))
    saved = to_dict(config)
    saved["data"].update(path=None, corpus_path=str(corpus))
    assert config_changes(saved, config) == []
    saved["data"]["corpus_path"] = "/elsewhere.txt"
    assert config_changes(saved, config) == [Change("data.path", '"/elsewhere.txt"', json.dumps(str(corpus)))]
    del saved["data"]["corpus_path"]  # the generated corpus: data.path null on both sides
    assert config_changes(saved, tiny_config(**BASE)) == []


def test_a_checkpoints_progress_key_is_not_compared() -> None:
    """A checkpoint saved while a key chose the progress bar holds it; nothing sets it now."""
    config = tiny_config(**BASE)
    assert config_changes({**to_dict(config), "progress": False}, config) == []


def test_a_checkpoint_from_before_tls_dir_without_tls_compares_as_a_null_tls_dir() -> None:
    """Its config holds three null security.tls_*_file keys: no TLS, as tls_dir null."""
    config = tiny_config(**BASE)
    saved = to_dict(config)
    del saved["security"]["tls_dir"]
    saved["security"].update(dict.fromkeys(("tls_cert_file", "tls_key_file", "tls_ca_file")))
    assert config_changes(saved, config) == []


@pytest.mark.parametrize(
    ("vocab", "saved_dtype", "derived"),
    [(256, "uint16", "uint16"), (256, "uint32", "uint16"), (65_537, "uint32", "uint32"), (65_537, "uint16", "uint32")],
)
def test_a_checkpoint_from_before_the_derived_token_dtype_compares_it_with_the_derived_one(
    tmp_path: Path, vocab: int, saved_dtype: str, derived: str
) -> None:
    """Its config holds data.token_dtype: a .bin file's dtype is derived from the vocabulary
    now (uint16 up to 65,536 ids), so the dtype it derives resumes silently and another is
    refused naming the key; where no .bin file was read the key is not compared."""
    tokens = tmp_path / "tokens.bin"
    tokens.write_bytes(bytes(4096))
    model = {"model__vocab_size": vocab, "model__n_embd": 8, "model__n_head": 1}
    config = tiny_config(**BASE, data__format="tokens", data__path=str(tokens), **model)
    saved = to_dict(config)
    saved["data"]["token_dtype"] = saved_dtype
    expected = [Change("data.token_dtype", f'"{saved_dtype}"', f'"{derived}"')] if saved_dtype != derived else []
    assert config_changes(saved, config) == expected
    assert all(change.key in REFUSED for change in expected)
    plain = tiny_config(**BASE)
    assert config_changes({**to_dict(plain), "data": {**to_dict(plain)["data"], "token_dtype": "uint32"}}, plain) == []


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda"])
def test_a_checkpoints_worker_device_is_not_compared(device: str) -> None:
    """A checkpoint saved while worker.device chose the device holds it; worker.gpus
    picks it now (and is compared as any key is)."""
    config = tiny_config(**BASE)
    saved = to_dict(config)
    saved["worker"]["device"] = device
    assert config_changes(saved, config) == []


@pytest.mark.parametrize("env", ["CARGOHOLD_AUTH_TOKEN", "MY_TOKEN", None])
def test_a_checkpoints_auth_token_env_is_not_compared(env: str | None) -> None:
    """A checkpoint saved while security.auth_token_env named the token's variable holds
    it; the launcher always reads CARGOHOLD_AUTH_TOKEN now."""
    config = tiny_config(**BASE)
    saved = to_dict(config)
    saved["security"]["auth_token_env"] = env
    assert config_changes(saved, config) == []


@pytest.mark.parametrize(("enabled", "port"), [(True, 0), (False, None)])
def test_a_checkpoints_metrics_enabled_compares_as_metrics_port(enabled: bool, port: int | None) -> None:
    """A checkpoint saved while metrics.enabled turned the endpoints on or off: false is a
    null metrics.port now, true the port it saved."""
    config = tiny_config(**{**BASE, "metrics__port": port})
    saved = to_dict(config)
    saved["metrics"].update(enabled=enabled, port=0)
    assert config_changes(saved, config) == []
