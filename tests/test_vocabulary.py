"""One vocabulary (docs/architecture.md, "Words"): what a state server owns is a segment,
and the state server counts updates. "Shard" stays FSDP2's word and the older word of the
wire and the file formats; it does not come back for a segment in a name (class,
function, method, argument, assigned variable or attribute) or in a message (a string
constant or an f-string's text: errors, logs, metric help texts).

Docstrings and comments are left to review: there FSDP2's "local shards" and a segment
are told apart by their sense, which no pattern here can read."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("api", "services", "cluster", "benchmarks")

KEPT_IN_NAMES = (
    "fully_shard",  # FSDP2's API
    "reshard",  # FSDP2's reshard_after_forward; services/checkpoint/reshard.py reads a checkpoint under another layout
    "sharded",  # FSDP2's sharded form of the model: ShardedStep, sharded_model
    "sharding",  # services/worker/sharding.py, FSDP2 on a worker
    "shard_units",  # applies fully_shard to each unit
    "RegisterShard",  # the wire's RPC names (proto/): the servicer's handlers are called by them
    "DescribeShard",
    "ShardSpec",  # the wire's message and field names, named in messages about a proto field
    "ShardKey",
    "shard_id",
)
KEPT_IN_TEXT = (
    re.compile(
        r"(?<=-)shard|shard(?=-)"
    ),  # file names: server0-shard000003-part00000.tier, shard-000003.part-00000.bin
    re.compile(r"^shards(?=\[|$)"),  # the checkpoint manifest's JSON key "shards"
    re.compile(r"\bFSDP2\b[^.;]*?\bshards?\b"),  # a clause about FSDP2: its word
    re.compile(r"\b(?:weight|largest) shards\b"),  # a worker's FSDP2 shards of the weights (the plan's text)
    re.compile(r"\bshard index\b"),  # Hugging Face's index of a sharded checkpoint
)
RETIRED_NAMES = frozenset({"StepMismatchError", "IncompleteStepError", "check_step"})
"""Names that said step for the update number (now UpdateMismatchError,
IncompleteUpdateError, check_updates)."""

_SHARD = re.compile("shard", re.IGNORECASE)


def _sources() -> list[Path]:
    found = [path for folder in FOLDERS for path in sorted((ROOT / folder).rglob("*.py"))]
    return [path for path in found if "_pb2" not in path.name]


def _docstrings(tree: ast.AST) -> set[int]:
    """The string statements of every body (module, class and function docstrings, and
    the attribute docstrings under fields)."""
    return {
        id(statement.value)
        for node in ast.walk(tree)
        if isinstance(getattr(node, "body", None), list)
        for statement in node.body  # type: ignore[attr-defined]
        if isinstance(statement, ast.Expr)
        and isinstance(statement.value, ast.Constant)
        and isinstance(statement.value.value, str)
    }


def _names(node: ast.AST) -> list[str]:
    """The names ``node`` declares: a class, function or method, an argument, an
    assigned (or loop, ``with ... as``) variable or attribute."""
    if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        return [node.name]
    if isinstance(node, ast.arg):
        return [node.arg]
    if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
        return [node.id]
    if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
        return [node.attr]
    return []


def _without_kept_names(text: str) -> str:
    for kept in KEPT_IN_NAMES:
        text = re.sub(re.escape(kept), "", text, flags=re.IGNORECASE)
    return text


def _retired_in_name(name: str) -> bool:
    return name in RETIRED_NAMES or bool(_SHARD.search(_without_kept_names(name)))


def _retired_in_text(text: str) -> bool:
    text = _without_kept_names(text)
    for pattern in KEPT_IN_TEXT:
        text = pattern.sub("", text)
    return bool(_SHARD.search(text))


def findings(source: str, where: str) -> list[str]:
    """``where:line`` and what each retired word in ``source``'s names and messages is."""
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        found += [f"{where}:{node.lineno} name {name!r}" for name in _names(node) if _retired_in_name(name)]
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if _retired_in_text(node.value):
                found.append(f"{where}:{node.lineno} text {node.value!r}")
    return found


def test_names_and_messages_say_segment_and_update() -> None:
    found = [f for path in _sources() for f in findings(path.read_text(), str(path.relative_to(ROOT)))]
    assert not found, (
        "a retired word is back (docs/architecture.md, Words: say segment for what a server owns, "
        "update for the update number):\n" + "\n".join(found)
    )


OLD = '''
"""A module about shards: docstrings are not checked."""
class ShardError(Exception):
    pass
class StepMismatchError(Exception):
    pass
class SegmentRegistry:
    def shards(self, run_id):
        for shard in self._shards:
            self.last_shard = shard
    def register_shards(self, n):
        raise ShardError(f"shard {n} of run {self.run_id!r} is already registered")
HELP = "Shard updates applied."
'''
KEPT = """
def build(model, unit, key, owner, reshard_after_forward):
    fully_shard(unit.module, reshard_after_forward=reshard_after_forward)
    model = sharded_model(config)
    segment_id = key.shard_id
    name = f"{owner}-shard{key.segment_id:06d}-part{key.index:05d}.tier"
    path = f"shard-{key.segment_id:06d}.part-{key.index:05d}.bin"
    body = {"shards": []}
    where = f"shards[{index}] (segment {segment_id})"
    error = f"block {name!r} holds no parameters of its own; FSDP2 cannot shard it"
    rows = [("weight shards", size)]
    spec = f"ShardSpec.state_dtype {value} is unknown"

class Servicer:
    def RegisterShard(self, request_iterator, context):
        return self._guard("RegisterShard", context)
"""


def test_the_old_names_and_messages_are_found() -> None:
    found = sorted(f.partition(" ")[2] for f in findings(OLD, "old.py"))
    assert found == sorted(
        [
            "name 'ShardError'",
            "name 'StepMismatchError'",
            "name 'shards'",
            "name 'register_shards'",
            "name 'shard'",
            "name 'last_shard'",
            "text 'shard '",
            "text 'Shard updates applied.'",
        ]
    )


def test_the_kept_forms_are_not_findings() -> None:
    assert findings(KEPT, "kept.py") == []
