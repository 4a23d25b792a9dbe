"""Tuning values: defaults chosen by measurement; change one only with a benchmark that
shows it helps on your machine.

A tuning value is a field of the section that uses it (``WorkerConfig.exchange_slots``),
marked with :func:`tuning`. A user sets it only under the one ``tuning:`` section, by
the same path (``tuning.worker.exchange_slots``), so that a config file says at a glance
which of its values are decisions (the model, the data, the machines) and which are
measurements someone else made; :func:`split_tuning` takes those values out for the
loader to set in their sections before the config is built. The configuration reference
lists them apart.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from cargohold.services.core.errors import ConfigError

SECTION = "tuning"
_MARK = "tuning"


def tuning(default: Any) -> Any:
    """A field whose default was chosen by measurement (set only under ``tuning:``)."""
    return dataclasses.field(default=default, metadata={_MARK: True})


def is_tuning(field: dataclasses.Field) -> bool:
    return bool(field.metadata.get(_MARK))


def tuning_keys(cls: type, prefix: str = "") -> tuple[str, ...]:
    """The dotted paths (``worker.exchange_slots``) of every tuning field below ``cls``."""
    hints = typing.get_type_hints(cls)
    keys: list[str] = []
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            keys.extend(tuning_keys(hint, f"{prefix}{field.name}."))
        elif is_tuning(field):
            keys.append(prefix + field.name)
    return tuple(keys)


def split_tuning(data: dict[str, Any], keys: typing.Collection[str]) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
    """``data`` as a user wrote it, without its ``tuning:`` section, and the section's
    values by dotted key (each to be set in its own section); a tuning value outside
    ``tuning:``, or anything else inside it, is refused naming the key."""
    for key in keys:
        if _lookup(data, key) is not _ABSENT:
            raise ConfigError(
                f"{key} is a tuning value (its default was chosen by measurement): set it as {SECTION}.{key}, "
                "and only with a benchmark that shows it helps"
            )
    rest = {k: v for k, v in data.items() if k != SECTION}
    given = data.get(SECTION)
    if given is None:
        return rest, []
    if not isinstance(given, dict):
        raise ConfigError(f"{SECTION} must be a mapping, got {given!r}")
    values = _flatten(given, keys)
    for key, _ in values:
        if key not in keys:
            known = ", ".join(sorted(keys))
            raise ConfigError(f"{SECTION}.{key} is not a tuning value; the tuning values are: {known}")
    return rest, values


def gather_tuning(data: dict[str, Any], keys: typing.Collection[str]) -> dict[str, Any]:
    """The inverse of :func:`split_tuning`: ``data`` (a config as plain data) with each
    tuning value moved under ``tuning:``, as a user writes it."""
    gathered = _copy_sections(data)
    moved: dict[str, Any] = {}
    for key in keys:
        *parents, leaf = key.split(".")
        node, target = gathered, moved
        for part in parents:
            node = node[part]
            target = target.setdefault(part, {})
        target[leaf] = node.pop(leaf)
    return {**gathered, SECTION: moved} if moved else gathered


def _copy_sections(data: dict[str, Any]) -> dict[str, Any]:
    return {k: _copy_sections(v) if isinstance(v, dict) else v for k, v in data.items()}


_ABSENT = object()


def _lookup(data: Any, key: str) -> Any:
    node = data
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _ABSENT
        node = node[part]
    return node


def _flatten(data: dict[str, Any], keys: typing.Collection[str], prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) of each leaf of ``data``; descends into a mapping unless its
    path is a key itself."""
    found: list[tuple[str, Any]] = []
    for name, value in data.items():
        dotted = f"{prefix}{name}"
        if isinstance(value, dict) and dotted not in keys:
            found.extend(_flatten(value, keys, dotted + "."))
        else:
            found.append((dotted, value))
    return found
