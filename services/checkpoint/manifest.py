"""The manifest of a checkpoint: its schema, JSON form and validation.

The manifest is written last into a checkpoint's directory (:mod:`.directory`) and holds
everything needed to find, verify and place the payload, and to resume from it: the data
step and the update count, the run id, the saving run's config, the model signature, the layout
that saved the flat space, its padded length, the segment records (which flat range each
payload file holds) and the size and header CRC-32C of every payload file. Every field
is typed and validated on construction, so a manifest read from disk is refused, naming
the field and the file, before anything of it is used.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from cargohold.services.core.durable import TEMP_SUFFIX
from cargohold.services.core.errors import CheckpointError
from cargohold.services.core.update_call import is_power_of_two

FORMAT_VERSION = 4
"""Of the manifest. Version 4 records the saving run's whole configuration (``config``)
where version 3 had only its hash, so that a resume can name the keys that differ.
Version 3 replaced the untyped ``extra`` object by the typed fields ``updates`` and
``layout``, and made every payload file a partition file (versions 1 and 2 also had files
in other formats, ``files[].format``). Manifests of earlier versions are refused."""
MANIFEST_NAME = "manifest.json"
CONFIG_DEPTH = 8
"""Deepest nesting of objects and lists ``config`` may hold (the schema's is 3)."""
_Record = TypeVar("_Record", "FileRecord", "SegmentRecord", "LossScaleRecord")
JSON_KEYS = {"segments": "shards"}
"""The manifest's fields whose JSON key is another word: the file format keeps "shards"
for the segment records."""
LAYOUT_JSON_KEYS = {"unit_sizes": "group_sizes", "unit_names": "group_names"}
"""The same for the ``layout`` record: the file format keeps "group" for the units."""
LAYOUT_KIND = "worker-major-v1"
"""``layout.kind`` of a checkpoint whose flat space is worker-major
(:mod:`cargohold.services.core.layout`)."""


@dataclass(frozen=True, slots=True)
class FileRecord:
    """A payload file (a partition file, :mod:`.payload`) as the manifest knows it: its
    name in the checkpoint directory, its size and its header's CRC-32C."""

    name: str
    nbytes: int
    crc32c: int
    """The CRC-32C the file's header stores for itself; it covers the file's identity,
    update count and the checksums of its arrays."""

    def __post_init__(self) -> None:
        _check_name(self.name)
        if not is_int(self.nbytes) or self.nbytes < 0:
            raise CheckpointError(f"nbytes must be an integer >= 0, got {self.nbytes!r}")
        if not is_int(self.crc32c) or not 0 <= self.crc32c < 1 << 32:
            raise CheckpointError(f"crc32c must be a 32-bit unsigned integer, got {self.crc32c!r}")


@dataclass(frozen=True, slots=True)
class SegmentRecord:
    """The flat range ``[start, stop)`` of the model buffer that ``file`` holds."""

    segment_id: int
    start: int
    stop: int
    step: int
    """The checkpoint's data step (the manifest's ``step``)."""
    file: str

    def __post_init__(self) -> None:
        for name in ("segment_id", "start", "stop", "step"):
            value = getattr(self, name)
            if not is_int(value) or value < 0:
                raise CheckpointError(f"{name} must be an integer >= 0, got {value!r}")
        if self.stop <= self.start:
            raise CheckpointError(f"stop must be above start, got [{self.start}, {self.stop})")
        if not isinstance(self.file, str):
            raise CheckpointError(f"file must be a string, got {self.file!r}")


@dataclass(frozen=True, slots=True)
class LayoutRecord:
    """What placed the parameters in the saved flat space, besides the model signature:
    :func:`cargohold.services.checkpoint.reshard.saved_layout` rebuilds the layout from it.
    Construction checks the types; whether the numbers rebuild a layout of the manifest's
    ``total`` is checked when they are used."""

    kind: str
    """:data:`LAYOUT_KIND`."""
    align: int
    """Elements every chunk place starts at a multiple of (a checkpoint restores only onto the
    same alignment, :func:`.compat.check_compatible`)."""
    num_workers: int
    num_servers: int
    unit_sizes: tuple[int, ...]
    """Parameters per unit (FSDP2's), in layout order; the JSON's ``group_sizes``."""
    unit_names: tuple[str, ...]
    """The units' names; the JSON's ``group_names``."""

    def __post_init__(self) -> None:
        if self.kind != LAYOUT_KIND:
            raise CheckpointError(f"layout.kind is {self.kind!r}; this build reads {LAYOUT_KIND!r}")
        for name in ("align", "num_workers", "num_servers"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise CheckpointError(f"layout.{name} must be an integer >= 1, got {value!r}")
        if not (isinstance(self.unit_sizes, tuple) and all(is_int(n) and n >= 0 for n in self.unit_sizes)):
            raise CheckpointError(f"layout.group_sizes must be a list of integers >= 0, got {_shown(self.unit_sizes)}")
        if not (isinstance(self.unit_names, tuple) and all(isinstance(n, str) for n in self.unit_names)):
            raise CheckpointError(f"layout.group_names must be a list of strings, got {_shown(self.unit_names)}")

    def to_body(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "align": self.align,
            "num_workers": self.num_workers,
            "num_servers": self.num_servers,
            "group_sizes": list(self.unit_sizes),
            "group_names": list(self.unit_names),
        }

    @classmethod
    def from_body(cls, body: object) -> LayoutRecord:
        entry = _record(body, cls, "layout", LAYOUT_JSON_KEYS)
        fields = {name: entry[LAYOUT_JSON_KEYS.get(name, name)] for name in cls.__dataclass_fields__}
        return cls(
            **{
                **fields,
                "unit_sizes": tuple(_list(entry["group_sizes"], "layout.group_sizes")),
                "unit_names": tuple(_list(entry["group_names"], "layout.group_names")),
            }
        )


@dataclass(frozen=True, slots=True)
class LossScaleRecord:
    """The dynamic loss scale of an fp16 run at the checkpoint
    (:class:`~cargohold.services.core.loss_scale.LossScaleState`), so that a resume goes on with
    the same scale and the same count towards its next growth."""

    scale: float
    growth_tracker: int

    def __post_init__(self) -> None:
        if isinstance(self.scale, bool) or not isinstance(self.scale, (int, float)) or not is_power_of_two(self.scale):
            raise CheckpointError(f"loss_scale.scale must be a power of two, got {self.scale!r}")
        if not is_int(self.growth_tracker) or self.growth_tracker < 0:
            raise CheckpointError(f"loss_scale.growth_tracker must be an integer >= 0, got {self.growth_tracker!r}")


@dataclass(frozen=True, slots=True)
class Manifest:
    """Everything needed to find, verify and place a checkpoint's payload and to resume.

    Construction validates the fields (types, ranges, no overlapping segments, every
    segment at ``step``, every file listed once and holding exactly one segment) and raises
    :class:`CheckpointError` naming the field.
    """

    step: int
    """The data step: batches consumed; training resumes with step ``step + 1``."""
    updates: int
    """Optimizer updates applied: ``step`` less the steps skipped for non-finite
    gradients. Every payload file holds the state after this many updates."""
    run_id: str
    config: dict[str, Any]
    """The configuration of the run that saved it, as plain data
    (:func:`cargohold.cluster.schema.io.to_dict`): a resume compares it with its own
    (:mod:`cargohold.cluster.resume`). Checked here only as JSON data."""
    model_signature: tuple[tuple[str, tuple[int, ...]], ...]
    """Parameter names and shapes, in layout order."""
    layout: LayoutRecord
    total: int
    """Padded length of the flat buffer the checkpoint was saved from."""
    segments: tuple[SegmentRecord, ...]
    """The JSON's ``shards`` (the file format keeps its older word)."""
    files: tuple[FileRecord, ...]
    loss_scale: LossScaleRecord | None = None
    """fp16 runs only; the JSON has the field only then, so other manifests are as before."""

    def __post_init__(self) -> None:
        _validate_manifest(self)

    def to_json(self) -> str:
        body = {
            "format_version": FORMAT_VERSION,
            "step": self.step,
            "updates": self.updates,
            "run_id": self.run_id,
            "config": self.config,
            "model_signature": [[name, list(shape)] for name, shape in self.model_signature],
            "layout": self.layout.to_body(),
            "total": self.total,
            "shards": [
                {"segment_id": s.segment_id, "start": s.start, "stop": s.stop, "step": s.step, "file": s.file}
                for s in self.segments
            ],
            "files": [{"name": f.name, "nbytes": f.nbytes, "crc32c": f.crc32c} for f in self.files],
        }
        if self.loss_scale is not None:
            body["loss_scale"] = {"scale": self.loss_scale.scale, "growth_tracker": self.loss_scale.growth_tracker}
        return json.dumps(body, indent=1, allow_nan=False) + "\n"

    @classmethod
    def from_json(cls, text: str, *, source: str) -> Manifest:
        """Parse and validate; every error names ``source`` (the manifest's path)."""
        try:
            body = json.loads(text, parse_constant=_refuse_constant)
        except ValueError as error:
            raise CheckpointError(f"{source}: not a valid manifest (JSON: {error})") from error
        except RecursionError as error:
            raise CheckpointError(f"{source}: not a valid manifest (JSON nested too deeply)") from error
        try:
            return cls._from_body(body)
        except CheckpointError as error:
            raise CheckpointError(f"{source}: {error}") from error

    @classmethod
    def _from_body(cls, body: object) -> Manifest:
        if not isinstance(body, dict):
            raise CheckpointError(f"the manifest is a JSON {type(body).__name__}, not an object")
        version = body.get("format_version")
        if isinstance(version, int) and is_int(version) and 1 <= version < FORMAT_VERSION:
            raise CheckpointError(
                f"format version {version} is no longer readable: this build reads version {FORMAT_VERSION} "
                "only (start the run afresh, or finish it with the cargohold version that wrote it)"
            )
        if version != FORMAT_VERSION or not is_int(version):
            raise CheckpointError(f"format version {version!r}; this build reads version {FORMAT_VERSION}")
        fields = {JSON_KEYS.get(f, f) for f in cls.__dataclass_fields__}
        keys = {"format_version", *fields} - ({"loss_scale"} - set(body))
        if set(body) != keys:
            missing, unknown = sorted(keys - set(body)), sorted(set(body) - keys)
            raise CheckpointError(f"manifest fields missing {missing}, unknown {unknown}")
        signature = _list(body["model_signature"], "model_signature")
        segments = _list(body["shards"], "shards")
        files = _list(body["files"], "files")
        return cls(
            step=body["step"],
            updates=body["updates"],
            run_id=body["run_id"],
            config=body["config"],
            model_signature=tuple(
                _signature_entry(entry, f"model_signature[{i}]") for i, entry in enumerate(signature)
            ),
            layout=LayoutRecord.from_body(body["layout"]),
            total=body["total"],
            segments=tuple(_parsed(SegmentRecord, entry, f"shards[{i}]") for i, entry in enumerate(segments)),
            files=tuple(_parsed(FileRecord, entry, f"files[{i}]") for i, entry in enumerate(files)),
            loss_scale=_parsed(LossScaleRecord, body["loss_scale"], "loss_scale") if "loss_scale" in body else None,
        )


def _shown(value: object) -> str:
    """``value`` as the JSON it came from would show it (tuples are lists there)."""
    return repr(list(value)) if isinstance(value, tuple) else repr(value)


def _list(value: object, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise CheckpointError(f"{what} must be a list, got {type(value).__name__}")
    return value


def _refuse_constant(name: str) -> object:
    """JSON has no NaN or Infinity; Python's parser would read them as floats."""
    raise ValueError(f"{name} is not a JSON number")


def _signature_entry(entry: object, what: str) -> tuple[str, tuple[int, ...]]:
    if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], list)):
        raise CheckpointError(f"{what} must be [name, [dims]], got {entry!r}")
    return entry[0], tuple(entry[1])


def _parsed(kind: type[_Record], entry: object, what: str) -> _Record:
    """A record from its JSON object; an error names the field as ``what.field``."""
    try:
        return kind(**_record(entry, kind, what))
    except CheckpointError as error:
        if str(error).startswith(what):
            raise
        raise CheckpointError(f"{what}.{error}") from None


def _record(entry: object, kind: type, what: str, keys: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``entry``, refused unless a JSON object with ``kind``'s fields as its keys (``keys``:
    the fields whose JSON key is another word)."""
    names = {(keys or {}).get(name, name) for name in kind.__dataclass_fields__}  # type: ignore[attr-defined]
    if not isinstance(entry, dict) or set(entry) != names:
        raise CheckpointError(f"{what} must be an object with fields {sorted(names)}, got {entry!r}")
    return entry


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_name(name: object) -> None:
    """A payload file name: one plain path component, not one the store itself uses."""
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..", MANIFEST_NAME)
        or "/" in name
        or "\\" in name
        or "\0" in name
        or name.endswith(TEMP_SUFFIX)
    ):
        raise CheckpointError(
            f"name {name!r} is not a valid payload file name (one path component, not "
            f"{MANIFEST_NAME!r}, not ending in {TEMP_SUFFIX!r})"
        )


def _validate_manifest(m: Manifest) -> None:
    for name in ("step", "total"):
        value = getattr(m, name)
        if not is_int(value) or value < 0:
            raise CheckpointError(f"{name} must be an integer >= 0, got {value!r}")
    if m.total < 1:
        raise CheckpointError(f"total must be >= 1, got {m.total}")
    if not is_int(m.updates) or not 0 <= m.updates <= m.step:
        raise CheckpointError(
            f"updates must be an integer from 0 to step ({m.step}), the optimizer updates of those data steps; "
            f"got {m.updates!r}"
        )
    if not isinstance(m.run_id, str):
        raise CheckpointError(f"run_id must be a string, got {m.run_id!r}")
    if not isinstance(m.config, dict):
        raise CheckpointError(f"config must be an object, got {_shown(m.config)}")
    _check_json(m.config, "config", 0)
    if not isinstance(m.model_signature, tuple):
        raise CheckpointError("model_signature must be a tuple of (name, shape)")
    for index, entry in enumerate(m.model_signature):
        where = f"model_signature[{index}]"
        if not (isinstance(entry, tuple) and len(entry) == 2):
            raise CheckpointError(f"{where} must be (name, shape), got {entry!r}")
        name, shape = entry
        if not isinstance(name, str):
            raise CheckpointError(f"{where} name must be a string, got {name!r}")
        if not (isinstance(shape, tuple) and all(is_int(d) and d >= 0 for d in shape)):
            raise CheckpointError(f"{where} ({name!r}) shape must be a list of integers >= 0, got {_shown(shape)}")
    if not isinstance(m.layout, LayoutRecord):
        raise CheckpointError(f"layout must be a LayoutRecord, got {type(m.layout).__name__}")

    if not isinstance(m.files, tuple) or not all(isinstance(f, FileRecord) for f in m.files):
        raise CheckpointError("files must be a tuple of FileRecord")
    names: set[str] = set()
    for index, record in enumerate(m.files):
        if record.name in names:
            raise CheckpointError(f"files[{index}]: file {record.name!r} is listed twice")
        names.add(record.name)

    if not isinstance(m.segments, tuple) or not all(isinstance(s, SegmentRecord) for s in m.segments):
        raise CheckpointError("segments must be a tuple of SegmentRecord")
    for index, segment in enumerate(m.segments):
        where = f"shards[{index}] (segment {segment.segment_id})"
        if segment.stop > m.total:
            raise CheckpointError(f"{where}: range [{segment.start}, {segment.stop}) leaves [0, {m.total})")
        if segment.step != m.step:
            raise CheckpointError(f"{where} is at step {segment.step}, the checkpoint at step {m.step}")
        if segment.file not in names:
            raise CheckpointError(f"{where}: its file {segment.file!r} is not listed in files")
    holders = Counter(segment.file for segment in m.segments)
    for record in m.files:
        if holders[record.name] != 1:
            raise CheckpointError(
                f"file {record.name!r} is named by {holders[record.name]} segments; a partition file holds one"
            )
    ordered = sorted(m.segments, key=lambda s: s.start)
    for left, right in zip(ordered, ordered[1:]):
        if right.start < left.stop:
            raise CheckpointError(
                f"segments {left.segment_id} [{left.start}, {left.stop}) and {right.segment_id} "
                f"[{right.start}, {right.stop}) overlap"
            )


def _check_json(value: object, where: str, depth: int) -> None:
    """``value`` is JSON data: objects with string keys, lists, strings, finite numbers,
    booleans and null, nested at most :data:`CONFIG_DEPTH` deep."""
    if isinstance(value, (dict, list)):
        if depth >= CONFIG_DEPTH:
            raise CheckpointError(f"{where} is nested deeper than {CONFIG_DEPTH} levels")
        if isinstance(value, list):
            for index, item in enumerate(value):
                _check_json(item, f"{where}[{index}]", depth + 1)
            return
        for key, item in value.items():
            if not isinstance(key, str):
                raise CheckpointError(f"{where} has the key {key!r}, not a string")
            _check_json(item, f"{where}.{key}", depth + 1)
    elif isinstance(value, float) and not math.isfinite(value):
        raise CheckpointError(f"{where} must be a finite number, got {value!r}")
    elif not (value is None or isinstance(value, (bool, int, float, str))):
        raise CheckpointError(f"{where} must be JSON data, got {type(value).__name__}")


def gaps(segments: Iterable[SegmentRecord], start: int, stop: int) -> list[tuple[int, int]]:
    """The parts of ``[start, stop)`` no segment covers (segments do not overlap)."""
    missing, cursor = [], start
    for segment in sorted(segments, key=lambda s: s.start):
        if segment.stop <= cursor or segment.start >= stop:
            continue
        if segment.start > cursor:
            missing.append((cursor, segment.start))
        cursor = segment.stop
    if cursor < stop:
        missing.append((cursor, stop))
    return missing
