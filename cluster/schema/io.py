"""Reading a run's configuration: YAML files, ``key.path=value`` overrides, and building
the typed dataclasses of :mod:`cargohold.cluster.schema` from plain data, every key and
value checked and named by its dotted path."""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from cargohold.cluster.schema.train import TrainConfig
from cargohold.cluster.schema.tuning import SECTION, gather_tuning, split_tuning, tuning_keys
from cargohold.services.core.errors import ConfigError

_BETAS = "set optim.betas: [beta1, beta2] (two numbers, as torch.optim.AdamW takes them)"
_TLS = "set security.tls_dir, a folder holding tls.crt, tls.key and ca.crt (a Kubernetes TLS secret's layout)"
RETIRED_KEYS: dict[str, str] = {
    "progress": (
        "no key sets it: the progress bar shows when stderr is a terminal, one plain line per step otherwise "
        "(cargohold.Trainer(progress=...) chooses in Python)"
    ),
    "data.corpus_path": "set data.path (with data.format: bytes, the text file to train on; null generates the corpus)",
    "optim.beta1": _BETAS,
    "optim.beta2": _BETAS,
    "security.tls_cert_file": _TLS,
    "security.tls_key_file": _TLS,
    "security.tls_ca_file": _TLS,
    "worker.device": (
        "no key sets it: set worker.gpus (1 on GPU nodes): workers that reserve GPUs compute on CUDA with NCCL, "
        "workers with worker.gpus: 0 on the CPU with gloo"
    ),
    "security.auth_token_env": (
        "no key sets it: the launcher always reads the state servers' token from the environment variable "
        "CARGOHOLD_AUTH_TOKEN (unset or empty: a random token per run); set that variable in the driver's "
        "environment instead"
    ),
    "metrics.enabled": (
        "set metrics.port: null for no metrics endpoints (0, the default, serves them on any free port; "
        "N on the range from N)"
    ),
    "data.token_dtype": (
        "no key sets it: a .bin token file holds uint16 ids when the model's vocabulary has at most 65,536 ids, "
        "uint32 ids otherwise (nanoGPT's convention); write ids of any other dtype as a .npy file, which states "
        "its own"
    ),
}
"""Keys a configuration no longer has, each with what to write instead: refused as unknown
keys are, the message saying how to migrate."""


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that also reads exponent floats without a dot (``3e-4``, ``1e-8``) as
    floats; YAML 1.1, which PyYAML implements, would read them as strings."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> TrainConfig:
    """Read YAML (or start from defaults) and apply ``dotted.key=value`` overrides; tuning
    values are read from the ``tuning:`` section only (:mod:`.tuning`)."""
    data: dict[str, Any] = read_yaml_mapping(path, "config file") if path is not None else {}
    for override in overrides:
        _apply_override(data, override)
    data, tuning = split_tuning(data, tuning_keys(TrainConfig))
    for key, value in tuning:
        _set(data, key, value, f"{SECTION}.{key}")
    config = from_dict(TrainConfig, data)
    _check_hf_block_size(data, config)
    return config


def _check_hf_block_size(data: dict[str, Any], config: TrainConfig) -> None:
    """An `hf` model's context length comes from its config and ``data.block_size`` sets
    the sequence length: a ``model.block_size`` written for it (as it once had to be) is
    refused rather than silently ignored."""
    model = data.get("model")
    if config.hf.enabled and isinstance(model, dict) and "block_size" in model:
        raise ConfigError(
            "model.block_size is the built-in GPT's and is not read for an hf model; set data.block_size "
            "(the training sequence length; default: the model's max_position_embeddings)"
        )


def read_yaml_mapping(path: str | Path, what: str) -> dict[str, Any]:
    """A YAML file holding a mapping (empty file: {}); ConfigError names the file."""
    path = Path(path)
    try:
        loaded = yaml.load(path.read_text(encoding="utf-8"), Loader=_YamlLoader)
    except OSError as error:
        raise ConfigError(f"cannot read {what} {path}: {error.strerror}") from error
    except UnicodeDecodeError as error:
        raise ConfigError(f"{what} {path} is not UTF-8 text: {error}") from error
    except yaml.YAMLError as error:
        raise ConfigError(f"{what} {path} is not valid YAML: {error}") from error
    except RecursionError:
        raise ConfigError(f"{what} {path} is nested too deeply {TOO_DEEP}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{what} {path} must hold a mapping, got {type(loaded).__name__}")
    return loaded


def from_dict(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Build dataclass ``cls`` from a mapping, checking every key and value type."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - fields, key=str)
    for key in (prefix + str(name) for name in unknown):
        if key in RETIRED_KEYS:
            raise ConfigError(f"unknown config key {key!r}: {RETIRED_KEYS[key]}")
    if unknown:
        raise ConfigError(
            f"unknown config key {prefix + str(unknown[0])!r}; known keys here: {', '.join(sorted(fields))}"
        )
    kwargs = {name: _coerce(hints[name], value, prefix + name) for name, value in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as error:
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: {error}") from error


def to_dict(config: Any) -> dict[str, Any]:
    """Plain data, every value in its section (as manifests hold it);
    ``from_dict(type(c), to_dict(c)) == c``."""
    return dataclasses.asdict(config)


def to_user_dict(config: TrainConfig) -> dict[str, Any]:
    """Plain data as a user writes it (tuning values under ``tuning:``), for a YAML file
    that :func:`load_config` reads back as ``config``."""
    return gather_tuning(to_dict(config), tuning_keys(TrainConfig))


def _coerce(hint: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in (o for o in options if o is not type(None)):
            try:
                return _coerce(option, value, key)
            except ConfigError as error:
                errors.append(str(error))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: {value!r} matches none of {hint}")
    if origin is Literal:
        allowed = typing.get_args(hint)
        if isinstance(value, bool) and ("on" if value else "off") in allowed:
            value = "on" if value else "off"  # YAML 1.1 reads a bare on/off as a boolean
        if value not in allowed:
            raise ConfigError(f"{key} must be one of {', '.join(map(repr, allowed))}; got {value!r}")
        return value
    if origin is list:
        (item_type,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        return [_coerce(item_type, item, f"{key}[{index}]") for index, item in enumerate(value)]
    if origin is dict:
        key_type, value_type = typing.get_args(hint)
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, got {value!r}")
        return {_coerce(key_type, k, f"{key}.{k}"): _coerce(value_type, v, f"{key}.{k}") for k, v in value.items()}
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return from_dict(hint, value if value is not None else {}, key + ".")
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported config type {hint}")  # a schema bug, not user input


TOO_DEEP = "to read (past Python's recursion limit); a configuration nests a few levels"
"""Why input nested past the YAML parser's depth is refused (it would raise RecursionError)."""
SHOWN_CHARS = 60
"""How much of an override a message repeats."""


def _apply_override(data: dict[str, Any], override: str) -> None:
    shown = override if len(override) <= SHOWN_CHARS else override[:SHOWN_CHARS] + "..."
    dotted, sep, raw = override.partition("=")
    if not sep or not dotted.strip():
        raise ConfigError(f"override {shown!r} must look like key.path=value")
    try:
        value = yaml.load(raw, Loader=_YamlLoader) if raw.strip() else None
    except yaml.YAMLError as error:
        raise ConfigError(f"override {shown!r}: value is not valid YAML: {error}") from error
    except RecursionError:
        raise ConfigError(f"override {shown!r}: value is nested too deeply {TOO_DEEP}") from None
    _set(data, dotted.strip(), value, f"override {shown!r}")


def _set(data: dict[str, Any], dotted: str, value: Any, source: str) -> None:
    """Set ``dotted`` (``a.b.c``) in ``data``, making absent sections; ``source`` names
    the input in the error where a section on the way holds a value."""
    *parents, leaf = dotted.split(".")
    node = data
    for index, part in enumerate(parents):
        child = node.get(part)
        if child is None:  # an absent or empty section (``optim:``) means defaults
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"{source}: {'.'.join(parents[: index + 1])} is not a section")
        node = child
    node[leaf] = value
