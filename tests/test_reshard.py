"""Restoring onto another layout, pure: the saving layout rebuilt from a manifest, and
each new segment mapped onto the saved flat space — checked element by element against
an independent placement (the saved layout's ``param_runs``, the new segment's
fragments) for random models, groupings, worker and server counts."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from cargohold.services.checkpoint import Manifest
from cargohold.services.checkpoint.manifest import LAYOUT_KIND, FileRecord, SegmentRecord
from cargohold.services.checkpoint.reshard import layout_record, saved_layout, segment_runs
from cargohold.services.core.errors import CheckpointError, LayoutError
from cargohold.services.core.layout import Layout, build_layout, scatter_params

SHAPES = [("wte", (37, 8)), ("ln_f", (8,)), ("blocks.0.w", (13, 8)), ("blocks.0.b", (13,)), ("blocks.1.s", ())]


def _manifest(layout: Layout) -> Manifest:
    """A manifest of a checkpoint ``layout`` saved: a segment record (and a file) per segment."""
    return Manifest(
        step=1,
        updates=1,
        run_id="r",
        config={},
        model_signature=tuple((p.name, p.shape) for p in layout.params),
        layout=layout_record(layout),
        total=layout.total,
        segments=tuple(SegmentRecord(s.segment_id, s.start, s.stop, 1, f"s{s.segment_id}") for s in layout.segments),
        files=tuple(FileRecord(f"s{s.segment_id}", 0, 0) for s in layout.segments),
    )


def _ids(layout: Layout) -> dict[str, torch.Tensor]:
    """Each parameter's elements numbered 1.. over the whole model, by name (0: padding)."""
    ids, base = {}, 1
    for place in sorted(layout.params, key=lambda p: p.name):
        ids[place.name] = torch.arange(base, base + place.numel, dtype=torch.int64).view(place.shape)
        base += place.numel
    return ids


def _check_runs(saved: Layout, new: Layout) -> None:
    ids = _ids(new)
    saved_flat = torch.zeros(saved.total, dtype=torch.int64)
    for index, param_start, flat_start, length in saved.param_runs(0, saved.total):
        values = ids[saved.params[index].name].view(-1)
        saved_flat[flat_start : flat_start + length] = values[param_start : param_start + length]
    new_flat = scatter_params(new, ids, dtype=torch.int64)
    for segment in new.segments:
        expected = torch.zeros(segment.numel, dtype=torch.int64)
        for f in segment.fragments:
            values = ids[new.params[f.param_index].name].view(-1)
            expected[f.segment_start : f.segment_start + f.length] = values[f.param_start : f.param_start + f.length]
        assert torch.equal(expected, new_flat[segment.start : segment.stop])

        runs = segment_runs(saved, new, segment)
        got = torch.zeros(segment.numel, dtype=torch.int64)
        end = 0
        for offset, flat_start, length in runs:
            assert end <= offset and length > 0 and offset + length <= segment.numel, runs
            assert 0 <= flat_start and flat_start + length <= saved.total, runs
            got[offset : offset + length] = saved_flat[flat_start : flat_start + length]
            end = offset + length
        assert torch.equal(got, expected), f"segment {segment.segment_id}"
        assert sum(length for *_, length in runs) == sum(f.length for f in segment.fragments)
        for (o1, s1, n1), (o2, s2, _) in zip(runs, runs[1:]):
            assert not (o1 + n1 == o2 and s1 + n1 == s2), "adjacent runs are merged"


@st.composite
def _models(draw: st.DrawFn) -> list[tuple[str, tuple[int, ...]]]:
    count = draw(st.integers(1, 6))
    shapes = []
    for index in range(count):
        rank = draw(st.integers(0, 3))
        dims = [draw(st.integers(0, 40))] + [draw(st.integers(0, 5)) for _ in range(rank - 1)]
        shapes.append((f"p{index}", tuple(dims[:rank])))
    assume(sum(math.prod(shape) for _, shape in shapes) > 0)
    return shapes


@st.composite
def _layouts(draw: st.DrawFn, shapes: list[tuple[str, tuple[int, ...]]]) -> Layout:
    """``shapes`` in a random order and random units, on random worker and server counts."""
    order = draw(st.permutations(shapes))
    cuts = sorted(draw(st.lists(st.integers(0, len(order)), max_size=3)))
    bounds = [0, *cuts, len(order)]
    try:
        return build_layout(
            order,
            num_workers=draw(st.integers(1, 5)),
            num_servers=draw(st.integers(1, 4)),
            align=draw(st.sampled_from([1, 4, 64])),
            unit_sizes=[b - a for a, b in zip(bounds, bounds[1:])],
        )
    except LayoutError:  # more servers than aligned units
        assume(False)
        raise


@settings(
    max_examples=150,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(data=st.data())
def test_every_element_of_every_new_segment_comes_from_its_saved_position(data: st.DataObject) -> None:
    shapes = data.draw(_models())
    saved, new = data.draw(_layouts(shapes)), data.draw(_layouts(shapes))
    _check_runs(saved, new)


@pytest.mark.parametrize(
    ("saved_at", "new_at"), [((2, 2), (1, 1)), ((1, 1), (3, 2)), ((2, 3), (4, 1)), ((3, 1), (3, 4))]
)
def test_worker_and_server_changes_under_transformer_like_units(saved_at, new_at) -> None:
    units = {"unit_sizes": [2, 2, 1], "unit_names": ["", "blocks.0", "blocks.1"]}
    saved = build_layout(SHAPES, num_workers=saved_at[0], num_servers=saved_at[1], **units)
    new = build_layout(SHAPES, num_workers=new_at[0], num_servers=new_at[1], **units)
    _check_runs(saved, new)


def test_the_same_layout_maps_each_segment_onto_itself() -> None:
    layout = build_layout(SHAPES, num_workers=2, num_servers=3, unit_sizes=[2, 3])
    for segment in layout.segments:
        runs = segment_runs(layout, layout, segment)
        assert [(start - segment.start, start, length) for _, start, length in runs] == list(runs)


@pytest.mark.parametrize(
    "saved_shapes", [SHAPES[:-1], [*SHAPES[:-1], ("blocks.1.s", (1,))]], ids=["missing", "reshaped"]
)
def test_a_parameter_the_checkpoint_lacks_is_named(saved_shapes) -> None:
    saved = build_layout(saved_shapes, num_workers=1, num_servers=1)
    new = build_layout(SHAPES, num_workers=1, num_servers=1)
    with pytest.raises(CheckpointError, match=r"no parameter 'blocks.1.s' of shape \(\)"):
        for segment in new.segments:
            segment_runs(saved, new, segment)


@settings(
    max_examples=40,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(data=st.data())
def test_the_saving_layout_is_rebuilt_from_its_manifest(data: st.DataObject) -> None:
    layout = data.draw(_layouts(data.draw(_models())))
    manifest = Manifest.from_json(_manifest(layout).to_json(), source="m.json")
    assert manifest.layout.kind == LAYOUT_KIND
    assert saved_layout(manifest, "m.json") == layout


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"kind": "worker-major-v9"},
            r"m\.json: layout\.kind is 'worker-major-v9'; this build reads 'worker-major-v1'",
        ),
        ({"num_workers": 0}, r"m\.json: layout\.num_workers must be an integer >= 1, got 0"),
        ({"align": True}, r"m\.json: layout\.align must be an integer >= 1, got True"),
        ({"group_sizes": "5"}, r"m\.json: layout\.group_sizes must be a list, got str"),
        ({"group_sizes": [1, "a"]}, r"m\.json: layout\.group_sizes must be a list of integers >= 0, got \[1, 'a'\]"),
    ],
)
def test_a_manifest_with_a_badly_typed_layout_is_refused_on_load(change: dict, message: str) -> None:
    body = json.loads(_manifest(build_layout(SHAPES, num_workers=3, num_servers=1, align=1)).to_json())
    body["layout"].update(change)
    with pytest.raises(CheckpointError, match=message):
        Manifest.from_json(json.dumps(body), source="m.json")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"unit_sizes": (1, 1)}, r"the recorded layout cannot be rebuilt: unit sizes \[1, 1\] do not add up"),
        ({"unit_names": ("a", "b")}, r"the recorded layout cannot be rebuilt: 2 unit names for 1 units"),
        (
            {"num_workers": 2},
            r"the recorded layout spans \d+ elements, the manifest's total is \d+; the manifest is "
            "inconsistent",
        ),
    ],
)
def test_a_manifest_without_a_usable_layout_is_refused(change: dict, message: str) -> None:
    manifest = _manifest(build_layout(SHAPES, num_workers=3, num_servers=1, align=1))
    changed = dataclasses.replace(manifest, layout=dataclasses.replace(manifest.layout, **change))
    with pytest.raises(CheckpointError, match=rf"m\.json: {message}"):
        saved_layout(changed, "m.json")


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"num_workers": 10**7}, "layout.num_workers"),
        ({"num_servers": 10**7}, "layout.num_servers"),
        (
            {"group_sizes": [0] * 10**5 + [len(SHAPES)], "group_names": ["g"] * (10**5 + 1), "num_workers": 10**5},
            "layout.num_workers",
        ),
    ],
)
def test_layout_values_the_payload_cannot_hold_are_refused_at_once(change: dict, field: str) -> None:
    """Issue 27 row F: a manifest with layout.num_workers = 10**7 passed validation and the
    resume then built the saved layout for minutes, growing to 2.9 GiB. Values beyond what
    the payload holds are refused before anything is built, naming the field and file."""
    body = json.loads(_manifest(build_layout(SHAPES, num_workers=3, num_servers=2, align=1)).to_json())
    body["layout"].update(change)
    manifest = Manifest.from_json(json.dumps(body), source="m.json")  # well-typed: passes on load
    with pytest.raises(CheckpointError, match=rf"m\.json: {field} .*the manifest is inconsistent"):
        saved_layout(manifest, "m.json")


def test_a_layout_consistent_with_a_huge_total_is_refused_by_its_segment_records() -> None:
    """10**7 workers whose padded sizes do add up to the manifest's total: the segment
    records (one per segment the saving layout had) bound them."""
    layout = build_layout([("w", (10**7, 1))], num_workers=1, num_servers=1, align=1)
    body = json.loads(_manifest(layout).to_json())
    body["layout"]["num_workers"] = 10**7
    manifest = Manifest.from_json(json.dumps(body), source="m.json")
    with pytest.raises(CheckpointError, match=r"m\.json: layout\.num_workers is 10000000.* 1 segment records"):
        saved_layout(manifest, "m.json")


@pytest.mark.parametrize(("saved_bound", "new_bound"), [(0, 20_000), (20_000, 0), (20_000, 40_000)])
def test_a_checkpoint_resumes_under_another_unit_bound(saved_bound: int, new_bound: int) -> None:
    """worker.max_unit_params regroups and reorders the parameters (the root loses the
    embeddings and head): the runs follow them by name."""
    from reference import tiny_config

    from cargohold.cluster.sections import config_layout

    def layout(bound: int, workers: int) -> Layout:
        return config_layout(tiny_config(model__n_layer=3, worker__num_workers=workers, worker__max_unit_params=bound))[
            2
        ]

    saved, new = layout(saved_bound, 2), layout(new_bound, 3)
    assert [u.name for u in saved.units] != [u.name for u in new.units]
    _check_runs(saved, new)
