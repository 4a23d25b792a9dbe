"""Cutting a segment into partitions: pure arithmetic.

A partition is a contiguous piece of a segment whose master weights, exp_avg and
exp_avg_sq move between tiers together. Cuts fall at multiples of ``align`` elements
from the segment start; segments and parameters start at multiples of ``align`` in the
flat buffer (:mod:`cargohold.services.core.layout`), so every cut is at a parameter-relative
multiple of ``align`` too, and the fused kernel over a partition's fragments rounds
every element exactly as over the whole parameter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cargohold.services.core.errors import ConfigError
from cargohold.services.core.layout import DEFAULT_ALIGN
from cargohold.services.core.optim import clip_fragments
from cargohold.services.core.state_precision import BLOCK_ELEMENTS, StateDtype
from cargohold.services.tiers.fileformat import FileLayout, gradient_file_bytes

STATE_BYTES_PER_ELEMENT = 12
"""fp32 master weight, exp_avg and exp_avg_sq: what ``partition_bytes`` is counted in
(the staging buffers hold that much), whatever ``optim.state_dtype`` stores."""


def partition_align(state_dtype: StateDtype) -> int:
    """The multiple of elements partitions are cut at: the layout's alignment, or the
    256-element blocks of ``blockwise8`` (each block's scale stays in one partition)."""
    return max(DEFAULT_ALIGN, BLOCK_ELEMENTS) if state_dtype == "blockwise8" else DEFAULT_ALIGN


@dataclass(frozen=True, slots=True)
class PartitionSpan:
    """Elements ``[start, stop)`` of a segment and the real-parameter runs inside them."""

    index: int
    start: int
    stop: int
    fragments: tuple[tuple[int, int], ...]
    """(offset, length) relative to ``start``, clipped to the partition."""

    @property
    def numel(self) -> int:
        return self.stop - self.start

    @property
    def state_bytes(self) -> int:
        return STATE_BYTES_PER_ELEMENT * self.numel


def elements_per_partition(partition_bytes: int, align: int = DEFAULT_ALIGN) -> int:
    """The most elements whose state fits ``partition_bytes``, a multiple of ``align``."""
    elements = (partition_bytes // STATE_BYTES_PER_ELEMENT) // align * align
    if elements < align:
        raise ConfigError(
            f"tuning.state_server.tier.partition_bytes={partition_bytes} holds fewer than {align} elements "
            f"({STATE_BYTES_PER_ELEMENT * align} bytes); raise it"
        )
    return elements


MAX_PARTITION_BYTES = 256 << 20
"""The largest derived partition: NVMe reads and writes reach the drive's bandwidth well
below it (docs/benchmarks.md, "NVMe tier"), and a larger one only delays the first
update of a step behind a longer first read."""
MIN_PARTITION_BYTES = 64 << 10
"""The smallest derived partition; a RAM tier too small for its staging is refused."""
STAGING_SHARE = 4
"""The staging buffers take at most 1/STAGING_SHARE of the RAM tier: the rest holds
resident partitions, which a step updates without disk traffic."""


def staging_bytes(partition_bytes: int, buffer_count: int) -> int:
    """Memory of ``buffer_count`` staging buffers: each a partition in its file layout and
    room for the partition's staged gradient (fp32 at most)."""
    elements = elements_per_partition(partition_bytes)
    return buffer_count * (FileLayout(elements).file_bytes + gradient_file_bytes(elements, 4))


def derived_partition_bytes(ram_budget_bytes: int, buffer_count: int) -> int:
    """The partition size of a RAM tier of ``ram_budget_bytes``: the largest power of two
    up to :data:`MAX_PARTITION_BYTES` whose ``buffer_count`` staging buffers take at most
    a :data:`STAGING_SHARE` of the tier (:data:`MIN_PARTITION_BYTES` at least)."""
    size = MAX_PARTITION_BYTES
    while size > MIN_PARTITION_BYTES and STAGING_SHARE * staging_bytes(size, buffer_count) > ram_budget_bytes:
        size //= 2
    return size


def split_segment(
    numel: int,
    fragments: Sequence[tuple[int, int]],
    max_elements: int | None,
    align: int = DEFAULT_ALIGN,
) -> tuple[PartitionSpan, ...]:
    """Partitions of ``max_elements`` (a multiple of ``align``) covering ``[0, numel)``;
    None keeps the segment whole. Only the last partition may be shorter."""
    if max_elements is not None and (max_elements <= 0 or max_elements % align):
        raise ValueError(f"max_elements must be a positive multiple of {align}, got {max_elements}")
    size = numel if max_elements is None else max_elements
    spans = []
    for index, start in enumerate(range(0, numel, size)):
        stop = min(numel, start + size)
        spans.append(PartitionSpan(index, start, stop, clip_fragments(fragments, start, stop)))
    return tuple(spans)
