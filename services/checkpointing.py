"""A state server's side of checkpoints: write its shards' state into a checkpoint's
partial directory, and restore shards from a complete checkpoint — cut the way the new
layout needs, whatever layout wrote it.

With every shard in RAM, ``begin`` only takes copies (the stall) and a background thread
writes them while training goes on. With an NVMe tier, copying everything would break
the RAM budget, so ``begin`` writes shard by shard before returning.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from cargohold.services.checkpoint import FileRecord, Manifest, ShardRecord, read_flat_range, write_shard_file
from cargohold.services.errors import CheckpointError
from cargohold.services.shard_state import ShardRegistry, ShardSpec

ARRAYS = ("master", "exp_avg", "exp_avg_sq")


class ShardCheckpointer:
    def __init__(self, registry: ShardRegistry, server_index: int) -> None:
        self._registry = registry
        self._server_index = server_index
        self._thread: threading.Thread | None = None
        self._result: list[tuple[ShardRecord, FileRecord]] | BaseException | None = None

    def begin(self, run_id: str, directory: str, step: int) -> int:
        """Start writing every shard of ``run_id`` as of data step ``step``; returns the
        update count they are at (lower than ``step`` when steps were skipped)."""
        if self._thread is not None:
            raise CheckpointError("a checkpoint is still being written; wait for it first")
        shards = self._registry.shards(run_id)
        updates = {s.step for s in shards}
        if len(updates) > 1:
            raise CheckpointError(f"shards of run {run_id!r} are at different updates {sorted(updates)}")
        update = updates.pop() if updates else 0
        self._result = None
        if self._registry.storage.enabled:
            self._result = self._write(directory, step, ((s.spec, s.snapshot()) for s in shards))
        else:
            copies = [(s.spec, s.snapshot()) for s in shards]
            self._thread = threading.Thread(
                target=lambda: setattr(self, "_result", self._write(directory, step, copies)),
                name="checkpoint-writer", daemon=True,
            )
            self._thread.start()
        return update

    def wait(self) -> list[tuple[ShardRecord, FileRecord]]:
        """The records of the files written by the last ``begin``; raises its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        result, self._result = self._result, None
        if isinstance(result, BaseException):
            raise result
        if result is None:
            raise CheckpointError("no checkpoint was begun")
        return result

    def _write(self, directory: str, step: int, shards) -> list[tuple[ShardRecord, FileRecord]] | BaseException:
        try:
            records = []
            for spec, tensors in shards:
                name = f"server{self._server_index}-shard{spec.shard_id:06d}.bin"
                file = write_shard_file(Path(directory), name, step=step, start=spec.start,
                                        tensors={k: tensors[k] for k in ARRAYS})
                records.append((ShardRecord(segment_id=spec.shard_id, start=spec.start,
                                            stop=spec.start + spec.numel, step=step, file=name), file))
            return records
        except BaseException as error:  # handed to wait(), which raises it in the caller
            return error

    def restore(self, directory: str, manifest: Manifest, specs: list[ShardSpec], update: int) -> None:
        """Register ``specs`` with the state the checkpoint holds for their flat ranges;
        elements past the checkpoint's buffer (more padding in the new layout) are zero."""
        for spec in specs:
            stop = spec.start + spec.numel
            tensors = {k: torch.zeros(spec.numel, dtype=torch.float32) for k in ARRAYS}
            covered = min(stop, manifest.total)
            if covered > spec.start:
                read = read_flat_range(Path(directory), manifest, spec.start, covered)
                for key in ARRAYS:
                    tensors[key][: covered - spec.start] = read[key]
            self._registry.restore(spec, tensors, update)
