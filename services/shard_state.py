"""What a state server knows about its shards, without any transport: registration,
idempotent gradient pushes keyed by (run, step, shard), and weight reads.

Every request is validated completely before any state changes, so a rejected request
leaves the shard exactly as it was.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

import torch

from cargohold.services.errors import (
    InvalidTensorError,
    ShardConflictError,
    StepMismatchError,
    UnknownShardError,
)
from cargohold.services.optim import AdamWHyperParams, clip_coefficient
from cargohold.services.tiers.residency import Residency
from cargohold.services.tiers.storage import TieredStorage

WIRE_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""Dtypes gradients and weights may travel in, by the name used in configs and the API."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardSpec:
    """Everything a server must know to own one segment of the flat parameter buffer."""

    run_id: str
    shard_id: int
    start: int
    """First element of the segment in the flat buffer (informational, for stats)."""
    numel: int
    fragments: tuple[tuple[int, int], ...]
    """(offset, length) of each run of real parameter elements inside the segment."""
    grad_dtype: str
    hyper: AdamWHyperParams

    def __post_init__(self) -> None:
        if not self.run_id:
            raise InvalidTensorError("run_id must not be empty")
        if self.numel <= 0:
            raise InvalidTensorError(f"shard {self.shard_id}: numel must be > 0, got {self.numel}")
        if self.grad_dtype not in WIRE_DTYPES:
            raise InvalidTensorError(
                f"shard {self.shard_id}: grad dtype {self.grad_dtype!r} is not one of "
                f"{sorted(WIRE_DTYPES)}"
            )
        end = 0
        for offset, length in self.fragments:
            if offset < end or length <= 0 or offset + length > self.numel:
                raise InvalidTensorError(
                    f"shard {self.shard_id}: fragment ({offset}, {length}) overlaps, is empty "
                    f"or leaves the segment of {self.numel} elements"
                )
            end = offset + length


@dataclass(frozen=True, slots=True)
class PushOutcome:
    applied: bool
    """False when the push repeated an already applied step and was ignored."""
    step: int
    seconds: float
    """Time spent in the update (0 for an ignored repeat)."""


class ShardState:
    """fp32 master weights and Adam moments of one segment, updated under a lock.

    The arrays live in a :class:`TieredStorage` (the server's, or a private all-RAM one),
    split into partitions there when a RAM budget is set. The clip coefficient and the
    step count are per shard: computed once per push, whatever the partitions.
    """

    def __init__(self, spec: ShardSpec, initial_weights: torch.Tensor, *,
                 storage: TieredStorage | None = None) -> None:
        _check_tensor(spec, initial_weights, torch.float32, "initial weights")
        self.spec = spec
        self.lock = threading.Lock()
        self._storage = storage if storage is not None else TieredStorage()
        self._storage.add_shard(spec.run_id, spec.shard_id, spec.numel, spec.fragments,
                                initial_weights.detach().contiguous())
        self._step = 0
        self._fetch_dtype: str | None = None
        """Dtype of the latest weight fetch: pushes prepare the weights in it."""
        self._prepared: tuple[int, str, torch.Tensor] | None = None
        """(step, dtype, weights) made during the latest push, until fetched once."""

    @property
    def step(self) -> int:
        """The number of updates applied; weights read now are those after this step."""
        return self._step

    @property
    def resident_bytes(self) -> int:
        """Bytes of this shard's state held in RAM."""
        return self._storage.state_bytes(self.spec.run_id, self.spec.shard_id)[Residency.RAM]

    def bytes_by_tier(self) -> dict[Residency, int]:
        return self._storage.state_bytes(self.spec.run_id, self.spec.shard_id)

    def push(self, step: int, gradient: torch.Tensor, *, global_norm: float, lr: float) -> PushOutcome:
        """Apply the gradient of ``step`` once; a repeat of the last step is ignored.

        If the update stops part-way (a corrupt partition file, a failed write) the error
        propagates and the shard stays at the previous step; pushing the same step again
        finishes the partitions that had not been updated.
        """
        _check_tensor(self.spec, gradient, WIRE_DTYPES[self.spec.grad_dtype], "gradient")
        if not (math.isfinite(lr) and lr >= 0.0):
            raise InvalidTensorError(f"shard {self.spec.shard_id}: lr must be finite and >= 0, got {lr}")
        if not (math.isfinite(global_norm) and global_norm >= 0.0):
            raise InvalidTensorError(
                f"shard {self.spec.shard_id}: global gradient norm must be finite and >= 0, "
                f"got {global_norm}"
            )
        with self.lock:
            current = self.step
            if step == current and step > 0:
                return PushOutcome(applied=False, step=current, seconds=0.0)
            if step != current + 1:
                raise StepMismatchError(
                    f"shard {self.spec.shard_id} of run {self.spec.run_id!r} is at step {current}; "
                    f"it accepts a gradient for step {current + 1}, got step {step}"
                )
            started = time.perf_counter()
            self._prepared = None
            dtype = self._fetch_dtype
            weights, _ = self._storage.update(
                self.spec.run_id, self.spec.shard_id, step, gradient,
                coefficient=clip_coefficient(global_norm, self.spec.hyper.max_grad_norm),
                lr=lr, hyper=self.spec.hyper,
                weights_dtype=WIRE_DTYPES[dtype] if dtype is not None else None,
            )
            self._step = step
            if weights is not None and dtype is not None:
                self._prepared = (step, dtype, weights)
            return PushOutcome(applied=True, step=step, seconds=time.perf_counter() - started)

    def weights(self, step: int, dtype: str) -> torch.Tensor:
        """A copy of the master weights after ``step``, in a wire dtype."""
        if dtype not in WIRE_DTYPES:
            raise InvalidTensorError(f"weight dtype {dtype!r} is not one of {sorted(WIRE_DTYPES)}")
        with self.lock:
            current = self.step
            if step != current:
                raise StepMismatchError(
                    f"shard {self.spec.shard_id} of run {self.spec.run_id!r} holds the weights "
                    f"of step {current}, not of step {step}"
                )
            self._fetch_dtype = dtype
            prepared, self._prepared = self._prepared, None
            if prepared is not None and prepared[:2] == (step, dtype):
                return prepared[2]
            return self._storage.read_weights(self.spec.run_id, self.spec.shard_id, step, WIRE_DTYPES[dtype])

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Copies of master, exp_avg and exp_avg_sq (for tests and checkpoints)."""
        with self.lock:
            return self._storage.snapshot(self.spec.run_id, self.spec.shard_id, self.step)


class ShardRegistry:
    """All shards a server owns, keyed by (run id, shard id), over one tiered storage."""

    def __init__(self, storage: TieredStorage | None = None) -> None:
        self._lock = threading.Lock()
        self._registering = threading.Lock()
        """Serialises registrations, which may write partition files, without holding
        ``_lock`` (and so every other shard's lookups) meanwhile."""
        self._shards: dict[tuple[str, int], ShardState] = {}
        self.storage = storage if storage is not None else TieredStorage()

    def register(self, spec: ShardSpec, initial_weights: torch.Tensor) -> ShardState:
        """Create the shard, or return it unchanged if registered with the same spec."""
        key = (spec.run_id, spec.shard_id)
        with self._registering:
            with self._lock:
                existing = self._shards.get(key)
            if existing is not None:
                if existing.spec != spec:
                    raise ShardConflictError(
                        f"shard {spec.shard_id} of run {spec.run_id!r} is already registered "
                        "with a different specification"
                    )
                return existing
            state = ShardState(spec, initial_weights, storage=self.storage)
            with self._lock:
                self._shards[key] = state
            return state

    def get(self, run_id: str, shard_id: int) -> ShardState:
        with self._lock:
            state = self._shards.get((run_id, shard_id))
        if state is None:
            raise UnknownShardError(f"no shard {shard_id} is registered for run {run_id!r}")
        return state

    def shards(self, run_id: str | None = None) -> list[ShardState]:
        with self._lock:
            return [s for (run, _), s in self._shards.items() if run_id in (None, run)]

    def resident_bytes(self) -> int:
        """Bytes of optimizer state held in RAM, over every shard."""
        return self.storage.state_bytes()[Residency.RAM]

    def bytes_by_tier(self) -> dict[str, int]:
        """Bytes of optimizer state in each tier ("ram", and "nvme" when one is configured)."""
        totals = self.storage.state_bytes()
        return {r.value: n for r, n in totals.items() if r is Residency.RAM or self.storage.enabled}

    def close(self) -> None:
        """Stop the storage's I/O and delete this server's partition files."""
        self.storage.close()


def _check_tensor(spec: ShardSpec, tensor: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    if tensor.dtype != dtype:
        raise InvalidTensorError(
            f"shard {spec.shard_id}: {what} must be {dtype}, got {tensor.dtype}"
        )
    if tensor.dim() != 1 or tensor.numel() != spec.numel:
        raise InvalidTensorError(
            f"shard {spec.shard_id}: {what} must have {spec.numel} elements, "
            f"got shape {tuple(tensor.shape)}"
        )
