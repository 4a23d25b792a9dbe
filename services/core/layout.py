"""The layout: where every parameter element lives in the flat space, which worker holds
it (FSDP2's dim-0 shards) and which state server owns its Adam state.

Pure arithmetic on sizes; no tensors are touched except by :func:`scatter_params` and
:func:`gather_params`.

Workers shard each parameter the way FSDP2's ``fully_shard`` does: along dim 0, in
``num_workers`` chunks of ``ceil(rows / num_workers)`` rows (the last chunks shorter or
empty). Parameters come in *units*, what ``fully_shard`` wraps (a transformer block,
or the root's remaining parameters), whose gradients are reduced together; a unit's
parameters are consecutive in layout order.

The flat space is *worker-major*: worker w's range ``[w * worker_size, (w+1) *
worker_size)`` holds, unit by unit, the padded dim-0 chunk of each parameter that w
holds, each at a multiple of ``align``; where a parameter's padded chunk lies is its *chunk
place*. Every worker's range has the same size and the same chunk places, so a chunk place
is one number per parameter.
A worker's gradients and weights for one unit are therefore one contiguous range (the
unit's :class:`UnitRange`).

The flat space is cut, independently, into ``num_servers`` contiguous server ranges at
multiples of ``align``. A *segment* is the non-empty intersection of one unit's range of
one worker with one server range: what a worker pushes and fetches and a server
registers. Every element belongs to exactly one segment.

With a *device fraction* f (``worker.optimizer_on_device_fraction``) the first
``f`` of each unit's range of each worker (rounded to ``align``) is a *device segment*:
its Adam state lives with the worker itself, on its device, and is updated there
(``server`` is :data:`DEVICE`); only the rest is cut by the server ranges. The flat space,
and so every checkpoint's offsets, does not depend on f. Segments of a worker on a
server whose range covers it are all that worker ever talks to, so with one server per
node and ranks numbered node by node, a worker's traffic stays on its node.

Why align: the fused AdamW kernel runs a vector loop with a scalar tail, which round
differently in rare cases. Cutting a padded chunk only at multiples of ``align`` from its start
keeps every element on the code path ``torch.optim.AdamW(fused=True)`` takes over the
worker's local shard (FSDP2's reference) — bitwise equality depends on it.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from cargohold.services.core.errors import LayoutError

DEVICE = -1
"""The ``server`` of a device segment: the worker owns its state."""

DEFAULT_ALIGN = 64
"""Elements; 256 bytes of fp32, a multiple of every SIMD width and of a cache line."""

NamedShape = tuple[str, Sequence[int]]


@dataclass(frozen=True, slots=True)
class ChunkPlace:
    """One parameter: its shape, its unit and its chunk place, where its padded chunk lies in
    every worker's range (the same offset in each)."""

    name: str
    shape: tuple[int, ...]
    unit: int
    """Index of its unit in :attr:`Layout.units`."""
    offset: int
    """First element of the padded chunk inside each worker's range (a multiple of ``align``)."""
    rows_per_worker: int
    """Rows of dim 0 in each worker's chunk (FSDP2: ``ceil(rows / num_workers)``)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def row_numel(self) -> int:
        """Elements of one dim-0 row."""
        return math.prod(self.shape[1:])

    @property
    def padded_numel(self) -> int:
        """The padded chunk's size: what each worker's range reserves for the parameter."""
        return self.rows_per_worker * self.row_numel

    def local_rows(self, worker: int) -> tuple[int, int]:
        """The half-open dim-0 rows ``worker`` holds (empty past the last row)."""
        lo = min(self.rows, worker * self.rows_per_worker)
        return lo, min(self.rows, lo + self.rows_per_worker)

    def local_numel(self, worker: int) -> int:
        lo, hi = self.local_rows(worker)
        return (hi - lo) * self.row_numel


@dataclass(frozen=True, slots=True)
class UnitRange:
    """One unit (what ``fully_shard`` wraps: parameters reduced together) as the layout
    places it: its parameters ``params[first_param:stop_param]`` and the range ``[start,
    stop)`` their chunk places fill inside each worker's range (the same in every worker's range).
    ``sharding.Unit`` is the same unit seen from the model: its module and parameter names."""

    index: int
    """Its place in :attr:`Layout.units` (layout order: the root first)."""
    name: str
    first_param: int
    stop_param: int
    start: int
    """Range inside each worker's range: ``[start, stop)``."""
    stop: int


@dataclass(frozen=True, slots=True)
class Fragment:
    """A run of real parameter elements inside a segment (padding excluded)."""

    param_index: int
    param_start: int
    """Offset inside the flattened (whole) parameter."""
    segment_start: int
    """Offset inside the segment."""
    length: int


@dataclass(frozen=True, slots=True)
class Segment:
    """The elements ``[start, stop)`` of unit ``unit`` that worker ``worker`` pushes to
    server ``server`` (:data:`DEVICE`: that the worker updates on its own device)."""

    segment_id: int
    unit: int
    worker: int
    server: int
    start: int
    stop: int
    local_offset: int
    """Where the segment begins inside its worker's range."""
    fragments: tuple[Fragment, ...]

    @property
    def numel(self) -> int:
        return self.stop - self.start

    @property
    def on_device(self) -> bool:
        """Whether the worker owns this segment's state (a device segment)."""
        return self.server == DEVICE


@dataclass(frozen=True, slots=True)
class Layout:
    """The complete placement of a model's parameters over workers and servers."""

    params: tuple[ChunkPlace, ...]
    units: tuple[UnitRange, ...]
    total: int
    """Length of the flat space: ``num_workers * worker_size``."""
    worker_size: int
    num_workers: int
    num_servers: int
    align: int
    server_bounds: tuple[int, ...]
    """``num_servers + 1`` cut points; server ``s`` owns ``[bounds[s], bounds[s+1])``
    but the device segments in it."""
    segments: tuple[Segment, ...]
    device_fraction: float = 0.0
    """The share of each unit's range of each worker that is a device segment."""

    def worker_range(self, worker: int) -> tuple[int, int]:
        self._check_index("worker", worker, self.num_workers)
        return worker * self.worker_size, (worker + 1) * self.worker_size

    def server_range(self, server: int) -> tuple[int, int]:
        """The half-open range of the flat space whose Adam state ``server`` owns."""
        self._check_index("server", server, self.num_servers)
        return self.server_bounds[server], self.server_bounds[server + 1]

    def segments_of_worker(self, worker: int) -> tuple[Segment, ...]:
        self._check_index("worker", worker, self.num_workers)
        return tuple(s for s in self.segments if s.worker == worker)

    def segments_of_server(self, server: int) -> tuple[Segment, ...]:
        self._check_index("server", server, self.num_servers)
        return tuple(s for s in self.segments if s.server == server)

    def device_segments(self, worker: int) -> tuple[Segment, ...]:
        """The segments whose state worker ``worker`` holds and updates itself."""
        self._check_index("worker", worker, self.num_workers)
        return tuple(s for s in self.segments if s.worker == worker and s.on_device)

    def unit_params(self, unit: int) -> tuple[ChunkPlace, ...]:
        """The parameters of unit ``unit``, in layout order."""
        placed = self.units[unit]
        return self.params[placed.first_param : placed.stop_param]

    @property
    def largest_unit(self) -> int:
        """Elements of the largest unit inside a worker's range (an exchange slot's size)."""
        return max((u.stop - u.start for u in self.units), default=0)

    @property
    def num_real_elements(self) -> int:
        return sum(p.numel for p in self.params)

    def param_runs(self, start: int, stop: int) -> list[tuple[int, int, int, int]]:
        """Real parameter elements in flat ``[start, stop)``: ``(param_index,
        param_start, flat_start, length)`` runs in flat order (padding skipped)."""
        runs = []
        first = max(0, start // self.worker_size)
        for worker in range(first, self.num_workers):
            base = worker * self.worker_size
            if base >= stop:
                break
            for index, place in enumerate(self.params):
                lo = max(start, base + place.offset)
                hi = min(stop, base + place.offset + place.local_numel(worker))
                if lo < hi:
                    chunk_start = place.local_rows(worker)[0] * place.row_numel
                    runs.append((index, chunk_start + lo - base - place.offset, lo, hi - lo))
        return runs

    def flat_runs(self, param_index: int, start: int, length: int) -> list[tuple[int, int, int]]:
        """Where elements ``[start, start + length)`` of flattened parameter
        ``param_index`` lie: ``(flat_start, param_start, length)`` runs."""
        place = self.params[param_index]
        runs = []
        chunk = place.padded_numel
        stop = start + length
        for worker in range(start // chunk if chunk else 0, self.num_workers):
            lo, hi = max(start, worker * chunk), min(stop, (worker + 1) * chunk, place.numel)
            if lo >= hi:
                break
            runs.append((worker * self.worker_size + place.offset + lo - worker * chunk, lo, hi - lo))
        return runs

    @staticmethod
    def _check_index(kind: str, index: int, count: int) -> None:
        if not 0 <= index < count:
            raise LayoutError(f"{kind} index {index} is outside 0..{count - 1}")


def build_layout(
    named_shapes: Iterable[NamedShape],
    *,
    num_workers: int,
    num_servers: int,
    align: int = DEFAULT_ALIGN,
    unit_sizes: Sequence[int] | None = None,
    unit_names: Sequence[str] | None = None,
    device_fraction: float = 0.0,
) -> Layout:
    """Place parameters (in the given order) in units of ``unit_sizes`` consecutive
    parameters (None: one unit of all) and split the space over workers and servers,
    ``device_fraction`` of each unit's range of each worker (rounded to ``align``) to
    the worker itself."""
    _check_counts(num_workers, num_servers, align, device_fraction)
    shapes = _shapes(named_shapes)
    sizes = list(unit_sizes) if unit_sizes is not None else [len(shapes)]
    if any(size < 0 for size in sizes) or sum(sizes) != len(shapes):
        raise LayoutError(f"unit sizes {sizes} do not add up to the {len(shapes)} parameters")
    names = list(unit_names) if unit_names is not None else [f"unit{i}" for i in range(len(sizes))]
    if len(names) != len(sizes):
        raise LayoutError(f"{len(names)} unit names for {len(sizes)} units")
    params, units, worker_size = _place(shapes, sizes, names, num_workers, align)
    server_bounds = _server_bounds(worker_size * num_workers, num_servers, align)
    return Layout(
        params=params,
        units=units,
        total=worker_size * num_workers,
        worker_size=worker_size,
        num_workers=num_workers,
        num_servers=num_servers,
        align=align,
        server_bounds=server_bounds,
        segments=_cut_segments(params, units, num_workers, worker_size, server_bounds, align, device_fraction),
        device_fraction=device_fraction,
    )


def _check_counts(num_workers: int, num_servers: int, align: int, device_fraction: float) -> None:
    """Refuse counts that place nothing, and a device fraction outside [0, 1]."""
    if num_workers < 1:
        raise LayoutError(f"num_workers must be >= 1, got {num_workers}")
    if num_servers < 1:
        raise LayoutError(f"num_servers must be >= 1, got {num_servers}")
    if align < 1:
        raise LayoutError(f"align must be >= 1, got {align}")
    if not 0.0 <= device_fraction <= 1.0:
        raise LayoutError(f"the device fraction must be in [0, 1], got {device_fraction}")


def _shapes(named_shapes: Iterable[NamedShape]) -> list[tuple[str, tuple[int, ...]]]:
    """The shapes as tuples of ints, none with a negative dimension."""
    shapes = [(name, tuple(int(d) for d in shape)) for name, shape in named_shapes]
    for name, shape in shapes:
        if any(d < 0 for d in shape):
            raise LayoutError(f"parameter {name!r} has a negative dimension: {shape}")
    return shapes


def _place(
    shapes: Sequence[tuple[str, tuple[int, ...]]],
    sizes: Sequence[int],
    names: Sequence[str],
    num_workers: int,
    align: int,
) -> tuple[tuple[ChunkPlace, ...], tuple[UnitRange, ...], int]:
    """Each parameter's chunk place and each unit's range inside a worker's range, and
    that range's size: chunk places one after another, each at a multiple of ``align``."""
    params: list[ChunkPlace] = []
    units: list[UnitRange] = []
    offset = 0
    for unit_index, (unit_name, size) in enumerate(zip(names, sizes)):
        first, unit_start = len(params), offset
        for name, shape in shapes[first : first + size]:
            rows = shape[0] if shape else 1
            place = ChunkPlace(
                name=name, shape=shape, unit=unit_index, offset=offset, rows_per_worker=-(-rows // num_workers)
            )
            params.append(place)
            offset += _round_up(place.padded_numel, align)
        units.append(
            UnitRange(
                index=unit_index,
                name=unit_name,
                first_param=first,
                stop_param=len(params),
                start=unit_start,
                stop=offset,
            )
        )
    if not params or sum(p.numel for p in params) == 0:
        raise LayoutError("the model has no parameter elements to place")
    return tuple(params), tuple(units), offset


def _server_bounds(total: int, num_servers: int, align: int) -> tuple[int, ...]:
    """``num_servers + 1`` cut points of a flat space of ``total`` elements, at multiples
    of ``align``, the servers' ranges as even as that allows."""
    spans = total // align  # of align elements each
    if spans < num_servers:
        raise LayoutError(
            f"{num_servers} servers cannot each own at least {align} of {total} elements; use fewer state servers"
        )
    return tuple(align * ((spans * s) // num_servers) for s in range(num_servers + 1))


def _cut_segments(
    params: Sequence[ChunkPlace],
    units: Sequence[UnitRange],
    num_workers: int,
    worker_size: int,
    server_bounds: Sequence[int],
    align: int,
    device_fraction: float,
) -> tuple[Segment, ...]:
    """Every segment, numbered worker by worker and unit by unit."""
    placed = [unit for unit in units if unit.start < unit.stop]  # an empty unit has no segment
    segments: list[Segment] = []
    for worker in range(num_workers):
        base = worker * worker_size
        for unit in placed:
            places = params[unit.first_param : unit.stop_param]
            cuts = _cuts(base + unit.start, base + unit.stop, server_bounds, align, device_fraction)
            for server, start, stop in cuts:
                segments.append(
                    Segment(
                        segment_id=len(segments),
                        unit=unit.index,
                        worker=worker,
                        server=server,
                        start=start,
                        stop=stop,
                        local_offset=start - base,
                        fragments=tuple(_fragments(places, unit.first_param, worker, start - base, stop - base)),
                    )
                )
    return tuple(segments)


def _cuts(
    lo: int, hi: int, server_bounds: Sequence[int], align: int, device_fraction: float
) -> Iterator[tuple[int, int, int]]:
    """``(server, start, stop)`` of the segments of one unit's flat range ``[lo, hi)`` of
    one worker: its device segment first (``device_fraction`` of it, rounded to ``align``),
    then the rest cut by the server ranges it meets."""
    on_device = align * round(device_fraction * (hi - lo) / align)
    if on_device:
        yield DEVICE, lo, lo + on_device
    lo += on_device
    # only the servers whose ranges meet the rest: the loop is as long as its output,
    # whatever the counts of workers and servers
    first_server = max(0, bisect.bisect_right(server_bounds, lo) - 1)
    for server in range(first_server, len(server_bounds) - 1):
        if server_bounds[server] >= hi:
            break
        start, stop = max(lo, server_bounds[server]), min(hi, server_bounds[server + 1])
        if start < stop:
            yield server, start, stop


def scatter_params(
    layout: Layout,
    tensors: Mapping[str, torch.Tensor] | Sequence[torch.Tensor],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The flat space holding ``tensors`` (by name, or in layout order); padding zero."""
    values = _in_layout_order(layout, tensors)
    flat = torch.zeros(layout.total, dtype=dtype)
    for index, value in enumerate(values):
        source = value.detach().reshape(-1)
        for flat_start, param_start, length in layout.flat_runs(index, 0, layout.params[index].numel):
            flat[flat_start : flat_start + length].copy_(source[param_start : param_start + length])
    return flat


def gather_params(layout: Layout, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each parameter, whole and shaped, copied out of the flat space ``flat``."""
    if flat.dim() != 1 or flat.numel() != layout.total:
        raise LayoutError(f"flat space must be 1-D with {layout.total} elements, got shape {tuple(flat.shape)}")
    out = {}
    for index, place in enumerate(layout.params):
        value = torch.empty(place.numel, dtype=flat.dtype)
        for flat_start, param_start, length in layout.flat_runs(index, 0, place.numel):
            value[param_start : param_start + length] = flat[flat_start : flat_start + length]
        out[place.name] = value.view(place.shape)
    return out


def fragment_views(segment: Segment, buffer: torch.Tensor) -> list[torch.Tensor]:
    """Views of a segment-sized ``buffer`` covering each fragment, in order."""
    if buffer.dim() != 1 or buffer.numel() != segment.numel:
        raise LayoutError(
            f"segment {segment.segment_id} buffer must be 1-D with {segment.numel} elements, "
            f"got shape {tuple(buffer.shape)}"
        )
    return [buffer[f.segment_start : f.segment_start + f.length] for f in segment.fragments]


def _in_layout_order(layout: Layout, tensors: Mapping[str, torch.Tensor] | Sequence[torch.Tensor]) -> list:
    if isinstance(tensors, Mapping):
        missing = [p.name for p in layout.params if p.name not in tensors]
        if missing:
            raise LayoutError(f"no tensor for parameters {missing[:5]}")
        values = [tensors[p.name] for p in layout.params]
    else:
        values = list(tensors)
    if len(values) != len(layout.params):
        raise LayoutError(f"{len(values)} tensors for {len(layout.params)} parameters")
    for place, value in zip(layout.params, values):
        if tuple(value.shape) != place.shape:
            raise LayoutError(f"parameter {place.name!r} has shape {place.shape}, got {tuple(value.shape)}")
    return values


def _fragments(
    params: Sequence[ChunkPlace], first_index: int, worker: int, start: int, stop: int
) -> Iterable[Fragment]:
    """Fragments of the worker-range offsets ``[start, stop)``."""
    for index, place in enumerate(params, start=first_index):
        lo = max(start, place.offset)
        hi = min(stop, place.offset + place.local_numel(worker))
        if lo < hi:
            chunk_start = place.local_rows(worker)[0] * place.row_numel
            yield Fragment(
                param_index=index, param_start=chunk_start + lo - place.offset, segment_start=lo - start, length=hi - lo
            )


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
