"""Shard layout: where every parameter element lives in the flat buffer, which worker
reduces it and which state server owns its Adam state.

Pure arithmetic on sizes, no tensors are touched except by :func:`parameter_views`.

The flat buffer places each parameter at an offset that is a multiple of ``align``
elements and is cut into *buckets*: contiguous ranges, in parameter order, each a
multiple of ``num_workers * align``. Backward fills a bucket's gradients together, so a
bucket can be reduced and shipped while backward still computes the others. Each bucket
splits into ``num_workers`` equal *pieces* (what ``reduce_scatter``/``all_gather`` need);
worker w owns piece w of every bucket, and its *shard* is those pieces concatenated in
bucket order. One bucket spanning the buffer gives the plain ZeRO layout.
The same buffer is split, independently, into ``num_servers`` contiguous ranges that are
also multiples of ``align``. A *segment* is the non-empty intersection of one worker
piece and one server range: the unit a worker pushes and fetches, and the unit a server
registers. Every element of the buffer belongs to exactly one segment.

Why align inside parameters: the fused AdamW kernel runs a vector loop with a scalar
tail, and the two round differently in rare cases. Cutting a parameter only at
multiples of ``align`` (a multiple of any SIMD width) keeps every element on the same
code path as ``torch.optim.AdamW(fused=True)`` applied to the whole parameter, which is
what makes the offloaded update bitwise equal to the reference.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from cargohold.services.errors import LayoutError

DEFAULT_ALIGN = 64
"""Elements; 256 bytes of fp32, a multiple of every SIMD width and of a cache line."""


@dataclass(frozen=True, slots=True)
class ParamSlot:
    """One parameter's place in the flat buffer."""

    name: str
    shape: tuple[int, ...]
    offset: int
    """First element in the flat buffer (a multiple of the layout's alignment)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class Fragment:
    """A run of real parameter elements inside a segment (padding excluded)."""

    param_index: int
    param_start: int
    """Offset inside the flattened parameter."""
    segment_start: int
    """Offset inside the segment."""
    length: int


@dataclass(frozen=True, slots=True)
class Bucket:
    """A range of the flat buffer reduced and gathered as one collective."""

    index: int
    start: int
    stop: int
    num_workers: int

    @property
    def piece_size(self) -> int:
        return (self.stop - self.start) // self.num_workers

    def piece(self, worker: int) -> tuple[int, int]:
        """The half-open range of this bucket that ``worker`` reduces."""
        start = self.start + worker * self.piece_size
        return start, start + self.piece_size


@dataclass(frozen=True, slots=True)
class Segment:
    """The elements ``[start, stop)`` that worker ``worker`` pushes to server ``server``."""

    segment_id: int
    bucket: int
    worker: int
    server: int
    start: int
    stop: int
    shard_offset: int
    """Where the segment begins inside its worker's shard (pieces in bucket order)."""
    fragments: tuple[Fragment, ...]

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """The complete placement of a model's parameters over workers and servers."""

    params: tuple[ParamSlot, ...]
    total: int
    """Padded length of the flat buffer."""
    num_workers: int
    num_servers: int
    align: int
    server_bounds: tuple[int, ...]
    """``num_servers + 1`` cut points; server ``s`` owns ``[bounds[s], bounds[s+1])``."""
    buckets: tuple[Bucket, ...]
    segments: tuple[Segment, ...]

    @property
    def worker_shard_size(self) -> int:
        return self.total // self.num_workers

    def worker_pieces(self, worker: int) -> tuple[tuple[int, int], ...]:
        """The half-open ranges of the flat buffer that ``worker`` reduces, one per bucket."""
        self._check_index("worker", worker, self.num_workers)
        return tuple(bucket.piece(worker) for bucket in self.buckets)

    def piece_offset(self, bucket: int) -> int:
        """Where a bucket's piece begins inside every worker's shard."""
        return sum(b.piece_size for b in self.buckets[:bucket])

    def server_range(self, server: int) -> tuple[int, int]:
        """The half-open range of the flat buffer whose Adam state ``server`` owns."""
        self._check_index("server", server, self.num_servers)
        return self.server_bounds[server], self.server_bounds[server + 1]

    def segments_of_worker(self, worker: int) -> tuple[Segment, ...]:
        self._check_index("worker", worker, self.num_workers)
        return tuple(s for s in self.segments if s.worker == worker)

    def segments_of_server(self, server: int) -> tuple[Segment, ...]:
        self._check_index("server", server, self.num_servers)
        return tuple(s for s in self.segments if s.server == server)

    @property
    def num_real_elements(self) -> int:
        return sum(p.numel for p in self.params)

    @staticmethod
    def _check_index(kind: str, index: int, count: int) -> None:
        if not 0 <= index < count:
            raise LayoutError(f"{kind} index {index} is outside 0..{count - 1}")


def build_layout(
    named_shapes: Iterable[tuple[str, Sequence[int]]],
    *,
    num_workers: int,
    num_servers: int,
    align: int = DEFAULT_ALIGN,
    bucket_elements: int | None = None,
) -> ShardLayout:
    """Place parameters (in the given order) and split the buffer over workers and servers.

    ``bucket_elements`` is rounded up to a multiple of ``num_workers * align``; None makes
    one bucket of the whole buffer.
    """
    if num_workers < 1:
        raise LayoutError(f"num_workers must be >= 1, got {num_workers}")
    if num_servers < 1:
        raise LayoutError(f"num_servers must be >= 1, got {num_servers}")
    if align < 1:
        raise LayoutError(f"align must be >= 1, got {align}")
    if bucket_elements is not None and bucket_elements < 1:
        raise LayoutError(f"bucket_elements must be >= 1 or None, got {bucket_elements}")

    params: list[ParamSlot] = []
    offset = 0
    for name, shape in named_shapes:
        slot = ParamSlot(name=name, shape=tuple(int(d) for d in shape), offset=offset)
        if any(d < 0 for d in slot.shape):
            raise LayoutError(f"parameter {name!r} has a negative dimension: {slot.shape}")
        params.append(slot)
        offset += _round_up(slot.numel, align)
    if not params or offset == 0:
        raise LayoutError("the model has no parameter elements to place")

    total = _round_up(offset, align * num_workers)
    units = total // align
    if units < num_servers:
        raise LayoutError(
            f"{num_servers} servers cannot each own at least {align} of {total} elements; "
            "use fewer state servers"
        )
    server_bounds = tuple(align * ((units * s) // num_servers) for s in range(num_servers + 1))
    bucket_size = total if bucket_elements is None else _round_up(bucket_elements, align * num_workers)
    buckets = tuple(
        Bucket(index=i, start=start, stop=min(total, start + bucket_size), num_workers=num_workers)
        for i, start in enumerate(range(0, total, bucket_size))
    )

    segments: list[Segment] = []
    shard_offsets = [0] * num_workers
    for bucket in buckets:
        for worker in range(num_workers):
            w_start, w_stop = bucket.piece(worker)
            for server in range(num_servers):
                start = max(w_start, server_bounds[server])
                stop = min(w_stop, server_bounds[server + 1])
                if start < stop:
                    segments.append(
                        Segment(
                            segment_id=len(segments),
                            bucket=bucket.index,
                            worker=worker,
                            server=server,
                            start=start,
                            stop=stop,
                            shard_offset=shard_offsets[worker] + start - w_start,
                            fragments=tuple(_fragments(params, start, stop)),
                        )
                    )
            shard_offsets[worker] += bucket.piece_size
    return ShardLayout(
        params=tuple(params),
        total=total,
        num_workers=num_workers,
        num_servers=num_servers,
        align=align,
        server_bounds=server_bounds,
        buckets=buckets,
        segments=tuple(segments),
    )


def layout_for_module(
    module: torch.nn.Module,
    *,
    num_workers: int,
    num_servers: int,
    align: int = DEFAULT_ALIGN,
    bucket_elements: int | None = None,
) -> ShardLayout:
    """Layout of ``module.named_parameters()``; works on a meta-device module."""
    return build_layout(
        ((name, tuple(p.shape)) for name, p in module.named_parameters()),
        num_workers=num_workers,
        num_servers=num_servers,
        align=align,
        bucket_elements=bucket_elements,
    )


def parameter_views(layout: ShardLayout, flat: torch.Tensor) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like each parameter, in layout order."""
    if flat.dim() != 1 or flat.numel() != layout.total:
        raise LayoutError(
            f"flat buffer must be 1-D with {layout.total} elements, got shape {tuple(flat.shape)}"
        )
    return [flat[p.offset : p.offset + p.numel].view(p.shape) for p in layout.params]


def fragment_views(segment: Segment, buffer: torch.Tensor) -> list[torch.Tensor]:
    """Views of a segment-sized ``buffer`` covering each fragment, in order."""
    if buffer.dim() != 1 or buffer.numel() != segment.numel:
        raise LayoutError(
            f"segment {segment.segment_id} buffer must be 1-D with {segment.numel} elements, "
            f"got shape {tuple(buffer.shape)}"
        )
    return [buffer[f.segment_start : f.segment_start + f.length] for f in segment.fragments]


def _fragments(params: Sequence[ParamSlot], start: int, stop: int) -> Iterable[Fragment]:
    for index, slot in enumerate(params):
        lo = max(start, slot.offset)
        hi = min(stop, slot.offset + slot.numel)
        if lo < hi:
            yield Fragment(
                param_index=index,
                param_start=lo - slot.offset,
                segment_start=lo - start,
                length=hi - lo,
            )


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
