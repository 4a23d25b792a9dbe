"""Render the Python API reference of ``docs/api.md`` from the public names' docstrings.

    python -m cargohold.reference                          # rewrite docs/api.md's reference
    python -m cargohold.reference --check docs/api.md      # exit 1 if it is stale

Everything above :data:`MARKER` in the file (the examples) is kept as written; everything
below is generated here, from the signatures and docstrings of the names the package
root exports, so the reference cannot drift from the code.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cargohold
from cargohold.cluster.schema.reference import class_docstrings

DOC = Path("docs/api.md")
REGENERATE = "python -m cargohold.reference"
MARKER = f"<!-- Generated below from the docstrings by `{REGENERATE}`; do not edit by hand. -->"
PUBLIC = (
    "Trainer",
    "start_state_servers",
    "connect_state_servers",
    "share_state_servers",
    "StateServers",
    "OffloadedAdamW",
)
"""In the order the reference lists them: the whole run, then how servers come for a loop
of one's own, then what uses them."""

_ROLE = re.compile(r":[a-z]+:`~?([\w.]+)`")


def render(current: str) -> str:
    """``current`` (the file's text) with everything after :data:`MARKER` regenerated."""
    head, found, _ = current.partition(MARKER)
    if not found:
        raise ValueError(f"the file has no line {MARKER!r} to put the reference under")
    return head + MARKER + "\n\n" + render_reference()


def render_reference() -> str:
    parts = ["## Reference", ""]
    for name in PUBLIC:
        value = getattr(cargohold, name)
        parts += _class(name, value) if inspect.isclass(value) else _function(f"cargohold.{name}", value, "###")
    return "\n".join(parts).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=REGENERATE, description="Regenerate the reference of docs/api.md.")
    parser.add_argument("--check", metavar="PATH", help="exit 1 if PATH's reference is not the generated one")
    args = parser.parse_args(argv)
    path = Path(args.check) if args.check else DOC
    try:
        current = path.read_text(encoding="utf-8")
        fresh = render(current)
    except (OSError, ValueError) as error:
        print(f"{path}: {error}", file=sys.stderr)
        return 1
    if args.check is None:
        path.write_text(fresh, encoding="utf-8")
        return 0
    if fresh != current:
        print(f"{path} is out of date with the docstrings; regenerate it with `{REGENERATE}`", file=sys.stderr)
        return 1
    return 0


def _class(name: str, cls: type) -> list[str]:
    lines = [f"### `cargohold.{name}{_signature(cls)}`", "", _text(inspect.getdoc(cls)), ""]
    if dataclasses.is_dataclass(cls):
        _, field_docs = class_docstrings(cls)
        lines += [f"- `{f.name}: {f.type}`: {_text(field_docs.get(f.name, ''))}" for f in dataclasses.fields(cls)]
        lines.append("")
    for attribute, value in vars(cls).items():
        if not attribute.startswith("_") and inspect.isfunction(inspect.unwrap(value)):
            lines += _function(f"{name}.{attribute}", value, "####")
    return lines


def _function(title: str, function: Callable[..., Any], level: str) -> list[str]:
    return [f"{level} `{title}{_signature(function)}`", "", _text(inspect.getdoc(function)), ""]


def _signature(value: Callable[..., Any]) -> str:
    """As written in the source: annotations stay the strings they are there."""
    signature = inspect.signature(value)
    parts, starred = [], False
    for parameter in signature.parameters.values():
        if parameter.name == "self":
            continue
        if parameter.kind is parameter.KEYWORD_ONLY and not starred:
            parts.append("*")
        starred = starred or parameter.kind in (parameter.KEYWORD_ONLY, parameter.VAR_POSITIONAL)
        text = parameter.name
        if parameter.annotation is not parameter.empty:
            text += f": {parameter.annotation}"
        if parameter.default is not parameter.empty:
            text += f" = {parameter.default!r}"
        parts.append(text)
    returns = signature.return_annotation
    shown = "" if returns is signature.empty or returns == "None" or inspect.isclass(value) else f" -> {returns}"
    return f"({', '.join(parts)}){shown}"


def _text(docstring: str | None) -> str:
    """Docstring markup as Markdown: ``code`` and :role:`~target` become code spans."""
    text = (docstring or "").replace("``", "`")
    return _ROLE.sub(lambda m: f"`{m.group(1).rsplit('.', 1)[-1]}`", text)


if __name__ == "__main__":
    sys.exit(main())
