"""One vocabulary (docs/architecture.md, "Words"): what a state server owns is a segment,
and the state server counts updates. "Shard" stays FSDP2's word and the older word of the
wire and the file formats; it does not come back for a segment in a name (class,
function, method, argument, assigned variable or attribute) or in a message (a string
constant or an f-string's text: errors, logs, metric help texts).

What ``fully_shard`` wraps is a unit: "group" does not come back for it (its retired
names, the layout's values and the modules about units alone, below); "group" stays the
word of torch's param groups, of Ray's placement groups, of process groups, of the
planner's node groups and of a regex match's groups.

Where a parameter's padded chunk lies in each worker's range is its chunk place
(``layout.ChunkPlace``): "slot" does not come back for it (its retired names, names bound
to a layout's parameters, the modules about chunk places alone, below); "slot" stays the
word of the exchange slot, a worker's host buffer of one unit's gradients and weights
(``tuning.worker.exchange_slots``, ``services/worker/state_port.py``).

Docstrings and comments are left to review: there FSDP2's "local shards" and a segment
are told apart by their sense, which no pattern here can read."""

from __future__ import annotations

import ast
import inspect
import re
from collections.abc import Callable
from pathlib import Path

from cargohold.services.checkpoint.manifest import LAYOUT_KIND, LayoutRecord
from cargohold.services.core import layout as layout_module

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


# --- unit, not group, for what fully_shard wraps ---------------------------------------------
UNIT_MODULES = (
    "services/core/layout.py",
    "services/checkpoint/reshard.py",
    "services/worker/sharding.py",
    "services/worker/step.py",
    "services/worker/weight_window.py",
    "services/worker/window_schedule.py",
)
"""Modules about units alone: no param group, placement group or node group is theirs, so
"group" in a name or message there can only be the unit's old word."""
KEPT_GROUP = re.compile(
    r"fsdp_param_group"  # FSDP2's FSDPParamGroup (its state of one unit): torch's name
    r"|process_group|ProcessGroup"  # torch.distributed's
)
RETIRED_UNIT_NAMES = frozenset(
    {
        "Group",  # now layout.UnitRange
        "group_params",  # Layout.unit_params
        "largest_group",  # Layout.largest_unit
        "group_sizes",  # build_layout's unit_sizes, LayoutRecord.unit_sizes (the JSON key stays)
        "group_names",  # build_layout's unit_names, LayoutRecord.unit_names (the JSON key stays)
        "_by_group",  # ShardedStep._by_unit
        "_group_storages",  # WeightWindow._unit_storages
        "_padded_group_sizes",  # reshard._padded_unit_sizes
    }
)
"""Names that said group for the unit: declared, read as an attribute or passed as a
keyword, anywhere."""
_GROUP = re.compile("group", re.IGNORECASE)


def _has_group(text: str) -> bool:
    return bool(_GROUP.search(KEPT_GROUP.sub("", text)))


def _layout_units(node: ast.expr) -> bool:
    """Whether ``node`` is a layout's units: ``<...>layout.units``, a slice or an item of
    them, or enumerate/zip/reversed over them."""
    if isinstance(node, ast.Subscript):
        return _layout_units(node.value)
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("enumerate", "zip", "reversed")
    ):
        return any(_layout_units(arg) for arg in node.args)
    return isinstance(node, ast.Attribute) and node.attr == "units" and ast.unparse(node.value).endswith("layout")


def _bound_to(node: ast.AST, of_layout: Callable[[ast.expr], bool]) -> list[str]:
    """The names a loop, a comprehension or an assignment binds to what ``of_layout`` tells
    apart (a layout's units, or its chunk places)."""
    if isinstance(node, (ast.For, ast.comprehension)) and of_layout(node.iter):
        targets = [node.target]
    elif isinstance(node, ast.Assign) and of_layout(node.value):
        targets = node.targets
    else:
        return []
    return [n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name)]


def unit_findings(source: str, where: str, *, unit_module: bool = False) -> list[str]:
    """``where:line`` and what each use of "group" for the unit in ``source`` is: a retired
    name; a name bound to a layout's units; a layout's ``groups``; and in a module about
    units alone (``unit_module``), any name or message saying group."""
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        at = f"{where}:{getattr(node, 'lineno', 0)}"
        declared = _names(node)
        found += [f"{at} name {name!r}" for name in declared if name in RETIRED_UNIT_NAMES]
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            if node.attr in RETIRED_UNIT_NAMES:
                found.append(f"{at} attribute {node.attr!r}")
            elif node.attr == "groups" and ast.unparse(node.value).endswith("layout"):
                found.append(f"{at} attribute 'groups' of a layout")
        if isinstance(node, ast.keyword) and node.arg in RETIRED_UNIT_NAMES:
            found.append(f"{at} keyword {node.arg!r}")
        found += [f"{at} unit named {name!r}" for name in _bound_to(node, _layout_units) if _has_group(name)]
        if unit_module:
            found += [f"{at} name {name!r}" for name in declared if name not in RETIRED_UNIT_NAMES and _has_group(name)]
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                if _has_group(node.value):
                    found.append(f"{at} text {node.value!r}")
    return found


def test_names_say_unit_for_what_fully_shard_wraps() -> None:
    found = [
        f
        for path in _sources()
        for f in unit_findings(
            path.read_text(), str(path.relative_to(ROOT)), unit_module=str(path.relative_to(ROOT)) in UNIT_MODULES
        )
    ]
    assert not found, (
        "group is back for a unit (docs/architecture.md, Words: what fully_shard wraps is a unit; "
        "a param group is torch's):\n" + "\n".join(found)
    )


def test_the_unit_modules_exist() -> None:
    assert [m for m in UNIT_MODULES if not (ROOT / m).is_file()] == []


def test_the_layouts_values_say_unit_and_the_file_format_keeps_its_keys() -> None:
    """Each value of the layout, by its fields, methods and properties, and build_layout's
    arguments; the manifest's ``layout`` record says unit in Python and keeps the JSON keys
    ``group_sizes`` and ``group_names``."""
    kinds = (
        layout_module.ChunkPlace,
        layout_module.UnitRange,
        layout_module.Fragment,
        layout_module.Segment,
        layout_module.Layout,
        LayoutRecord,
    )
    assert {kind.__name__: [n for n in dir(kind) if _has_group(n)] for kind in kinds} == {k.__name__: [] for k in kinds}
    assert [p for p in inspect.signature(layout_module.build_layout).parameters if _has_group(p)] == []
    assert [name for name in vars(layout_module) if _has_group(name)] == []
    built = layout_module.build_layout([("w", (4,)), ("b", (4,))], num_workers=1, num_servers=1, unit_sizes=[1, 1])
    assert [unit.name for unit in built.units] == ["unit0", "unit1"]
    record = LayoutRecord(LAYOUT_KIND, 64, 1, 1, unit_sizes=(1, 1), unit_names=("", "b"))
    body = record.to_body()
    assert (body["group_sizes"], body["group_names"]) == ([1, 1], ["", "b"])
    assert LayoutRecord.from_body(body) == record


OLD_UNITS = '''
"""A module about groups: docstrings are not checked."""
class Group:
    index: int
class Layout:
    groups: tuple
    def group_params(self, group: int):
        return self.groups[group]
def build(layout, segments, window):
    by_group = {}
    for group in layout.groups:
        by_group[group.index] = [s for s in segments if s.unit == group.index]
    for index, group in enumerate(layout.units):
        window.write(index, group)
    sizes = [g.stop - g.start for g in layout.units]
    largest = layout.largest_group
    raise LayoutError(f"{len(sizes)} group names for {largest} groups")
def rebuild(record, shapes):
    return build_layout(shapes, group_sizes=record.unit_sizes, group_names=record.unit_names)
'''
KEPT_GROUPS = """
def step(optimizer, placement_group, match, parser, layout, spec):
    for group in optimizer.param_groups:
        group["lr"] = group_lr(lr, group["lr_mult"])
    fragment_groups = spec.fragment_groups()
    dist.all_reduce(total, group=dist.group.WORLD)
    process_group = dist.new_group()
    pid = int(match.group(1))
    options = parser.add_argument_group("training")
    nodes = [NodeGroup(count=1)]
    message = f"{group_name(index)}: a group's parameters share one dtype"
    for unit in layout.units:
        body = {"group_sizes": [unit.stop_param - unit.first_param]}
"""
KEPT_IN_A_UNIT_MODULE = """
def check(unit, layout, process_group: ProcessGroup):
    fsdp_param_group = getattr(unit.module._get_fsdp_state(), "_fsdp_param_group", None)
    divisor = factors(dist.group.WORLD)
    for index, placed in enumerate(layout.units):
        window.write(index, placed)
"""


def test_the_old_unit_names_are_found() -> None:
    found = sorted(f.partition(" ")[2] for f in unit_findings(OLD_UNITS, "old.py", unit_module=True))
    assert found == sorted(
        [
            "name 'Group'",
            "name 'groups'",
            "name 'group_params'",
            "name 'group'",
            "name 'by_group'",
            "name 'group'",
            "name 'group'",
            "attribute 'groups' of a layout",
            "unit named 'group'",
            "attribute 'largest_group'",
            "keyword 'group_sizes'",
            "keyword 'group_names'",
            "text ' group names for '",
            "text ' groups'",
        ]
    )


def test_the_old_unit_names_are_found_outside_the_unit_modules_too() -> None:
    found = sorted(f.partition(" ")[2] for f in unit_findings(OLD_UNITS, "old.py"))
    assert found == sorted(
        [
            "attribute 'groups' of a layout",
            "unit named 'group'",
            "name 'Group'",
            "name 'group_params'",
            "attribute 'largest_group'",
            "keyword 'group_sizes'",
            "keyword 'group_names'",
        ]
    )


def test_param_placement_process_node_and_regex_groups_are_not_findings() -> None:
    assert unit_findings(KEPT_GROUPS, "kept.py") == []
    assert unit_findings(KEPT_IN_A_UNIT_MODULE, "kept.py", unit_module=True) == []


# --- chunk place, not slot, for where a parameter's padded chunk lies -----------------------
PLACE_MODULES = (
    "services/core/layout.py",
    "services/worker/accumulation.py",
    "services/checkpoint/reshard.py",
)
"""Modules about chunk places alone: no exchange slot is theirs, so "slot" in a name or
message there can only be the chunk place's old word."""
RETIRED_PLACE_NAMES = {
    "ParamSlot": (),  # now layout.ChunkPlace
    "slot_numel": ("services/worker/state_port.py",),  # ChunkPlace.padded_numel; there: an exchange slot's size
}
"""Names that said slot for the chunk place, and the modules where the name is the exchange
slot's: declared, imported, read (a name or an attribute) or passed as a keyword."""
_SLOT = re.compile("slot", re.IGNORECASE)


def _has_slot(text: str) -> bool:
    return bool(_SLOT.search(text.replace("__slots__", "")))


def _layout_places(node: ast.expr) -> bool:
    """Whether ``node`` is a layout's chunk places: ``<...>layout.params``, a
    ``unit_params(...)`` call, a slice or an item of them, or enumerate/zip/reversed/sorted
    over them."""
    if isinstance(node, ast.Subscript):
        return _layout_places(node.value)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        return node.func.id in ("enumerate", "zip", "reversed", "sorted") and any(
            _layout_places(arg) for arg in node.args
        )
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return node.func.attr == "unit_params"
    return isinstance(node, ast.Attribute) and node.attr == "params" and ast.unparse(node.value).endswith("layout")


def _used_names(node: ast.AST) -> list[str]:
    """The names ``node`` declares (:func:`_names`), imports, reads or passes as a keyword."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    if isinstance(node, ast.alias):
        return [node.name.rpartition(".")[2]] + ([node.asname] if node.asname else [])
    if isinstance(node, ast.keyword) and node.arg is not None:
        return [node.arg]
    return _names(node)


def place_findings(source: str, where: str, *, place_module: bool = False) -> list[str]:
    """``where:line`` and what each use of "slot" for the chunk place in ``source`` is: a
    retired name (outside the modules where it is the exchange slot's); a name bound to a
    layout's chunk places; and in a module about chunk places alone (``place_module``), any
    name or message saying slot."""
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        at = f"{where}:{node.target.lineno if isinstance(node, ast.comprehension) else getattr(node, 'lineno', 0)}"
        found += [
            f"{at} name {name!r}"
            for name in dict.fromkeys(_used_names(node))
            if name in RETIRED_PLACE_NAMES and where not in RETIRED_PLACE_NAMES[name]
        ]
        found += [f"{at} chunk place named {name!r}" for name in _bound_to(node, _layout_places) if _has_slot(name)]
        if place_module:
            found += [
                f"{at} name {name!r}" for name in _names(node) if name not in RETIRED_PLACE_NAMES and _has_slot(name)
            ]
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                if _has_slot(node.value):
                    found.append(f"{at} text {node.value!r}")
    return found


def test_names_say_chunk_place_for_where_a_padded_chunk_lies() -> None:
    found = [
        f
        for path in _sources()
        for f in place_findings(
            path.read_text(), str(path.relative_to(ROOT)), place_module=str(path.relative_to(ROOT)) in PLACE_MODULES
        )
    ]
    assert not found, (
        "slot is back for a chunk place (docs/architecture.md, Words: where a parameter's padded chunk "
        "lies is its chunk place; a slot is an exchange slot):\n" + "\n".join(found)
    )


def test_the_place_modules_and_the_exchange_slot_modules_exist() -> None:
    kept_in = {m for modules in RETIRED_PLACE_NAMES.values() for m in modules}
    assert [m for m in (*PLACE_MODULES, *kept_in) if not (ROOT / m).is_file()] == []


def test_the_layouts_values_say_place() -> None:
    """No value of the layout, by its fields, methods and properties, and no name of the
    layout module, says slot (``__slots__``, the dataclasses', aside)."""
    kinds = (
        layout_module.ChunkPlace,
        layout_module.UnitRange,
        layout_module.Fragment,
        layout_module.Segment,
        layout_module.Layout,
        LayoutRecord,
    )
    assert {kind.__name__: [n for n in dir(kind) if _has_slot(n)] for kind in kinds} == {k.__name__: [] for k in kinds}
    assert [name for name in vars(layout_module) if _has_slot(name)] == []


OLD_PLACES = '''
"""A module about slots: docstrings are not checked."""
from cargohold.services.core.layout import Layout, ParamSlot
class Layout:
    params: tuple[ParamSlot, ...]
    def slot_of(self, index: int) -> ParamSlot:
        slot = self.params[index]
        return slot
def sizes(layout, worker):
    chunks = [slot.slot_numel for slot in layout.params]
    for index, slot in enumerate(layout.unit_params(0)):
        print(index, slot.local_numel(worker))
    slots = layout.unit_params(1)
    raise LayoutError(f"{len(slots)} slots, {sum(chunks)} elements")
'''
KEPT_SLOTS = """
def exchange(layout, buffers, places, worker: int, exchange_slots: int):
    slot = buffers.acquire()
    for index, place in enumerate(layout.unit_params(0)):
        slot.grads[place.offset : place.offset + place.padded_numel].zero_()
    buffers.release(slot)
    split = Split(exchange_slots=exchange_slots, slots=exchange_slots)
    message = f"{exchange_slots} exchange slot(s)"
"""
KEPT_IN_STATE_PORT = """
def exchange_nbytes(slot_numel: int, grad_size: int, weight_size: int, *, slots: int) -> int:
    return slots * _slot_numel(slot_numel) * (grad_size + weight_size)
"""


def test_the_old_place_names_are_found() -> None:
    found = sorted(f.partition(" ")[2] for f in place_findings(OLD_PLACES, "old.py", place_module=True))
    assert found == sorted(
        [
            "name 'ParamSlot'",  # imported
            "name 'ParamSlot'",  # in an annotation
            "name 'ParamSlot'",  # returned
            "name 'slot_of'",
            "name 'slot'",
            "name 'slot'",
            "name 'slot'",
            "name 'slots'",
            "name 'slot_numel'",
            "chunk place named 'slot'",
            "chunk place named 'slot'",
            "chunk place named 'slots'",
            "text ' slots, '",
        ]
    )


def test_the_old_place_names_are_found_outside_the_place_modules_too() -> None:
    found = sorted(f.partition(" ")[2] for f in place_findings(OLD_PLACES, "old.py"))
    assert found == sorted(
        [
            "name 'ParamSlot'",
            "name 'ParamSlot'",
            "name 'ParamSlot'",
            "name 'slot_numel'",
            "chunk place named 'slot'",
            "chunk place named 'slot'",
            "chunk place named 'slots'",
        ]
    )


def test_exchange_slots_are_not_findings() -> None:
    assert place_findings(KEPT_SLOTS, "kept.py") == []
    assert place_findings(KEPT_IN_STATE_PORT, "services/worker/state_port.py") == []
    assert place_findings(KEPT_IN_STATE_PORT, "services/worker/step.py") == [
        "services/worker/step.py:2 name 'slot_numel'",
        "services/worker/step.py:3 name 'slot_numel'",
    ]
