"""The pure parts of the tier store: cutting segments into partitions, the planner's
residency, paths, stream order and cost, and the partition file header. No I/O."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cargohold.services.core.errors import ConfigError, CorruptPartitionError
from cargohold.services.core.layout import DEFAULT_ALIGN, build_layout
from cargohold.services.tiers.fileformat import (
    BLOCK,
    HEADER_BYTES,
    FileLayout,
    PartitionHeader,
    unpack_header,
)
from cargohold.services.tiers.partitions import (
    MAX_PARTITION_BYTES,
    MIN_PARTITION_BYTES,
    STATE_BYTES_PER_ELEMENT,
    clip_fragments,
    derived_partition_bytes,
    elements_per_partition,
    split_segment,
    staging_bytes,
)
from cargohold.services.tiers.planner import (
    Bandwidth,
    PartitionDemand,
    plan_tiers,
    predict_io_seconds,
    stream_order,
)
from cargohold.services.tiers.residency import PartitionKey, Residency

pytestmark = pytest.mark.timeout(60)

RAM, NVME = Residency.RAM, Residency.NVME


# --- partitions ---------------------------------------------------------------------------


def test_elements_per_partition_is_a_multiple_of_the_alignment() -> None:
    assert elements_per_partition(64 << 20) == (64 << 20) // STATE_BYTES_PER_ELEMENT // 64 * 64
    assert elements_per_partition(64 << 10) == 5440
    assert elements_per_partition(4096) == 320
    with pytest.raises(ConfigError, match="partition_bytes"):
        elements_per_partition(700)


@given(budget=st.integers(min_value=1 << 20, max_value=1 << 40), buffers=st.integers(min_value=2, max_value=8))
def test_a_derived_partition_is_the_largest_power_of_two_whose_staging_takes_a_quarter(budget, buffers) -> None:
    size = derived_partition_bytes(budget, buffers)
    assert MIN_PARTITION_BYTES <= size <= MAX_PARTITION_BYTES and size & (size - 1) == 0
    if size > MIN_PARTITION_BYTES:  # fits a quarter of the tier; the smallest is taken anyway
        assert 4 * staging_bytes(size, buffers) <= budget
    if size < MAX_PARTITION_BYTES:  # twice as large would not
        assert 4 * staging_bytes(2 * size, buffers) > budget


def test_derived_partitions_at_common_tier_sizes() -> None:
    assert derived_partition_bytes(64 << 30, 3) == 256 << 20
    assert derived_partition_bytes(8 << 30, 3) == 256 << 20
    assert derived_partition_bytes(4 << 30, 3) == 128 << 20  # 256 MiB's buffers are 44 KB over 1 GiB
    assert derived_partition_bytes(1 << 30, 3) == 32 << 20
    assert derived_partition_bytes(100 << 10, 3) == MIN_PARTITION_BYTES


def test_split_keeps_the_segment_whole_without_a_size() -> None:
    (span,) = split_segment(1000, ((0, 10), (64, 900)), None)
    assert (span.start, span.stop, span.fragments) == (0, 1000, ((0, 10), (64, 900)))


def test_split_clips_fragments_to_each_partition() -> None:
    spans = split_segment(320, ((0, 100), (128, 150)), 128)
    assert [(s.start, s.stop) for s in spans] == [(0, 128), (128, 256), (256, 320)]
    assert [s.fragments for s in spans] == [((0, 100),), ((0, 128),), ((0, 22),)]
    assert [s.index for s in spans] == [0, 1, 2]
    with pytest.raises(ValueError, match="multiple of 64"):
        split_segment(320, (), 100)


@settings(max_examples=60, deadline=None)
@given(
    shapes=st.lists(st.integers(1, 700), min_size=1, max_size=8),
    workers=st.integers(1, 3),
    servers=st.integers(1, 3),
    units=st.integers(1, 6),
)
def test_partition_cuts_fall_on_aligned_parameter_offsets(shapes, workers, servers, units) -> None:
    """Every cut inside a worker's chunk of a parameter is at a chunk-relative multiple of 64,
    and partitions cover each segment's fragments exactly."""
    try:
        layout = build_layout([(f"p{i}", (n,)) for i, n in enumerate(shapes)], num_workers=workers, num_servers=servers)
    except Exception:
        return  # too few elements for that many servers
    for segment in layout.segments:
        fragments = tuple((f.segment_start, f.length) for f in segment.fragments)
        spans = split_segment(segment.numel, fragments, units * DEFAULT_ALIGN)
        assert spans[0].start == 0 and spans[-1].stop == segment.numel
        covered = [False] * segment.numel
        for span in spans:
            assert (segment.start + span.start) % DEFAULT_ALIGN == 0
            for offset, length in span.fragments:
                for element in range(span.start + offset, span.start + offset + length):
                    assert not covered[element]
                    covered[element] = True
        wanted = [False] * segment.numel
        for offset, length in fragments:
            wanted[offset : offset + length] = [True] * length
        assert covered == wanted
        for span in spans:
            for fragment in segment.fragments:
                lo = max(fragment.segment_start, span.start)
                if lo < min(fragment.segment_start + fragment.length, span.stop) and lo > fragment.segment_start:
                    place = layout.params[fragment.param_index]
                    chunk_start = place.local_rows(segment.worker)[0] * place.row_numel  # FSDP2's local shard
                    assert (fragment.param_start - chunk_start + lo - fragment.segment_start) % DEFAULT_ALIGN == 0


def test_clip_fragments() -> None:
    assert clip_fragments(((0, 10), (20, 10)), 5, 25) == ((0, 5), (15, 5))
    assert clip_fragments(((0, 10),), 10, 20) == ()


# --- planner ------------------------------------------------------------------------------


def _demands(segments: dict[int, int], nbytes: int = 100) -> list[PartitionDemand]:
    return [PartitionDemand(PartitionKey("r", s, i), nbytes) for s, count in segments.items() for i in range(count)]


def test_without_a_budget_everything_stays_in_ram() -> None:
    plan = plan_tiers(_demands({0: 3, 1: 2}), ram_budget_bytes=None, staging_bytes=0)
    assert set(plan.residency.values()) == {RAM}
    assert (plan.ram_bytes, plan.nvme_bytes, plan.predicted_io_seconds) == (500, 0, 0.0)


def test_budget_pays_for_staging_then_heads_of_segments_round_robin() -> None:
    # 1000 budget - 300 staging = 700: seven partitions of 100, heads first on every segment.
    plan = plan_tiers(_demands({0: 5, 1: 5, 2: 1}), ram_budget_bytes=1000, staging_bytes=300, num_paths=2)
    ram = sorted((k.segment_id, k.index) for k, r in plan.residency.items() if r is RAM)
    assert ram == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 0)]
    assert (plan.ram_bytes, plan.nvme_bytes) == (700, 400)
    assert plan.count(RAM) == 7 and plan.count(NVME) == 4
    assert plan.ram_bytes + plan.staging_bytes <= plan.ram_budget_bytes


def test_plan_does_not_depend_on_registration_order() -> None:
    demands = _demands({0: 4, 1: 3, 7: 2})
    forward = plan_tiers(demands, ram_budget_bytes=650, staging_bytes=200, num_paths=3)
    backward = plan_tiers(list(reversed(demands)), ram_budget_bytes=650, staging_bytes=200, num_paths=3)
    assert forward == backward


def test_a_smaller_partition_that_fits_still_goes_to_ram() -> None:
    demands = [PartitionDemand(PartitionKey("r", 0, 0), 300), PartitionDemand(PartitionKey("r", 0, 1), 50)]
    plan = plan_tiers(demands, ram_budget_bytes=250, staging_bytes=0)
    assert plan.of(PartitionKey("r", 0, 0)) is NVME and plan.of(PartitionKey("r", 0, 1)) is RAM


def test_the_tiers_fill_fastest_first_as_their_capacities_say() -> None:
    demands = _demands({0: 5, 1: 5, 2: 1})
    default = plan_tiers(demands, ram_budget_bytes=1000, staging_bytes=300, num_paths=2)
    listed = plan_tiers(
        demands, ram_budget_bytes=1000, staging_bytes=300, num_paths=2, capacities=[(RAM, 700), (NVME, None)]
    )
    assert listed == default  # the storage's tier list names the same two tiers
    smaller = plan_tiers(
        demands, ram_budget_bytes=1000, staging_bytes=300, num_paths=2, capacities=[(RAM, 300), (NVME, None)]
    )
    assert sorted((k.segment_id, k.index) for k, r in smaller.residency.items() if r is RAM) == [(0, 0), (1, 0), (2, 0)]


def test_budget_below_staging_is_refused() -> None:
    with pytest.raises(ValueError, match="staging"):
        plan_tiers(_demands({0: 1}), ram_budget_bytes=10, staging_bytes=20)


def test_paths_are_round_robin_along_each_segment() -> None:
    plan = plan_tiers(_demands({0: 4, 1: 3}), ram_budget_bytes=0, staging_bytes=0, num_paths=3)
    assert [plan.path_index[PartitionKey("r", 0, i)] for i in range(4)] == [0, 1, 2, 0]
    assert [plan.path_index[PartitionKey("r", 1, i)] for i in range(3)] == [1, 2, 0]


def test_predicted_io_time_is_the_slowest_path() -> None:
    bandwidths = [Bandwidth(1000.0, 500.0), Bandwidth(100.0, 100.0)]
    plan = plan_tiers(_demands({0: 4}), ram_budget_bytes=0, staging_bytes=0, bandwidths=bandwidths, num_paths=2)
    # Path 0 holds partitions 0 and 2 (200 bytes): 0.2 + 0.4 s; path 1 holds 1 and 3: 2 + 2 s.
    assert plan.predicted_io_seconds == pytest.approx(4.0)
    assert predict_io_seconds([], {}, bandwidths) == 0.0
    assert predict_io_seconds(_demands({0: 1}), {PartitionKey("r", 0, 0): 0}, []) == 0.0


def test_stream_order_puts_ram_first_and_alternates_disk_direction() -> None:
    parts = [(0, RAM), (1, NVME), (2, NVME), (3, RAM), (4, NVME)]
    assert stream_order(parts, update=1) == (0, 3, 1, 2, 4)
    assert stream_order(parts, update=2) == (0, 3, 4, 2, 1)
    # The disk partitions one update writes last are the first the next update reads.
    assert stream_order(parts, 1)[-1] == stream_order(parts, 2)[2]


# --- the file header -------------------------------------------------------------------------


KEY = PartitionKey("run-x", 3, 7)


def test_file_layout_is_block_aligned() -> None:
    layout = FileLayout(5440)
    assert layout.array_bytes == 21760 and layout.region_bytes == 24576
    assert [layout.offset(i) % BLOCK for i in range(3)] == [0, 0, 0]
    assert layout.file_bytes == HEADER_BYTES + 3 * 24576


def test_header_round_trips() -> None:
    header = PartitionHeader(key=KEY, numel=5440, updates=12, checksums=(1, 2, 0xFFFFFFFF))
    raw = header.pack()
    assert len(raw) == HEADER_BYTES
    assert unpack_header(raw, path="/x/f.bin", key=KEY, numel=5440) == header


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda raw: raw[:100], "shorter than a header"),
        (lambda raw: b"NOTMAGIC" + raw[8:], "bad magic"),
        (lambda raw: raw[:40] + bytes([raw[40] ^ 1]) + raw[41:], "header checksum mismatch"),
        (lambda raw: raw[:8] + b"\x09\x00\x00\x00" + raw[12:], "header checksum mismatch"),
    ],
    ids=["short", "magic", "flipped-step", "version"],
)
def test_bad_headers_are_refused_naming_file_and_partition(mutate, reason: str) -> None:
    raw = PartitionHeader(key=KEY, numel=64, updates=1, checksums=(0, 0, 0)).pack()
    with pytest.raises(CorruptPartitionError, match=reason) as caught:
        unpack_header(mutate(raw), path="/data/x.bin", key=KEY, numel=64)
    assert caught.value.path == "/data/x.bin"
    assert "/data/x.bin" in str(caught.value) and str(KEY) in str(caught.value)


def test_header_of_another_partition_or_shape_is_refused() -> None:
    raw = PartitionHeader(key=KEY, numel=64, updates=1, checksums=(0, 0, 0)).pack()
    with pytest.raises(CorruptPartitionError, match="the file holds partition 7 of segment 3"):
        unpack_header(raw, path="f", key=PartitionKey("run-x", 3, 8), numel=64)
    with pytest.raises(CorruptPartitionError, match="expected 128"):
        unpack_header(raw, path="f", key=KEY, numel=128)


def test_corrupt_partition_error_pickles() -> None:
    import pickle

    error = CorruptPartitionError("partition file f is corrupt", path="f", partition=str(KEY))
    copy = pickle.loads(pickle.dumps(error))
    assert (str(copy), copy.path, copy.partition) == (str(error), "f", str(KEY))


def test_crc32c_matches_google_crc32c_with_and_without_the_native_call() -> None:
    import google_crc32c

    from cargohold.services.core.checksum import crc32c

    expected = bytes(range(256)) * 12289 + b"xyz"  # over 3 MiB, an odd length
    data = bytearray(expected)
    assert crc32c(memoryview(data)) == google_crc32c.value(expected)  # writable: native when found
    assert crc32c(memoryview(data).toreadonly()) == google_crc32c.value(expected)  # copying path
    assert crc32c(memoryview(data)[7:7]) == 0
