"""The config schema: loading, overrides, refusals (each naming the dotted key), the frozen
set of keys, the generated reference in docs/configuration.md, and the CLI's handling of
bad configuration. No test here starts a training run."""

from __future__ import annotations

import dataclasses
import io
import re
import sys
import typing
from pathlib import Path

import pytest
import yaml

from cargohold import __version__
from cargohold.cluster import cli
from cargohold.cluster.schema import reference as config_reference
from cargohold.cluster.schema.data import DataConfig
from cargohold.cluster.schema.io import from_dict, load_config, to_dict, to_user_dict
from cargohold.cluster.schema.model import GPTConfig
from cargohold.cluster.schema.optim import OptimConfig
from cargohold.cluster.schema.reference import REGENERATE, render_reference, type_name
from cargohold.cluster.schema.run import ClusterConfig, MetricsConfig
from cargohold.cluster.schema.server import StateServerConfig
from cargohold.cluster.schema.train import TrainConfig
from cargohold.cluster.schema.tuning import is_tuning, tuning_keys
from cargohold.cluster.schema.worker import WorkerConfig
from cargohold.services.core.errors import ConfigError

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "demo.yaml"
REFERENCE = ROOT / "docs" / "configuration.md"

# Every dotted key of TrainConfig. Adding, removing or renaming a key is a deliberate
# change: update this list and regenerate docs/configuration.md (see REGENERATE).
CONFIG_SURFACE = [
    "run_id",
    "steps",
    "seed",
    "export_dir",
    "model.vocab_size",
    "model.block_size",
    "model.n_layer",
    "model.n_head",
    "model.n_embd",
    "model.dropout",
    "model.bias",
    "hf.config_path",
    "hf.checkpoint_dir",
    "data.format",
    "data.path",
    "data.corpus_bytes",
    "data.batch_size",
    "data.micro_batches",
    "data.block_size",
    "data.seed",
    "data.tokenizer",
    "data.field",
    "data.split",
    "data.cache_dir",
    "data.packing",
    "data.overlong",
    "eval.path",
    "eval.split",
    "eval.every_steps",
    "eval.max_batches",
    "optim.lr",
    "optim.betas",
    "optim.eps",
    "optim.weight_decay",
    "optim.no_decay",
    "optim.param_groups",
    "optim.param_groups[].name",
    "optim.param_groups[].params",
    "optim.param_groups[].lr_mult",
    "optim.param_groups[].weight_decay",
    "optim.max_grad_norm",
    "optim.warmup_steps",
    "optim.schedule",
    "optim.min_lr_ratio",
    "optim.nonfinite",
    "optim.state_dtype",
    "worker.num_workers",
    "worker.compute_dtype",
    "worker.reshard_after_forward",
    "worker.offload_params",
    "worker.weights_nvme_path",
    "worker.max_unit_params",
    "worker.activation_checkpointing",
    "worker.delayed_update",
    "worker.cpus",
    "worker.gpus",
    "worker.optimizer_on_device_fraction",
    "worker.resources",
    "state_server.num_servers",
    "state_server.cpus",
    "state_server.bind_host",
    "state_server.allow_wildcard_bind",
    "state_server.resources",
    "state_server.tier.nvme_paths",
    "state_server.tier.ram_budget_bytes",
    "cluster.address",
    "cluster.host_memory_bytes",
    "metrics.port",
    "metrics.file_sd_path",
    "security.tls_dir",
    "checkpoint.dir",
    "checkpoint.every_steps",
    "checkpoint.keep_last",
    "checkpoint.resume",
    "checkpoint.max_failures",
    "checkpoint.on_save_error",
    "tuning.eval.batch_size",
    "tuning.optim.loss_scale.init_scale",
    "tuning.optim.loss_scale.growth_factor",
    "tuning.optim.loss_scale.backoff_factor",
    "tuning.optim.loss_scale.growth_interval",
    "tuning.worker.grad_wire_dtype",
    "tuning.worker.kept_gathered_units",
    "tuning.worker.shared_memory_collectives",
    "tuning.worker.weight_window",
    "tuning.worker.delayed_update_after_steps",
    "tuning.worker.exchange_slots",
    "tuning.worker.shared_memory",
    "tuning.worker.host_allocator",
    "tuning.state_server.rpc_threads",
    "tuning.state_server.chunk_bytes",
    "tuning.state_server.data_plane",
    "tuning.state_server.rpc_timeout_s",
    "tuning.state_server.max_concurrent_calls",
    "tuning.state_server.message_timeout_s",
    "tuning.state_server.tier.partition_bytes",
    "tuning.state_server.tier.buffer_count",
    "tuning.state_server.tier.io_threads",
    "tuning.state_server.tier.direct_io",
    "tuning.cluster.num_cpus",
    "tuning.cluster.placement_strategy",
    "tuning.cluster.startup_timeout_s",
]


def _write(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _assert_names(error: pytest.ExceptionInfo[ConfigError], key: str) -> None:
    """The message names ``key`` as a whole dotted key (not a prefix of a longer one)."""
    message = str(error.value)
    assert re.search(rf"(?<![\w.]){re.escape(key)}(?![\w])", message), f"{key!r} not named in: {message}"


def _dotted_keys(cls: type, prefix: str = "") -> list[str]:
    """Every key of ``cls`` a user sets outside ``tuning:``; a list of sections is a key,
    and its items' keys follow it (``optim.param_groups``, then ``optim.param_groups[].name``)."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            keys += _dotted_keys(hint, f"{prefix}{f.name}.")
            continue
        if is_tuning(f):
            continue
        keys.append(prefix + f.name)
        if typing.get_origin(hint) is list and dataclasses.is_dataclass(typing.get_args(hint)[0]):
            keys += _dotted_keys(typing.get_args(hint)[0], f"{prefix}{f.name}[].")
    return keys


# --- loading ------------------------------------------------------------------------------


def test_defaults_load_without_a_file() -> None:
    config = load_config()
    assert config == TrainConfig()
    assert config.steps == 50 and config.model == GPTConfig() and config.optim.lr == 1e-3
    assert config.state_server.bind_host is None and config.worker.resources == {}


def test_empty_file_means_defaults(tmp_path: Path) -> None:
    assert load_config(_write(tmp_path, "# nothing set\n")) == TrainConfig()


def test_demo_yaml_loads_the_expected_values() -> None:
    expected = TrainConfig(
        steps=50,
        seed=0,
        model=GPTConfig(n_layer=6, n_head=6, n_embd=384, block_size=128),
        data=DataConfig(batch_size=8, corpus_bytes=2_000_000),
        optim=OptimConfig(
            lr=0.001, betas=[0.9, 0.95], weight_decay=0.01, max_grad_norm=1.0, warmup_steps=10, schedule="cosine"
        ),
        worker=WorkerConfig(num_workers=2),
        state_server=StateServerConfig(num_servers=1),
        cluster=ClusterConfig(),
        metrics=MetricsConfig(),
    )
    config = load_config(DEMO)
    assert config == expected
    assert isinstance(config.optim.lr, float) and isinstance(config.optim.max_grad_norm, float)


def test_overrides_apply_on_top_of_the_file() -> None:
    config = load_config(
        DEMO,
        ["steps=3", "optim.lr=3e-4", "worker.resources={node_a: 1}", "state_server.bind_host=null"],
    )
    assert config.steps == 3
    assert config.optim.lr == pytest.approx(3e-4) and isinstance(config.optim.lr, float)
    assert config.worker.resources == {"node_a": 1.0}
    assert isinstance(config.worker.resources["node_a"], float)
    assert config.state_server.bind_host is None
    assert config.optim.schedule == "cosine"  # untouched keys keep the file's values


def test_later_override_wins_and_empty_value_is_null() -> None:
    config = load_config(None, ["state_server.bind_host=10.0.0.1", "state_server.bind_host="])
    assert config.state_server.bind_host is None
    assert load_config(None, ["steps=3", "steps=7"]).steps == 7


def test_exponent_floats_without_a_dot_are_numbers(tmp_path: Path) -> None:
    # YAML 1.1 (PyYAML) would read 1e-8 as a string; the loader reads it as a float.
    config = load_config(_write(tmp_path, "optim:\n  lr: 2e-3\n  eps: 1E-8\n"))
    assert config.optim.lr == pytest.approx(2e-3) and config.optim.eps == pytest.approx(1e-8)
    with pytest.raises(ConfigError) as error:
        load_config(_write(tmp_path, 'optim:\n  lr: "3e-4"\n'))  # quoted stays a string
    _assert_names(error, "optim.lr")


def test_override_into_an_empty_section(tmp_path: Path) -> None:
    config = load_config(_write(tmp_path, "optim:\nworker: {}\n"), ["optim.lr=0.5", "worker.num_workers=3"])
    assert config.optim.lr == 0.5 and config.worker.num_workers == 3


def test_override_below_a_scalar_is_refused() -> None:
    with pytest.raises(ConfigError) as error:
        load_config(None, ["steps=3", "steps.x=1"])
    _assert_names(error, "steps")


def test_tier_paths_are_a_list_from_yaml_and_overrides(tmp_path: Path) -> None:
    text = "state_server:\n  tier:\n    nvme_paths: [/mnt/nvme0, /mnt/nvme1]\n    ram_budget_bytes: 8000000000\n"
    config = load_config(_write(tmp_path, text), ["tuning.state_server.tier.direct_io=off"])
    tier = config.state_server.tier
    assert tier.nvme_paths == ["/mnt/nvme0", "/mnt/nvme1"] and tier.ram_budget_bytes == 8_000_000_000
    assert tier.direct_io == "off"  # YAML 1.1 reads a bare off as false; the schema wants the word
    on = load_config(_write(tmp_path, "tuning:\n  state_server:\n    tier:\n      direct_io: on\n"))
    assert on.state_server.tier.direct_io == "on"
    # 256 MiB partitions (their 3 staging buffers take a quarter of 8 GB at most), each
    # buffer with room for its partition's staged fp32 gradient after it
    assert tier.partition_size() == 256 << 20
    assert 3 * (256 << 20) * 16 // 12 - 4096 <= tier.staging_bytes() <= 3 * ((256 << 20) * 16 // 12 + 5 * 4096)
    assert load_config(None, ["state_server.tier.nvme_paths=[/x]"]).state_server.tier.nvme_paths == ["/x"]
    assert from_dict(TrainConfig, to_dict(config)) == config


# --- refusals -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("stepz: 3\n", "stepz"),
        ("optim:\n  lrr: 0.1\n", "optim.lrr"),
        ("model:\n  n_embed: 64\n", "model.n_embed"),
        ("steps: 5\n1: x\nfoo: y\n", "1"),  # keys of mixed types still give a ConfigError
    ],
)
def test_unknown_keys_are_refused_with_the_dotted_key(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(_write(tmp_path, text))
    _assert_names(error, key)


def test_unknown_override_key_is_refused() -> None:
    with pytest.raises(ConfigError) as error:
        load_config(None, ["optim.lrr=1"])
    _assert_names(error, "optim.lrr")


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('steps: "ten"\n', "steps"),
        ("steps: true\n", "steps"),
        ("steps: 10.0\n", "steps"),
        ('optim:\n  lr: "fast"\n', "optim.lr"),
        ("worker:\n  compute_dtype: float64\n", "worker.compute_dtype"),
        ("optim:\n  schedule: linear\n", "optim.schedule"),
        ("model: 3\n", "model"),
        ("metrics:\n  port: fast\n", "metrics.port"),
        ("run_id: 7\n", "run_id"),
        ("worker:\n  resources: [a, b]\n", "worker.resources"),
        ("worker:\n  resources: {node_a: many}\n", "worker.resources.node_a"),
        ("tuning:\n  cluster:\n    num_cpus: four\n", "cluster.num_cpus"),
        ("tuning:\n  cluster:\n    placement_strategy: CLOSE\n", "cluster.placement_strategy"),
        ("state_server:\n  tier:\n    nvme_paths: /mnt/nvme0\n", "state_server.tier.nvme_paths"),
        ("state_server:\n  tier:\n    nvme_paths: [/mnt/a, 7]\n", "state_server.tier.nvme_paths[1]"),
        ("state_server:\n  tier:\n    direct_io: maybe\n", "tuning.state_server.tier.direct_io"),
    ],
)
def test_wrong_types_are_refused_naming_the_key(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(_write(tmp_path, text))
    _assert_names(error, key)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("worker:\n  num_workers: 0\n", "worker.num_workers"),
        ("optim:\n  betas: [1.5, 0.999]\n", "optim.betas"),
        ("optim:\n  betas: [0.9, 1.0]\n", "optim.betas"),
        ("optim:\n  betas: [0.9, .nan]\n", "optim.betas"),
        ("optim:\n  betas: [0.9]\n", "optim.betas"),
        ("optim:\n  betas: [0.9, 0.99, 0.999]\n", "optim.betas"),
        ("model:\n  n_embd: 100\n  n_head: 6\n", "model.n_embd"),
        ("state_server:\n  chunk_bytes: 10\n", "tuning.state_server.chunk_bytes"),
        ("steps: 0\n", "steps"),
        ("optim:\n  lr: .nan\n", "optim.lr"),
        ("model:\n  dropout: 1.0\n", "model.dropout"),
        ("tuning:\n  cluster:\n    num_cpus: 0\n", "tuning.cluster.num_cpus"),
        ("tuning:\n  eval:\n    batch_size: 0\n", "tuning.eval.batch_size"),
        ("state_server:\n  tier:\n    ram_budget_bytes: 1000000000\n", "state_server.tier.nvme_paths"),
        (
            "state_server:\n  tier:\n    nvme_paths: [/a]\n    ram_budget_bytes: 1000\n",
            "state_server.tier.ram_budget_bytes",
        ),
        ("state_server:\n  tier:\n    buffer_count: 1\n", "tuning.state_server.tier.buffer_count"),
        (
            "tuning:\n  state_server:\n    tier:\n      partition_bytes: 100\n",
            "tuning.state_server.tier.partition_bytes",
        ),
        ("state_server:\n  tier:\n    nvme_paths: [/a, /a]\n", "state_server.tier.nvme_paths"),
        ("state_server:\n  tier:\n    io_threads: 0\n", "tuning.state_server.tier.io_threads"),
        ("state_server:\n  rpc_timeout_s: .inf\n", "tuning.state_server.rpc_timeout_s"),
        ("state_server:\n  max_concurrent_calls: 4\n", "tuning.state_server.max_concurrent_calls"),
        ("state_server:\n  message_timeout_s: 0\n", "tuning.state_server.message_timeout_s"),
        ("worker:\n  cpus: .inf\n", "worker.cpus"),
        ("worker:\n  max_unit_params: -1\n", "worker.max_unit_params"),
        ("worker:\n  kept_gathered_units: -1\n", "tuning.worker.kept_gathered_units"),
        ("worker:\n  weight_window: 1\n", "tuning.worker.weight_window"),
        ("worker:\n  weights_nvme_path: ''\n", "worker.weights_nvme_path"),
        ("metrics:\n  port: 1\n", "metrics.port"),
        ("state_server:\n  bind_host: 0.0.0.0\n", "state_server.allow_wildcard_bind"),
        ("state_server:\n  bind_host: '::'\n", "state_server.bind_host"),
        ("run_id: a/b\n", "run_id"),
        ("run_id: ../x\n", "run_id"),
        (f"run_id: {'r' * 65}\n", "run_id"),
        ("run_id: .hidden\n", "run_id"),
    ],
)
def test_bad_values_are_refused_naming_the_key(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(_write(tmp_path, text))
    _assert_names(error, key)


def test_a_null_metrics_port_serves_no_endpoints(tmp_path: Path) -> None:
    """No key turns metrics on or off: metrics.port null serves none, 0 (the default) each
    on a free port; the retired metrics.enabled is refused saying so."""
    assert load_config().metrics.enabled and load_config().metrics.port == 0
    off = load_config(None, ["metrics.port=null"]).metrics
    assert not off.enabled and off.port_for("worker", 1, TrainConfig()) == 0
    with pytest.raises(ConfigError, match=r"unknown config key 'metrics\.enabled': set metrics\.port: null"):
        load_config(None, ["metrics.enabled=false"])
    with pytest.raises(ConfigError, match=r"metrics\.file_sd_path lists the metrics endpoints; metrics\.port null"):
        load_config(None, ["metrics.port=null", f"metrics.file_sd_path={tmp_path / 'targets.json'}"])


@pytest.mark.parametrize(
    "content",
    [
        pytest.param("- 1\n- 2\n", id="not-a-mapping"),
        pytest.param("just a string\n", id="scalar"),
        pytest.param("steps: [1, 2\n", id="invalid-yaml"),
        pytest.param(b"\xff\xfe\x00 not text", id="not-utf8"),
    ],
)
def test_bad_files_name_the_file(tmp_path: Path, content: str | bytes) -> None:
    path = tmp_path / "broken.yaml"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    with pytest.raises(ConfigError, match=re.escape(str(path))):
        load_config(path)


def test_missing_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "missing.yaml"
    with pytest.raises(ConfigError, match=re.escape(str(path))):
        load_config(path)


@pytest.mark.parametrize("override", ["steps", "=3", " =3", ""])
def test_malformed_overrides_are_refused(override: str) -> None:
    with pytest.raises(ConfigError, match="key.path=value"):
        load_config(None, [override])


def test_override_with_invalid_yaml_value_is_refused() -> None:
    with pytest.raises(ConfigError, match=re.escape("worker.resources={node_a: 1")):
        load_config(None, ["worker.resources={node_a: 1"])


# --- keys folded into others --------------------------------------------------------------


def test_adamw_betas_are_one_key_as_torch_spells_them(tmp_path: Path) -> None:
    config = load_config(_write(tmp_path, "optim:\n  betas: [0.8, 0.95]\n"))
    assert config.optim.betas == [0.8, 0.95]
    hyper = config.optim.hyper_params()  # what the state servers update with
    assert (hyper.beta1, hyper.beta2) == (0.8, 0.95)
    assert load_config(None, ["optim.betas=[0, 0.5]"]).optim.hyper_params().beta2 == 0.5
    assert OptimConfig(betas=(0.8, 0.95)) == config.optim  # a tuple, as torch.optim.AdamW takes it
    assert OptimConfig().betas == [0.9, 0.999]


@pytest.mark.parametrize("old", ["beta1", "beta2"])
@pytest.mark.parametrize("where", ["file", "override"])
def test_the_two_beta_keys_are_refused_naming_betas(tmp_path: Path, old: str, where: str) -> None:
    with pytest.raises(ConfigError, match=rf"unknown config key 'optim\.{old}': set optim\.betas: \[beta1, beta2\]"):
        if where == "file":
            load_config(_write(tmp_path, f"optim:\n  alpha: 1\n  {old}: 0.95\n"))  # named before an unrelated typo
        else:
            load_config(None, [f"optim.{old}=0.95"])


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("terminal", [True, False])
def test_the_progress_bar_shows_when_stderr_is_a_terminal(monkeypatch: pytest.MonkeyPatch, terminal: bool) -> None:
    """Otherwise (a pipe, a log file, a Ray job's output, pytest's capture) each step is one
    plain line on stdout; cargohold.Trainer(progress=...) chooses in Python."""
    from cargohold.trainer import Trainer

    monkeypatch.setattr(sys, "stderr", _Terminal() if terminal else io.StringIO())
    assert Trainer(config=TrainConfig()).progress is terminal
    assert Trainer(config=TrainConfig(), progress=not terminal).progress is not terminal


@pytest.mark.parametrize("where", ["file", "override"])
def test_no_key_sets_the_progress_bar(tmp_path: Path, where: str) -> None:
    with pytest.raises(ConfigError, match=r"unknown config key 'progress': no key sets it: .* stderr is a terminal"):
        load_config(
            _write(tmp_path, "progress: false\n") if where == "file" else None,
            [] if where == "file" else ["progress=false"],
        )


# --- round trip and hash ------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [[], ["worker.resources={node_a: 1, gpu_box: 0.5}", "tuning.cluster.num_cpus=4", "run_id=abc", "optim.lr=3e-4"]],
)
def test_from_dict_of_to_dict_round_trips(tmp_path: Path, overrides: list[str]) -> None:
    config = load_config(DEMO, overrides)
    assert from_dict(TrainConfig, to_dict(config)) == config
    # ... and through a YAML file, the documented channel.
    dumped = _write(tmp_path, yaml.safe_dump(to_user_dict(config)), "dumped.yaml")
    assert load_config(dumped) == config


# --- the frozen surface and the generated reference ---------------------------------------


def test_config_surface_is_frozen() -> None:
    keys = _dotted_keys(TrainConfig) + [f"tuning.{key}" for key in tuning_keys(TrainConfig)]
    assert len(keys) == len(set(keys))
    added, removed = sorted(set(keys) - set(CONFIG_SURFACE)), sorted(set(CONFIG_SURFACE) - set(keys))
    assert not added and not removed, (
        f"config keys changed (added {added}, removed {removed}): update CONFIG_SURFACE in "
        f"tests/test_config.py and regenerate the docs with `{REGENERATE}`"
    )
    assert keys == CONFIG_SURFACE, "config keys were reordered: update CONFIG_SURFACE and regenerate the docs"


def test_every_key_is_documented_in_the_reference() -> None:
    text = render_reference()
    for key in CONFIG_SURFACE:
        assert f"| `{key}` |" in text, f"{key} missing from the reference"


def test_docs_configuration_md_is_current() -> None:
    assert REFERENCE.is_file(), f"docs/configuration.md is missing; generate it with `{REGENERATE}`"
    assert REFERENCE.read_text(encoding="utf-8") == render_reference(), (
        f"docs/configuration.md is out of date with the config schema; regenerate it with `{REGENERATE}`"
    )


def test_reference_uses_the_field_docstrings() -> None:
    text = render_reference()
    assert "| `optim.lr` | `float` | `0.001` | Peak learning rate. |" in text
    assert "| `state_server.bind_host` | `str \\| None` | `null` |" in text
    assert '| `optim.schedule` | `one of "constant", "cosine"` | `"constant"` |' in text
    assert "| `optim.eps` | `float` | `1e-08` |  |" in text  # no docstring, no invented text


@pytest.mark.parametrize(
    ("hint", "name"),
    [
        (int, "int"),
        (float, "float"),
        (str | None, "str | None"),
        (dict[str, float], "dict[str, float]"),
        (list[str], "list[str]"),
    ],
)
def test_type_names_are_readable(hint: object, name: str) -> None:
    assert type_name(hint) == name


def test_docs_check_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    current = _write(tmp_path, render_reference(), "current.md")
    assert config_reference.main(["--check", str(current)]) == 0
    stale = _write(tmp_path, render_reference() + "edited\n", "stale.md")
    assert config_reference.main(["--check", str(stale)]) != 0
    assert str(stale) in capsys.readouterr().err
    assert config_reference.main(["--check", str(tmp_path / "absent.md")]) != 0
    assert REGENERATE in capsys.readouterr().err


# --- the CLI ------------------------------------------------------------------------------


@pytest.fixture
def no_training(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(config: TrainConfig) -> int:
        raise AssertionError("a CLI test reached training")

    monkeypatch.setattr(cli, "_train", refuse)


def test_cli_missing_config_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], no_training: None) -> None:
    path = tmp_path / "missing.yaml"
    assert cli.main(["train", "--config", str(path)]) == 2
    captured = capsys.readouterr()
    assert str(path) in captured.err and captured.out == ""


def test_cli_unknown_override_exits_2(capsys: pytest.CaptureFixture[str], no_training: None) -> None:
    assert cli.main(["train", "--set", "optim.lrr=1"]) == 2
    assert "optim.lrr" in capsys.readouterr().err


def test_cli_resume_from_a_missing_folder_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_training: None
) -> None:
    """Found before anything starts, naming the key (it used to fail in start-up, exit 1)."""
    assert cli.main(["train", "--resume", str(tmp_path / "nonexistent")]) == 2
    assert "checkpoint.resume" in capsys.readouterr().err


def test_cli_malformed_override_exits_2(capsys: pytest.CaptureFixture[str], no_training: None) -> None:
    assert cli.main(["train", "--config", str(DEMO), "--set", "steps"]) == 2
    assert "key.path=value" in capsys.readouterr().err


def test_cli_version(capsys: pytest.CaptureFixture[str], no_training: None) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"cargohold {__version__}"


def test_cli_without_a_command_prints_help(capsys: pytest.CaptureFixture[str], no_training: None) -> None:
    assert cli.main([]) == 2
    out = capsys.readouterr().out
    assert "usage: cargohold" in out and "train" in out


@pytest.mark.parametrize("key", ["export_dir", "checkpoint.dir"])
def test_an_output_folder_under_a_file_is_refused_before_anything_runs(tmp_path: Path, key: str) -> None:
    """Found when the config loads, not after every step has trained."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(ConfigError) as error:
        load_config(None, [f"{key}={blocker / 'out'}"])
    _assert_names(error, key)
    assert str(blocker) in str(error.value)
    load_config(None, [f"{key}={tmp_path / 'new' / 'out'}"])  # folders still to create are fine


def test_a_wildcard_bind_needs_its_opt_in() -> None:
    config = load_config(None, ["state_server.bind_host=0.0.0.0", "state_server.allow_wildcard_bind=true"])
    assert config.state_server.bind_host == "0.0.0.0"
    assert load_config(None, ["run_id=run-2026.12_03"]).run_id == "run-2026.12_03"


@pytest.mark.parametrize(
    ("first", "inner", "keys"),
    [
        ("checkpoint.dir", "export_dir", ("checkpoint.dir", "export_dir")),
        ("export_dir", "checkpoint.dir", ("checkpoint.dir", "export_dir")),
        ("checkpoint.dir", "state_server.tier.nvme_paths", ("checkpoint.dir", "state_server.tier.nvme_paths[0]")),
        ("state_server.tier.nvme_paths", "export_dir", ("export_dir", "state_server.tier.nvme_paths[0]")),
        ("export_dir", "state_server.tier.nvme_paths", ("export_dir", "state_server.tier.nvme_paths[0]")),
    ],
)
def test_overlapping_output_folders_exit_2_before_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_training: None, first: str, inner: str, keys: tuple
) -> None:
    """Issue 27 row E: an export inside checkpoint.dir was deleted by pruning; a folder
    of the run inside another (or the same one) is refused, naming both keys."""
    outer = tmp_path / "out"

    def value(key: str, path: Path) -> str:
        return f"{key}=[{path}]" if key.endswith("nvme_paths") else f"{key}={path}"

    assert cli.main(["train", "--set", value(first, outer), "--set", value(inner, outer / "inside")]) == 2
    err = capsys.readouterr().err
    assert all(key in err for key in keys) and "overlap" in err, err
    assert not outer.exists()  # refused before anything was created
    with pytest.raises(ConfigError, match="overlap"):
        load_config(None, [value(first, outer), value(inner, outer)])  # the same folder twice too
    load_config(None, [value(first, outer / "a"), value(inner, outer / "b")])  # siblings are fine
