"""Property tests of the shard layout math: every element has exactly one home, and every
cut the layout makes is aligned (which is what keeps the offloaded AdamW bitwise)."""

from __future__ import annotations

import math
from itertools import pairwise

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cargohold.services.errors import LayoutError
from cargohold.services.layout import (
    DEFAULT_ALIGN,
    ShardLayout,
    build_layout,
    fragment_views,
    layout_for_module,
    parameter_views,
)

pytestmark = pytest.mark.timeout(60)

PROPERTY_SETTINGS = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

# Shapes of 1 to 3 dims, at most a few thousand elements each, biased towards the awkward
# sizes (1, odd, just past a power of two); a rare zero-size parameter is legal in torch.
_DIM = st.one_of(
    st.sampled_from([1, 2, 3, 5, 7, 63, 65, 101]),
    st.integers(min_value=1, max_value=70),
)
SHAPE = st.one_of(
    st.tuples(st.integers(min_value=1, max_value=5000)),
    st.tuples(_DIM, _DIM),
    st.tuples(st.integers(1, 17), st.integers(1, 17), st.integers(1, 17)),
    st.just((1,)),
    st.just((0, 3)),
)
SHAPES = st.lists(SHAPE, min_size=1, max_size=30).filter(
    lambda shapes: any(math.prod(s) > 0 for s in shapes)
)
WORKERS = st.integers(min_value=1, max_value=8)
SERVERS = st.integers(min_value=1, max_value=5)
ALIGN = st.sampled_from([64, 8, 1])
# None: one bucket of the whole buffer; else a bucket size before rounding.
BUCKET = st.one_of(st.none(), st.integers(min_value=1, max_value=3000))


def _named(shapes: list[tuple[int, ...]]) -> list[tuple[str, tuple[int, ...]]]:
    return [(f"p{i}", shape) for i, shape in enumerate(shapes)]


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def _expected_total(shapes: list[tuple[int, ...]], align: int, num_workers: int) -> int:
    packed = sum(_round_up(math.prod(s), align) for s in shapes)
    return _round_up(packed, align * num_workers)


def _layout_or_none(
    shapes: list[tuple[int, ...]], num_workers: int, num_servers: int, align: int,
    bucket: int | None = None,
) -> ShardLayout | None:
    """The layout, or None after checking that the request is one of too many servers."""
    total = _expected_total(shapes, align, num_workers)
    if total // align < num_servers:
        with pytest.raises(LayoutError, match="fewer state servers"):
            build_layout(
                _named(shapes), num_workers=num_workers, num_servers=num_servers, align=align
            )
        return None
    layout = build_layout(
        _named(shapes), num_workers=num_workers, num_servers=num_servers, align=align,
        bucket_elements=bucket,
    )
    assert layout.total == total
    return layout


@PROPERTY_SETTINGS
@given(shapes=SHAPES, num_workers=WORKERS, num_servers=SERVERS, align=ALIGN, bucket=BUCKET)
def test_every_real_element_is_covered_by_exactly_one_fragment(
    shapes: list[tuple[int, ...]], num_workers: int, num_servers: int, align: int,
    bucket: int | None,
) -> None:
    layout = _layout_or_none(shapes, num_workers, num_servers, align, bucket)
    if layout is None:
        return
    coverage = torch.zeros(layout.total, dtype=torch.int32)
    for segment in layout.segments:
        for fragment in segment.fragments:
            slot = layout.params[fragment.param_index]
            flat_start = segment.start + fragment.segment_start
            # The fragment's two coordinates agree: segment position == param position.
            assert flat_start == slot.offset + fragment.param_start
            assert fragment.length > 0
            assert 0 <= fragment.param_start
            assert fragment.param_start + fragment.length <= slot.numel
            assert fragment.segment_start + fragment.length <= segment.numel
            coverage[flat_start : flat_start + fragment.length] += 1

    real = torch.zeros(layout.total, dtype=torch.bool)
    for slot in layout.params:
        real[slot.offset : slot.offset + slot.numel] = True
    assert torch.all(coverage[real] == 1), "a real element is missing or covered twice"
    assert torch.all(coverage[~real] == 0), "a padding element is inside a fragment"
    assert int(real.sum()) == layout.num_real_elements == sum(math.prod(s) for s in shapes)


@PROPERTY_SETTINGS
@given(shapes=SHAPES, num_workers=WORKERS, num_servers=SERVERS, align=ALIGN, bucket=BUCKET)
def test_segments_tile_the_buffer_inside_one_worker_and_one_server_range(
    shapes: list[tuple[int, ...]], num_workers: int, num_servers: int, align: int,
    bucket: int | None,
) -> None:
    layout = _layout_or_none(shapes, num_workers, num_servers, align, bucket)
    if layout is None:
        return
    assert [s.segment_id for s in layout.segments] == list(range(len(layout.segments)))
    position = 0
    for segment in sorted(layout.segments, key=lambda s: s.start):
        assert segment.start == position, "gap or overlap between segments"
        assert segment.stop > segment.start
        position = segment.stop
    assert position == layout.total

    pieces = {(b.index, w): b.piece(w) for b in layout.buckets for w in range(num_workers)}
    server_ranges = [layout.server_range(s) for s in range(num_servers)]
    for segment in layout.segments:
        in_pieces = [
            key for key, (a, b) in pieces.items() if a <= segment.start and segment.stop <= b
        ]
        in_servers = [
            s for s, (a, b) in enumerate(server_ranges) if a <= segment.start and segment.stop <= b
        ]
        assert in_pieces == [(segment.bucket, segment.worker)]
        assert in_servers == [segment.server]
        # A segment is the whole intersection, not a piece of it.
        (wa, wb), (sa, sb) = pieces[segment.bucket, segment.worker], server_ranges[segment.server]
        assert (segment.start, segment.stop) == (max(wa, sa), min(wb, sb))
        # Its place in the worker's shard: the pieces of earlier buckets, then the offset.
        assert segment.shard_offset == layout.piece_offset(segment.bucket) + segment.start - wa

    for worker in range(num_workers):
        mine = layout.segments_of_worker(worker)
        assert sum(s.numel for s in mine) == layout.worker_shard_size
        assert all(s.worker == worker for s in mine)
        # The worker's segments tile its shard in order.
        assert [s.shard_offset for s in mine] == [sum(m.numel for m in mine[:i]) for i in range(len(mine))]
    for server in range(num_servers):
        mine = layout.segments_of_server(server)
        start, stop = layout.server_range(server)
        assert sum(s.numel for s in mine) == stop - start
        assert all(s.server == server for s in mine)


@PROPERTY_SETTINGS
@given(shapes=SHAPES, num_workers=WORKERS, num_servers=SERVERS, align=ALIGN, bucket=BUCKET)
def test_every_cut_is_aligned(
    shapes: list[tuple[int, ...]], num_workers: int, num_servers: int, align: int,
    bucket: int | None,
) -> None:
    layout = _layout_or_none(shapes, num_workers, num_servers, align, bucket)
    if layout is None:
        return
    assert (layout.num_workers, layout.num_servers, layout.align) == (
        num_workers,
        num_servers,
        align,
    )
    # Equal worker shards, each a multiple of align (what reduce_scatter/all_gather need).
    assert layout.total == layout.worker_shard_size * num_workers
    assert layout.worker_shard_size % align == 0
    assert {sum(b - a for a, b in layout.worker_pieces(w)) for w in range(num_workers)} == {
        layout.worker_shard_size
    }
    # Buckets tile the buffer; each is a multiple of num_workers * align, so pieces are
    # equal and aligned.
    assert [b.start for b in layout.buckets] == [0] + [b.stop for b in layout.buckets[:-1]]
    assert layout.buckets[-1].stop == layout.total
    for b in layout.buckets:
        assert (b.stop - b.start) % (align * num_workers) == 0 and b.stop > b.start
    if bucket is None:
        assert len(layout.buckets) == 1
    # Padding is less than one alignment unit per parameter plus one per worker round-up.
    packed = sum(_round_up(p.numel, align) for p in layout.params)
    assert packed <= layout.total < packed + align * num_workers

    # Parameters in the given order, aligned, not overlapping, inside the buffer.
    end = 0
    for slot, shape in zip(layout.params, shapes, strict=True):
        assert slot.shape == tuple(shape)
        assert slot.offset % align == 0
        assert slot.offset >= end
        end = slot.offset + slot.numel
    assert end <= layout.total

    bounds = layout.server_bounds
    assert len(bounds) == num_servers + 1
    assert bounds[0] == 0 and bounds[-1] == layout.total
    assert all(b % align == 0 for b in bounds)
    assert all(b - a >= align for a, b in pairwise(bounds)), "a server owns nothing"

    for segment in layout.segments:
        assert segment.start % align == 0 and segment.stop % align == 0
        for fragment in segment.fragments:
            # The property that keeps the fused kernel on the reference's code path.
            assert fragment.param_start % align == 0
            assert fragment.segment_start % align == 0


@PROPERTY_SETTINGS
@given(shapes=SHAPES, num_workers=WORKERS, num_servers=SERVERS, align=ALIGN, bucket=BUCKET)
def test_parameter_and_fragment_views_address_the_right_elements(
    shapes: list[tuple[int, ...]], num_workers: int, num_servers: int, align: int,
    bucket: int | None,
) -> None:
    layout = _layout_or_none(shapes, num_workers, num_servers, align, bucket)
    if layout is None:
        return
    # Round trip: values written through the parameter views come back unchanged and land
    # at each parameter's offset; padding is untouched.
    values = [
        torch.arange(math.prod(s), dtype=torch.float64).reshape(s) + 1_000_000 * (i + 1)
        for i, s in enumerate(shapes)
    ]
    flat = torch.full((layout.total,), -1.0, dtype=torch.float64)
    views = parameter_views(layout, flat)
    for view, value in zip(views, values, strict=True):
        assert view.shape == value.shape
        view.copy_(value)
    for view, value, slot in zip(parameter_views(layout, flat), values, layout.params, strict=True):
        assert torch.equal(view, value)
        assert torch.equal(flat[slot.offset : slot.offset + slot.numel], value.reshape(-1))
    assert int((flat == -1.0).sum()) == layout.total - layout.num_real_elements

    # Fragment views of a segment buffer are the expected slice of the flat index space.
    index = torch.arange(layout.total, dtype=torch.int64)
    for segment in layout.segments:
        buffer = index[segment.start : segment.stop]
        views = fragment_views(segment, buffer)
        assert len(views) == len(segment.fragments)
        for view, fragment in zip(views, segment.fragments, strict=True):
            first = layout.params[fragment.param_index].offset + fragment.param_start
            assert torch.equal(view, torch.arange(first, first + fragment.length))
            assert view.data_ptr() == buffer[fragment.segment_start :].data_ptr()  # a view


def test_views_share_storage_with_the_flat_buffer() -> None:
    layout = build_layout([("a", (3, 5)), ("b", (7,))], num_workers=2, num_servers=2, align=8)
    flat = torch.zeros(layout.total)
    parameter_views(layout, flat)[1].fill_(2.0)
    assert torch.equal(
        flat[layout.params[1].offset : layout.params[1].offset + 7], torch.full((7,), 2.0)
    )
    segment = layout.segments[0]
    fragment_views(segment, flat[segment.start : segment.stop])[0].fill_(3.0)
    assert flat[0] == 3.0


def test_layout_for_module_matches_named_parameters_on_meta_device() -> None:
    with torch.device("meta"):
        module = torch.nn.Sequential(
            torch.nn.Linear(37, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 1)
        )
    layout = layout_for_module(module, num_workers=3, num_servers=2)
    expected = build_layout(
        [(n, tuple(p.shape)) for n, p in module.named_parameters()],
        num_workers=3,
        num_servers=2,
        align=DEFAULT_ALIGN,
    )
    assert layout == expected
    assert [p.name for p in layout.params] == [
        "0.weight",
        "0.bias",
        "1.weight",
        "1.bias",
        "2.weight",
        "2.bias",
    ]


def test_one_worker_one_server_is_one_segment_of_whole_parameters() -> None:
    layout = build_layout(
        [("a", (101,)), ("b", (37, 5)), ("c", (1,))], num_workers=1, num_servers=1, align=64
    )
    assert layout.total == 128 + 192 + 64
    (segment,) = layout.segments
    assert (segment.start, segment.stop, segment.worker, segment.server) == (0, layout.total, 0, 0)
    assert [
        (f.param_index, f.param_start, f.segment_start, f.length) for f in segment.fragments
    ] == [
        (0, 0, 0, 101),
        (1, 0, 128, 185),
        (2, 0, 320, 1),
    ]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(num_workers=0, num_servers=1), r"num_workers must be >= 1, got 0"),
        (dict(num_workers=-2, num_servers=1), r"num_workers must be >= 1, got -2"),
        (dict(num_workers=1, num_servers=0), r"num_servers must be >= 1, got 0"),
        (dict(num_workers=1, num_servers=1, align=0), r"align must be >= 1, got 0"),
        # 100 elements at align 64 make 2 units: 3 servers cannot each own one.
        (
            dict(num_workers=1, num_servers=3),
            r"3 servers cannot each own at least 64 of 128 elements; use fewer state servers",
        ),
    ],
)
def test_bad_counts_raise_layout_error_naming_the_setting(kwargs: dict, message: str) -> None:
    with pytest.raises(LayoutError, match=message):
        build_layout([("w", (100,))], **kwargs)


@pytest.mark.parametrize("shapes", [[], [(0,)], [(0, 3), (4, 0)]])
def test_empty_model_raises_layout_error(shapes: list[tuple[int, ...]]) -> None:
    with pytest.raises(LayoutError, match="no parameter elements"):
        build_layout(_named(shapes), num_workers=1, num_servers=1)


def test_negative_dimension_raises_layout_error_naming_the_parameter() -> None:
    with pytest.raises(LayoutError, match=r"'bad'.*negative.*\(3, -1\)"):
        build_layout([("ok", (3,)), ("bad", (3, -1))], num_workers=1, num_servers=1)


def test_wrong_buffer_sizes_raise_layout_error_with_the_expected_size() -> None:
    layout = build_layout([("a", (101,)), ("b", (37, 5))], num_workers=2, num_servers=3, align=8)
    for bad in (
        torch.zeros(layout.total + 1),
        torch.zeros(layout.total - 1),
        torch.zeros(1, layout.total),
    ):
        with pytest.raises(
            LayoutError, match=rf"flat buffer must be 1-D with {layout.total} elements, got shape"
        ):
            parameter_views(layout, bad)
    segment = layout.segments[1]
    for bad in (torch.zeros(segment.numel + 1), torch.zeros(segment.numel, 1)):
        with pytest.raises(
            LayoutError, match=rf"segment 1 buffer must be 1-D with {segment.numel} elements"
        ):
            fragment_views(segment, bad)


def test_out_of_range_worker_and_server_indices_raise_layout_error() -> None:
    layout = build_layout([("a", (1000,))], num_workers=2, num_servers=3, align=8)
    with pytest.raises(LayoutError, match=r"worker index 2 is outside 0..1"):
        layout.worker_pieces(2)
    with pytest.raises(LayoutError, match=r"server index -1 is outside 0..2"):
        layout.server_range(-1)
    with pytest.raises(LayoutError, match="worker index"):
        layout.segments_of_worker(5)
    with pytest.raises(LayoutError, match="server index"):
        layout.segments_of_server(3)
