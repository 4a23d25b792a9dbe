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
from cargohold.services.optim import AdamWHyperParams, AdamWState, adamw_step

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
    """fp32 master weights and Adam moments of one segment, updated under a lock."""

    def __init__(self, spec: ShardSpec, initial_weights: torch.Tensor) -> None:
        _check_tensor(spec, initial_weights, torch.float32, "initial weights")
        self.spec = spec
        self.lock = threading.Lock()
        self._master = initial_weights.detach().clone().contiguous()
        self._exp_avg = torch.zeros_like(self._master)
        self._exp_avg_sq = torch.zeros_like(self._master)
        self._adam = AdamWState(
            master=self._views(self._master),
            exp_avg=self._views(self._exp_avg),
            exp_avg_sq=self._views(self._exp_avg_sq),
            step=torch.tensor(0.0, dtype=torch.float32),
        )

    @property
    def step(self) -> int:
        """The number of updates applied; weights read now are those after this step."""
        return int(self._adam.step.item())

    @property
    def resident_bytes(self) -> int:
        return 3 * self._master.numel() * self._master.element_size()

    def push(self, step: int, gradient: torch.Tensor, *, global_norm: float, lr: float) -> PushOutcome:
        """Apply the gradient of ``step`` once; a repeat of the last step is ignored."""
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
            grad32 = gradient.to(torch.float32, copy=True).contiguous()
            adamw_step(
                self._adam,
                self._views(grad32),
                lr=lr,
                hyper=self.spec.hyper,
                global_norm=global_norm,
            )
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
            return self._master.to(WIRE_DTYPES[dtype], copy=True)

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Copies of master, exp_avg and exp_avg_sq (for tests and checkpoints)."""
        with self.lock:
            return {
                "master": self._master.clone(),
                "exp_avg": self._exp_avg.clone(),
                "exp_avg_sq": self._exp_avg_sq.clone(),
            }

    def _views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        return [buffer[offset : offset + length] for offset, length in self.spec.fragments]


class ShardRegistry:
    """All shards a server owns, keyed by (run id, shard id)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._shards: dict[tuple[str, int], ShardState] = {}

    def register(self, spec: ShardSpec, initial_weights: torch.Tensor) -> ShardState:
        """Create the shard, or return it unchanged if registered with the same spec."""
        key = (spec.run_id, spec.shard_id)
        with self._lock:
            existing = self._shards.get(key)
            if existing is not None:
                if existing.spec != spec:
                    raise ShardConflictError(
                        f"shard {spec.shard_id} of run {spec.run_id!r} is already registered "
                        "with a different specification"
                    )
                return existing
            state = ShardState(spec, initial_weights)
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
        return sum(s.resident_bytes for s in self.shards())


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
