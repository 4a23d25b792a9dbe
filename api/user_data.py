"""A user's data as a worker's batches: a map-style dataset, an iterable dataset or a
batch function, each read the same way by every process and every attempt, so that a
resumed run (or a single-process reference) gets exactly what rank r got at step s.

- **Map-style** (``__len__`` and ``__getitem__``): the rows of all steps, one after the
  other, are the dataset's indices in a seeded permutation per epoch (a pure function of
  seed and row). A step takes ``micro_batches x W x batch_size`` rows; rank r's micro-batch
  m is rows ``[(m * W + r) * B, ... + B)`` of it (:class:`~cargohold.services.data.batches.BatchShape`).
  Items are collated with ``torch.utils.data.default_collate`` unless ``collate`` is given.
- **Iterable** (``__iter__`` only): its items in order, numbered as the rows above; every
  rank reads the stream and keeps its own rows, never another's. A resumed run reads the
  stream again from the start up to its step (the stream must be deterministic).
- **A batch function** ``fn(step, rank, micro)`` (step 1-based): called as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import default_collate

from cargohold.services.core.errors import ConfigError, TrainingError
from cargohold.services.data.batches import BatchShape

Collate = Callable[[list[Any]], Any]
BatchFunction = Callable[[int, int, int], Any]


@dataclass(frozen=True, slots=True)
class UserBatch:
    """One rank's micro-batch as the user's loss takes it. Every batch weighs the same:
    the step's loss is the mean of the ranks' and micro-batches' mean losses."""

    data: Any
    weight: float = 1.0


def to_device(data: Any, device: torch.device) -> Any:
    """``data`` with every tensor in it (nested in dicts, lists, tuples) on ``device``."""
    if isinstance(data, torch.Tensor):
        return data.to(device)
    if isinstance(data, dict):
        return {key: to_device(value, device) for key, value in data.items()}
    if isinstance(data, list | tuple):
        moved = [to_device(value, device) for value in data]
        return type(data)(*moved) if hasattr(data, "_fields") else type(data)(moved)
    return data


def is_map_style(data: Any) -> bool:
    return hasattr(data, "__getitem__") and hasattr(data, "__len__")


def open_user_data(data: Any, shape: BatchShape, *, seed: int, collate: Collate | None = None) -> Any:
    """The :class:`~cargohold.services.data.batches.DataSource` of ``data`` (see the module
    docstring). ConfigError, before anything trains, for data that cannot fill one step."""
    collate = collate or default_collate
    if is_map_style(data):
        return MapStyleBatches(data, shape, seed=seed, collate=collate)
    if hasattr(data, "__iter__"):
        if iter(data) is data:
            raise ConfigError(
                f"data is an iterator ({type(data).__name__}), which can be read once only; pass an object whose "
                "__iter__ starts the stream over (a torch IterableDataset), so that every worker and a resumed "
                "run can read it"
            )
        return IterableBatches(data, shape, collate=collate)
    if callable(data):
        return FunctionBatches(data, shape)
    raise ConfigError(
        f"data must be a map-style dataset (__len__, __getitem__), an iterable dataset or a function "
        f"(step, rank, micro) -> batch; got {type(data).__name__}"
    )


def _first_row(shape: BatchShape, step: int, rank: int, micro: int) -> int:
    """The first of the rows, numbered across all steps, that ``(step, rank, micro)`` takes."""
    return (step - 1) * shape.rows + shape.rows_of(rank, micro).start


def _check_fills_a_step(holds: str, count: int, shape: BatchShape) -> None:
    if count < shape.rows:
        raise ConfigError(
            f"{holds}, fewer than one step's global batch: micro_batches {shape.micro_batches} x workers "
            f"{shape.world_size} x batch_size {shape.batch_size} = {shape.rows}"
        )


class MapStyleBatches:
    def __init__(self, dataset: Any, shape: BatchShape, *, seed: int, collate: Collate) -> None:
        self.shape = shape
        self._dataset, self._seed, self._collate = dataset, seed, collate
        self._size = len(dataset)
        _check_fills_a_step(f"the dataset holds {self._size} items", self._size, shape)
        self._epoch: tuple[int, torch.Tensor] | None = None

    def batch(self, step: int, rank: int, micro: int = 0) -> UserBatch:
        first = _first_row(self.shape, step, rank, micro)
        items = [self._dataset[self._index(row)] for row in range(first, first + self.shape.batch_size)]
        return UserBatch(self._collate(items))

    def _index(self, row: int) -> int:
        epoch, at = divmod(row, self._size)
        if self._epoch is None or self._epoch[0] != epoch:
            generator = torch.Generator().manual_seed(self._seed * 1_000_003 + epoch)
            self._epoch = (epoch, torch.randperm(self._size, generator=generator))
        return int(self._epoch[1][at])


class IterableBatches:
    def __init__(self, dataset: Any, shape: BatchShape, *, collate: Collate) -> None:
        self.shape = shape
        self._dataset, self._collate = dataset, collate
        self._stream: Iterator[Any] | None = None
        self._position = 0
        """The row the stream yields next."""
        available = sum(1 for _ in zip(range(shape.rows), iter(dataset), strict=False))
        _check_fills_a_step(f"the iterable dataset yields {available} items", available, shape)

    def batch(self, step: int, rank: int, micro: int = 0) -> UserBatch:
        first = _first_row(self.shape, step, rank, micro)
        if self._stream is None or first < self._position:
            self._stream, self._position = iter(self._dataset), 0
        for _ in range(first - self._position):
            self._next(step)
        items = [self._next(step) for _ in range(self.shape.batch_size)]
        return UserBatch(self._collate(items))

    def _next(self, step: int) -> Any:
        assert self._stream is not None
        try:
            item = next(self._stream)
        except StopIteration:
            raise TrainingError(
                f"the iterable dataset ended after {self._position} items; step {step} needs more "
                f"({self.shape.rows} a step): lower steps or make the stream longer"
            ) from None
        self._position += 1
        return item


class FunctionBatches:
    def __init__(self, function: BatchFunction, shape: BatchShape) -> None:
        self.shape = shape
        self._function = function

    def batch(self, step: int, rank: int, micro: int = 0) -> UserBatch:
        return UserBatch(self._function(step, rank, micro))


class HeldOutBatches:
    """A map-style held-out dataset in order: batch i of rank r is items
    ``[(i * W + r) * B, ... + B)``, the dataset's whole batches (or the first ``max_batches``)."""

    def __init__(
        self, dataset: Any, *, world_size: int, batch_size: int, max_batches: int | None, collate: Collate | None
    ) -> None:
        if not is_map_style(dataset):
            raise ConfigError(f"eval_data must be a map-style dataset (__len__, __getitem__), got {type(dataset)}")
        available = len(dataset) // (world_size * batch_size)
        if available == 0:
            raise ConfigError(
                f"eval_data holds {len(dataset)} items, fewer than one eval batch: workers {world_size} x "
                f"batch_size {batch_size}"
            )
        self.num_batches = min(available, max_batches or available)
        self._dataset, self._world, self._size = dataset, world_size, batch_size
        self._collate = collate or default_collate

    def batch(self, index: int, rank: int) -> UserBatch:
        first = (index * self._world + rank) * self._size
        return UserBatch(self._collate([self._dataset[i] for i in range(first, first + self._size)]))
