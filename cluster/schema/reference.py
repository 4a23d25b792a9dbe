"""Render the configuration reference (``docs/configuration.md``) from the schema.

    python -m cargohold.cluster.schema.reference > docs/configuration.md   # regenerate
    python -m cargohold.cluster.schema.reference --check docs/configuration.md

Types and defaults come from the dataclasses in :mod:`cargohold.cluster.schema`;
descriptions are the attribute docstrings (the string literal right after a field in the
class body), read with ``ast``. A field without one gets an empty description: the text
lives in the schema, never here.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import json
import sys
import textwrap
import types
import typing
from pathlib import Path
from typing import Any, Literal

from cargohold.cluster.schema.train import TrainConfig
from cargohold.cluster.schema.tuning import SECTION as TUNING_SECTION
from cargohold.cluster.schema.tuning import is_tuning

REGENERATE = "python -m cargohold.cluster.schema.reference > docs/configuration.md"

_INTRO = f"""\
<!-- Generated from the schema in cluster/schema/; do not edit by hand.
     Regenerate with: {REGENERATE} -->

# Configuration reference

A run is configured by one `TrainConfig`, read from a YAML file and then from
command-line overrides; every key the two leave out keeps the default listed below.
In YAML, keys nest by section:

```yaml
steps: 100
optim:
  lr: 3.0e-4
worker:
  num_workers: 4
  resources: {{node_a: 1}}
```

On the command line, `--set a.b=c` sets one dotted key and may be repeated, e.g.
`cargohold train --config run.yaml --set steps=10 --set optim.lr=3e-4`. The value is read
as YAML, so `--set state_server.bind_host=null` sets None and
`--set worker.resources={{node_a: 1}}` sets a mapping. Overrides apply after the file.

Unknown keys are rejected, as are values of the wrong type or out of range; the error
names the full dotted key (for example `optim.lrr`) and `cargohold train` exits with
status 2. So is a file or a `--set` value nested deeper than the YAML parser reads
(a few hundred levels; a configuration nests a few), naming the file or the override.
"""

_TUNING_INTRO = """\
Defaults chosen by measurement; change one only with a benchmark that shows it helps on
your machine (docs/benchmarks.md gives the commands). They are set under this one section
by the path of the section that uses them, e.g.:

```yaml
tuning:
  state_server:
    tier:
      buffer_count: 4
```

(`--set tuning.state_server.tier.buffer_count=4` on the command line). A tuning
value written in its own section (`state_server.tier.buffer_count`) is refused, naming
where it belongs; so is anything else under `tuning`."""


def render_reference() -> str:
    """The Markdown reference for every section of :class:`TrainConfig`, in field order."""
    parts = [_INTRO]
    sections = _sections(TrainConfig, "")
    for title, prefix, cls in sections:
        if any(not is_tuning(f) for f in dataclasses.fields(cls)):
            parts.append(_render_section(title, prefix, cls))
    parts.append(_render_tuning(sections))
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cargohold.cluster.schema.reference",
        description="Print the configuration reference (Markdown) generated from the schema.",
    )
    parser.add_argument(
        "--check", metavar="PATH", help="compare PATH with the generated reference; exit 1 if it differs"
    )
    args = parser.parse_args(argv)
    text = render_reference()
    if args.check is None:
        sys.stdout.write(text)
        return 0
    path = Path(args.check)
    try:
        current = path.read_text(encoding="utf-8")
    except OSError as error:
        print(f"{path}: cannot read ({error.strerror}); regenerate it with `{REGENERATE}`", file=sys.stderr)
        return 1
    if current != text:
        print(f"{path} is out of date with the config schema; regenerate it with `{REGENERATE}`", file=sys.stderr)
        return 1
    return 0


def _sections(cls: type, prefix: str) -> list[tuple[str, str, type]]:
    """(title, key prefix, class) for ``cls`` and, depth first in field order, every
    dataclass-typed field below it."""
    title = f"`{prefix.rstrip('.')}`" if prefix else "Top level"
    found = [(title, prefix, cls)]
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.init and _is_section(hints[f.name]):
            found.extend(_sections(hints[f.name], f"{prefix}{f.name}."))
        elif f.init and _is_list_of_sections(hints[f.name]):  # its items' keys: `optim.param_groups[].name`
            found.extend(_sections(typing.get_args(hints[f.name])[0], f"{prefix}{f.name}[]."))
    return found


def _is_section(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def _is_list_of_sections(hint: Any) -> bool:
    return typing.get_origin(hint) is list and _is_section(typing.get_args(hint)[0])


def _render_section(title: str, prefix: str, cls: type) -> str:
    class_doc, field_docs = class_docstrings(cls)
    lines = [f"## {title}", ""]
    lines.append(f"Class `{cls.__module__}.{cls.__qualname__}`." + (f" {_one_line(class_doc)}" if class_doc else ""))
    lines += ["", "| Key | Type | Default | Description |", "| --- | --- | --- | --- |"]
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.init and not _is_section(hints[f.name]) and not is_tuning(f):
            lines.append(_row(prefix, f, hints[f.name], field_docs))
    lines.append("")
    return "\n".join(lines)


def _render_tuning(sections: list[tuple[str, str, type]]) -> str:
    """One table of every tuning value, under the path a user sets it by."""
    lines = [f"## `{TUNING_SECTION}`", "", _TUNING_INTRO, ""]
    lines += ["| Key | Type | Default | Description |", "| --- | --- | --- | --- |"]
    for _, prefix, cls in sections:
        _, field_docs = class_docstrings(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if is_tuning(f):
                lines.append(_row(f"{TUNING_SECTION}.{prefix}", f, hints[f.name], field_docs))
    lines.append("")
    return "\n".join(lines)


def _row(prefix: str, f: dataclasses.Field, hint: Any, field_docs: dict[str, str]) -> str:
    cells = (
        f"`{prefix}{f.name}`",
        f"`{type_name(hint)}`",
        f"`{_format_default(_default(f))}`",
        _one_line(field_docs.get(f.name, "")),
    )
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def type_name(hint: Any) -> str:
    """A readable type: ``int``, ``str | None``, ``one of "constant", "cosine"``, ``dict[str, float]``."""
    if hint is type(None):
        return "None"
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        names = [type_name(o) for o in options if o is not type(None)]
        if type(None) in options:
            names.append("None")
        return " | ".join(names)
    if origin is Literal:
        return "one of " + ", ".join(json.dumps(v) for v in typing.get_args(hint))
    if origin is not None:
        return f"{origin.__name__}[{', '.join(type_name(a) for a in typing.get_args(hint))}]"
    if isinstance(hint, type):
        return hint.__name__
    return str(hint)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _format_default(value: Any) -> str:
    """The default as one would write it in YAML."""
    if value is dataclasses.MISSING:
        return "(required)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(value)


@functools.cache
def class_docstrings(cls: type) -> tuple[str, dict[str, str]]:
    """The class docstring and each field's attribute docstring, read from the source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    fields: dict[str, str] = {}
    for statement, following in zip(node.body, node.body[1:]):
        if (
            isinstance(statement, ast.AnnAssign)
            and isinstance(statement.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            fields[statement.target.id] = inspect.cleandoc(following.value.value)
    return ast.get_docstring(node) or "", fields


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _cell(text: str) -> str:
    # A pipe ends a table cell even inside a code span unless escaped (GitHub Markdown).
    return text.replace("|", "\\|")


if __name__ == "__main__":
    sys.exit(main())
