"""Property tests of the layout math: every element has exactly one home, each
worker's chunks are FSDP2's, and every cut is aligned to its chunk place (which is what keeps the
offloaded AdamW bitwise)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cargohold.services.core.errors import LayoutError
from cargohold.services.core.layout import Layout, build_layout, fragment_views, gather_params, scatter_params

pytestmark = pytest.mark.timeout(120)

PROPERTY_SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Shapes of 1 to 3 dims, biased towards the awkward sizes (1, odd, just past a power of
# two, fewer rows than workers); a rare zero-size parameter is legal in torch.
_DIM = st.one_of(st.sampled_from([1, 2, 3, 5, 7, 63, 65, 101]), st.integers(min_value=1, max_value=70))
SHAPE = st.one_of(
    st.tuples(st.integers(min_value=1, max_value=3000)),
    st.tuples(_DIM, _DIM),
    st.tuples(st.integers(1, 17), st.integers(1, 17), st.integers(1, 17)),
    st.just((1,)),
    st.just((0, 3)),
)
SHAPES = st.lists(SHAPE, min_size=1, max_size=20).filter(lambda shapes: any(math.prod(s) > 0 for s in shapes))
WORKERS = st.integers(min_value=1, max_value=6)
SERVERS = st.integers(min_value=1, max_value=5)
ALIGN = st.sampled_from([64, 8, 1])


def _named(shapes: list[tuple[int, ...]]) -> list[tuple[str, tuple[int, ...]]]:
    return [(f"p{i}", shape) for i, shape in enumerate(shapes)]


def _units(data: st.DataObject, count: int) -> list[int]:
    """Random consecutive unit sizes adding up to ``count`` (empty units allowed)."""
    cuts = sorted(data.draw(st.lists(st.integers(0, count), max_size=4)))
    bounds = [0, *cuts, count]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def _layout_or_none(data: st.DataObject, shapes, workers: int, servers: int, align: int) -> Layout | None:
    units = _units(data, len(shapes))
    try:
        return build_layout(_named(shapes), num_workers=workers, num_servers=servers, align=align, unit_sizes=units)
    except LayoutError as error:
        assert "fewer state servers" in str(error)
        return None


def _fsdp2_chunk(shape: tuple[int, ...], workers: int, worker: int) -> tuple[int, int]:
    """The rows torch.chunk (FSDP2's dim-0 sharding) gives ``worker``."""
    rows = torch.arange(shape[0]).chunk(workers)
    if worker >= len(rows):
        return shape[0], shape[0]
    return int(rows[worker][0]), int(rows[worker][-1]) + 1


@PROPERTY_SETTINGS
@given(data=st.data(), shapes=SHAPES, workers=WORKERS, servers=SERVERS, align=ALIGN)
def test_every_element_has_one_home_and_the_chunks_are_fsdp2s(data, shapes, workers, servers, align) -> None:
    layout = _layout_or_none(data, shapes, workers, servers, align)
    if layout is None:
        return
    tensors = {
        f"p{i}": torch.arange(math.prod(s), dtype=torch.float64).reshape(s) + 1000 * i for i, s in enumerate(shapes)
    }
    flat = scatter_params(layout, tensors, dtype=torch.float64)
    assert all(torch.equal(value, tensors[name]) for name, value in gather_params(layout, flat).items())

    coverage = torch.zeros(layout.total, dtype=torch.int32)
    for segment in layout.segments:
        lo, hi = layout.worker_range(segment.worker)
        assert lo <= segment.start < segment.stop <= hi
        assert layout.server_range(segment.server)[0] <= segment.start
        assert segment.stop <= layout.server_range(segment.server)[1]
        unit = layout.units[segment.unit]
        assert lo + unit.start <= segment.start and segment.stop <= lo + unit.stop
        for fragment in segment.fragments:
            place = layout.params[fragment.param_index]
            at = segment.start + fragment.segment_start
            coverage[at : at + fragment.length] += 1
            expected = tensors[place.name].reshape(-1)[fragment.param_start : fragment.param_start + fragment.length]
            assert torch.equal(flat[at : at + fragment.length], expected)
            # inside this worker's FSDP2 chunk, cut at a multiple of align from the chunk place's start
            first, last = _fsdp2_chunk(place.shape or (1,), workers, segment.worker)
            assert first * place.row_numel <= fragment.param_start
            assert fragment.param_start + fragment.length <= last * place.row_numel
            assert (fragment.param_start - first * place.row_numel) % align == 0
    assert int(coverage.sum()) == layout.num_real_elements and int(coverage.max()) <= 1
    assert [s.segment_id for s in layout.segments] == list(range(len(layout.segments)))
    assert sum(s.numel for s in layout.segments) == layout.total


@PROPERTY_SETTINGS
@given(data=st.data(), shapes=SHAPES, workers=WORKERS, servers=SERVERS, align=ALIGN)
def test_chunk_places_servers_and_runs_are_consistent(data, shapes, workers, servers, align) -> None:
    layout = _layout_or_none(data, shapes, workers, servers, align)
    if layout is None:
        return
    assert layout.total == layout.worker_size * workers
    bounds = layout.server_bounds
    assert bounds[0] == 0 and bounds[-1] == layout.total
    assert all(b % align == 0 for b in bounds) and list(bounds) == sorted(bounds)
    for place in layout.params:
        assert place.offset % align == 0
        assert place.rows_per_worker == -(-(place.shape[0] if place.shape else 1) // workers)
    for unit in layout.units:
        assert all(layout.params[i].unit == unit.index for i in range(unit.first_param, unit.stop_param))
    start = data.draw(st.integers(0, layout.total))
    stop = data.draw(st.integers(start, layout.total))
    for index, param_start, flat_start, length in layout.param_runs(start, stop):
        assert start <= flat_start and flat_start + length <= stop
        assert layout.flat_runs(index, param_start, length) == [(flat_start, param_start, length)]


def test_two_workers_split_rows_like_fsdp2() -> None:
    layout = build_layout(
        [("a", (5, 3)), ("b", (7,))],
        num_workers=2,
        num_servers=1,
        align=8,
        unit_sizes=[1, 1],
        unit_names=["", "block"],
    )
    a, b = layout.params
    assert (a.rows_per_worker, a.padded_numel, a.offset) == (3, 9, 0)
    assert (b.rows_per_worker, b.padded_numel, b.offset) == (4, 4, 16)
    assert layout.worker_size == 24 and layout.total == 48
    assert [(s.worker, s.unit, s.start, s.stop) for s in layout.segments] == [
        (0, 0, 0, 16),
        (0, 1, 16, 24),
        (1, 0, 24, 40),
        (1, 1, 40, 48),
    ]
    # worker 1 holds rows 3..4 of a (6 elements from element 9) and 3 elements of b
    assert [(f.param_start, f.length) for f in layout.segments[2].fragments] == [(9, 6)]
    assert [(f.param_start, f.length) for f in layout.segments[3].fragments] == [(4, 3)]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(num_workers=0, num_servers=1), r"num_workers must be >= 1, got 0"),
        (dict(num_workers=1, num_servers=0), r"num_servers must be >= 1, got 0"),
        (dict(num_workers=1, num_servers=1, align=0), r"align must be >= 1, got 0"),
        (dict(num_workers=1, num_servers=3), r"3 servers cannot each own at least 64 of 128 elements"),
        (dict(num_workers=1, num_servers=1, unit_sizes=[2]), r"unit sizes \[2\] do not add up to the 1"),
        (dict(num_workers=1, num_servers=1, unit_names=["a", "b"]), r"2 unit names for 1 units"),
    ],
)
def test_bad_requests_raise_layout_error_naming_the_setting(kwargs: dict, message: str) -> None:
    with pytest.raises(LayoutError, match=message):
        build_layout([("w", (100,))], **kwargs)


@pytest.mark.parametrize("shapes", [[], [(0,)], [(0, 3), (4, 0)]])
def test_empty_model_raises_layout_error(shapes) -> None:
    with pytest.raises(LayoutError, match="no parameter elements"):
        build_layout(_named(shapes), num_workers=1, num_servers=1)


def test_negative_dimension_raises_layout_error_naming_the_parameter() -> None:
    with pytest.raises(LayoutError, match=r"'bad'.*negative.*\(3, -1\)"):
        build_layout([("ok", (3,)), ("bad", (3, -1))], num_workers=1, num_servers=1)


def test_wrong_sizes_raise_layout_error_with_the_expected_size() -> None:
    layout = build_layout([("a", (101,)), ("b", (37, 5))], num_workers=2, num_servers=3, align=8)
    with pytest.raises(LayoutError, match=rf"flat space must be 1-D with {layout.total} elements"):
        gather_params(layout, torch.zeros(layout.total + 1))
    with pytest.raises(LayoutError, match=r"parameter 'b' has shape \(37, 5\), got \(5, 37\)"):
        scatter_params(layout, {"a": torch.zeros(101), "b": torch.zeros(5, 37)})
    with pytest.raises(LayoutError, match=r"no tensor for parameters \['b'\]"):
        scatter_params(layout, {"a": torch.zeros(101)})
    segment = layout.segments[1]
    with pytest.raises(LayoutError, match=rf"segment 1 buffer must be 1-D with {segment.numel} elements"):
        fragment_views(segment, torch.zeros(segment.numel + 1))


def test_out_of_range_worker_and_server_indices_raise_layout_error() -> None:
    layout = build_layout([("a", (1000,))], num_workers=2, num_servers=3, align=8)
    with pytest.raises(LayoutError, match=r"worker index 2 is outside 0..1"):
        layout.worker_range(2)
    with pytest.raises(LayoutError, match=r"server index -1 is outside 0..2"):
        layout.server_range(-1)
    with pytest.raises(LayoutError, match="worker index"):
        layout.segments_of_worker(5)
    with pytest.raises(LayoutError, match="server index"):
        layout.segments_of_server(3)
