"""The manifest on real files: every field typed and checked when a checkpoint is read,
refusals that name the field and the file and lose nothing already saved, checkpoints of
earlier formats, a file per segment, gaps, and the model check."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from checkpoints import flat_layout, random_data, restore, save, save_layout, unit_layout

from cargohold.services.checkpoint import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    CheckpointDir,
    FileRecord,
    Manifest,
    SegmentRecord,
    check_compatible,
    read_flat_range,
)
from cargohold.services.core.errors import CargoholdError, CheckpointError, CorruptCheckpointError
from cargohold.services.core.layout import build_layout
from cargohold.services.segments.segment_registry import SegmentRegistry
from cargohold.services.tiers.storage import TieredStorage

pytestmark = pytest.mark.timeout(120)


def test_a_file_holds_exactly_one_segment(tmp_path: Path) -> None:
    """A partition file holds one segment's range: a manifest that names a file from two
    segments, or lists one no segment names, is refused; a segment put in another segment's file
    is corruption, named."""
    store = CheckpointDir(tmp_path)
    data = random_data(1_000, seed=9)
    path = save(store, 6, data, [600])
    manifest = store.load(path)
    low, high = manifest.segments
    fields = {f: getattr(manifest, f) for f in Manifest.__dataclass_fields__}
    with pytest.raises(
        CheckpointError, match=rf"file {high.file!r} is named by 2 segments; a partition file holds one"
    ):
        Manifest(
            **{
                **fields,
                "segments": (
                    SegmentRecord(0, 0, 256, 6, high.file),
                    SegmentRecord(1, 256, 600, 6, low.file),
                    SegmentRecord(2, 600, 1_000, 6, high.file),
                ),
            }
        )
    with pytest.raises(CheckpointError, match=rf"file {high.file!r} is named by 0 segments"):
        Manifest(**{**fields, "segments": (low,), "total": 600})
    swapped = (SegmentRecord(0, 0, 600, 6, high.file), SegmentRecord(1, 600, 1_000, 6, low.file))
    with pytest.raises(
        CorruptCheckpointError,
        match=rf"{high.file} is corrupt: it holds partition 0 of segment 1 .*"
        r"the manifest puts segment 0 \[0, 600\) of run 'run-test' in it",
    ):
        read_flat_range(path, Manifest(**{**fields, "segments": swapped}), 0, 1_000)


def test_a_checkpoint_of_an_earlier_format_is_refused(tmp_path: Path) -> None:
    """Manifests before version 4 held only a hash of the saving run's config; before
    version 3 they kept the update count and the layout in ``extra`` (version 1 and 2 with
    the worker-major layout, earlier ones with none: the former parameter-ordered flat
    space). They are refused naming the manifest, never deleted."""
    store = CheckpointDir(tmp_path)
    layout = unit_layout(2, 1)
    path = save_layout(store, 3, layout, random_data(layout.total, 3))
    body = json.loads((path / MANIFEST_NAME).read_text())
    del body["config"]
    body["config_hash"] = "0123456789abcdef"
    for version in (3, 2, 1):
        if version == 2:
            layout_body = body.pop("layout")
            body["extra"] = {"updates": body.pop("updates"), "layout": layout_body.pop("kind"), **layout_body}
        body["format_version"] = version
        (path / MANIFEST_NAME).write_text(json.dumps(body))
        with pytest.raises(
            CheckpointError,
            match=rf"{path / MANIFEST_NAME}: format version {version} is no longer "
            rf"readable: this build reads version {FORMAT_VERSION} only",
        ):
            restore(path, layout, 0, SegmentRegistry(TieredStorage(None)))
        assert store.latest() is None
        with pytest.raises(CheckpointError, match="no longer readable"):
            store.resolve(str(path))
    assert len(list(path.iterdir())) == 1 + len(body["files"]), "the refused checkpoint's files are all there"


def test_a_gap_in_the_segments_is_named(tmp_path: Path) -> None:
    store = CheckpointDir(tmp_path)
    data = random_data(1_000, seed=2)
    path = save(store, 1, data, [300, 700])
    manifest = store.load(path)
    dropped = next(s for s in manifest.segments if s.start == 300)
    holey = Manifest(
        **{
            **{f: getattr(manifest, f) for f in Manifest.__dataclass_fields__},
            "segments": tuple(s for s in manifest.segments if s is not dropped),
            "files": tuple(f for f in manifest.files if f.name != dropped.file),
        }
    )
    with pytest.raises(CheckpointError, match=r"no file for flat elements \[300, 700\)"):
        read_flat_range(path, holey, 250, 800)
    assert torch.equal(read_flat_range(path, holey, 700, 1_000)["exp_avg"], data["exp_avg"][700:])
    directory = store.begin(2)
    for record in manifest.files:
        shutil.copy(path / record.name, directory / record.name)
    with pytest.raises(CheckpointError, match=r"\(300, 700\)"):
        store.commit(
            2,
            Manifest(
                **{
                    **{f: getattr(holey, f) for f in Manifest.__dataclass_fields__},
                    "step": 2,
                    "segments": tuple(SegmentRecord(s.segment_id, s.start, s.stop, 2, s.file) for s in holey.segments),
                }
            ),
        )
    assert not directory.exists() and store.latest() == path


BAD_FIELDS = {
    "updates above step": ("updates", 3, r"updates must be an integer from 0 to step \(2\).*got 3"),
    "negative updates": ("updates", -1, r"updates must be an integer from 0 to step \(2\).*got -1"),
    "updates not an integer": ("updates", "2", r"updates must be an integer .*got '2'"),
    "align not an integer": ("layout.align", 1.5, r"layout\.align must be an integer >= 1, got 1\.5"),
    "align zero": ("layout.align", 0, r"layout\.align must be an integer >= 1, got 0"),
    "layout kind": (
        "layout.kind",
        "worker-major-v9",
        r"layout\.kind is 'worker-major-v9'; this build reads "
        r"'worker-major-v1'",
    ),
    "layout workers": ("layout.num_workers", True, r"layout\.num_workers must be an integer >= 1, got True"),
    "layout groups": ("layout.group_sizes", "1", r"layout\.group_sizes must be a list, got str"),
    "layout names": ("layout.group_names", [1], r"layout\.group_names must be a list of strings, got \[1\]"),
    "layout missing": ("layout", None, r"missing \['layout'\]"),
    "layout not an object": ("layout", [], r"layout must be an object with fields \['align', 'group_names', "),
    "layout field missing": ("layout.align", None, r"layout must be an object with fields \['align', "),
    "config not an object": ("config", [], r"config must be an object, got \[\]"),
    "config too deep": ("config.a", [[[[[[[[1]]]]]]]], r"config\.a(\[0\]){7} is nested deeper than 8 levels"),
    "config not finite": ("config.optim", {"lr": 1e400}, r"not a valid manifest \(JSON: Infinity is not a JSON number"),
    "step not a number": ("step", float("nan"), r"not a valid manifest \(JSON: NaN is not a JSON number"),
    "segment negative": ("shards.0.segment_id", -1, r"shards\[0\]\.segment_id must be an integer >= 0, got -1"),
    "segment start a string": ("shards.1.start", "500", r"shards\[1\]\.start must be an integer >= 0, got '500'"),
    "segment empty": ("shards.1.stop", 500, r"shards\[1\]\.stop must be above start, got \[500, 500\)"),
    "segment file": ("shards.0.file", 3, r"shards\[0\]\.file must be a string, got 3"),
    "file size": ("files.0.nbytes", 1.5, r"files\[0\]\.nbytes must be an integer >= 0, got 1\.5"),
    "file crc": ("files.1.crc32c", 1 << 32, r"files\[1\]\.crc32c must be a 32-bit unsigned integer, got 4294967296"),
    "file name": ("files.0.name", "../x", r"files\[0\]\.name '\.\./x' is not a valid payload file name"),
    "file missing field": ("files.0.crc32c", None, r"files\[0\] must be an object with fields \['crc32c', "),
    "signature name": ("model_signature.0.0", 7, r"model_signature\[0\] name must be a string, got 7"),
    "signature dims": (
        "model_signature.0.1",
        ["3"],
        r"model_signature\[0\] \('flat'\) shape must be a list of integers >= 0, got \['3'\]",
    ),
}


@pytest.mark.parametrize("damage", ["garbage", "deep", "version", "missing field", "overlap", *BAD_FIELDS])
def test_a_bad_manifest_is_refused_naming_it(tmp_path: Path, damage: str) -> None:
    """Refused naming the manifest and the field, and nothing already saved is lost: the
    previous checkpoint is the latest, and the refused one's files stay as they were."""
    store = CheckpointDir(tmp_path)
    older = save(store, 1, random_data(1_000, 1), [500])
    newer = save(store, 2, random_data(1_000, 2), [500])
    source = newer / MANIFEST_NAME
    body = json.loads(source.read_text())
    saved = {p.name: p.read_bytes() for p in newer.iterdir() if p.name != MANIFEST_NAME}
    if damage == "garbage":
        text, reason = '{"format_version": 1, "step": 2,', "not a valid manifest"
    elif damage == "deep":
        text, reason = "[" * 100_000 + "]" * 100_000, r"not a valid manifest \(JSON nested too deeply\)"
    elif damage in BAD_FIELDS:
        field, value, reason = BAD_FIELDS[damage]
        *parents, name = (int(part) if part.isdigit() else part for part in field.split("."))
        where = body
        for parent in parents:
            where = where[parent]
        if value is None:
            del where[name]
        else:
            where[name] = value
        text = json.dumps(body)
    else:
        if damage == "version":
            body["format_version"] = FORMAT_VERSION + 1
            reason = f"format version {FORMAT_VERSION + 1}; this build reads version {FORMAT_VERSION}"
        elif damage == "missing field":
            del body["config"]
            reason = r"missing \['config'\]"
        else:
            body["shards"][1]["start"], reason = 400, "overlap"
        text = json.dumps(body)
    source.write_text(text)
    with pytest.raises(CheckpointError, match=str(source)) as info:
        store.load(newer)
    assert re.search(reason, str(info.value)), str(info.value)
    assert store.latest() == older
    with pytest.raises(CheckpointError, match=MANIFEST_NAME):
        store.resolve(str(newer))
    assert {p.name: p.read_bytes() for p in newer.iterdir() if p.name != MANIFEST_NAME} == saved
    assert torch.equal(read_flat_range(older, store.load(older), 0, 1_000)["master"], random_data(1_000, 1)["master"])


# ------------------------------------------------------------------------- compatibility


def test_check_compatible_matches_parameters_by_name(tmp_path: Path) -> None:
    shapes = [("emb", (100,)), ("w1", (33, 7)), ("w2", (500,))]
    layout = build_layout(shapes, num_workers=2, num_servers=2)
    path = save_layout(CheckpointDir(tmp_path), 1, layout, random_data(layout.total, 0))
    manifest = CheckpointDir(tmp_path).load(path)
    check_compatible(manifest, model_signature=shapes, align=64)
    check_compatible(manifest, model_signature=shapes[::-1], align=64)  # grouped otherwise: fine
    cases = [
        (
            [("emb", (100,)), ("w1", (7, 33)), ("w2", (500,))],
            r"parameter 'w1' has shape \(33, 7\) in the "
            r"checkpoint but \(7, 33\) in this model",
        ),
        ([("emb", (100,)), ("w1b", (33, 7)), ("w2", (500,))], "only the checkpoint has parameter 'w1' "),
        (
            shapes[:2],
            r"only the checkpoint has parameter 'w2' of shape \(500,\) \(3 parameters in the "
            r"checkpoint, 2 in this model\)",
        ),
        ([*shapes, ("head", (4,))], "only this model has parameter 'head'"),
    ]
    for signature, named in cases:
        with pytest.raises(CheckpointError, match=f"checkpoint is of another model: {named}"):
            check_compatible(manifest, model_signature=signature, align=64)
    with pytest.raises(CheckpointError, match="this model lists parameter 'w1' twice"):
        check_compatible(manifest, model_signature=[*shapes, ("w1", (33, 7))], align=64)
    with pytest.raises(CheckpointError, match="saved with align 64, this run uses 128"):
        check_compatible(manifest, model_signature=shapes, align=128)


def test_errors_are_cargohold_errors() -> None:
    assert issubclass(CorruptCheckpointError, CheckpointError)
    assert issubclass(CheckpointError, CargoholdError)
    with pytest.raises(CheckpointError, match="covers no segment|not listed"):
        Manifest(
            step=1,
            updates=1,
            run_id="r",
            config={},
            model_signature=(),
            layout=flat_layout(10),
            total=10,
            segments=(SegmentRecord(0, 0, 10, 1, "a.bin"),),
            files=(FileRecord("b.bin", 0, 0),),
        )
