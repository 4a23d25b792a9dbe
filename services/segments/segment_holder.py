"""What the launcher asks of every process that holds segments' state: a state server,
and a worker for its device segments (``worker.optimizer_on_device_fraction``). The same
calls read the state (tests, export) and save and restore it in checkpoints, so a
checkpoint holds every segment whoever updated it."""

from __future__ import annotations

import torch

from cargohold.services.checkpoint import MANIFEST_NAME, FileRecord, Manifest, SegmentRecord
from cargohold.services.checkpoint.reshard import Run
from cargohold.services.checkpoint.writer import SegmentCheckpointer
from cargohold.services.core.segment_spec import SegmentSpec
from cargohold.services.core.settlement import HolderStanding
from cargohold.services.core.update_call import CommitTerms
from cargohold.services.segments.segment_registry import SegmentRegistry


class SegmentHolder:
    """Reads, saves and restores the segments of ``registry``; ``owner`` names its
    checkpoint files ("server0", "worker1")."""

    def __init__(self, registry: SegmentRegistry, owner: str) -> None:
        self.registry = registry
        self._checkpointer = SegmentCheckpointer(registry, owner)

    def snapshot(self, run_id: str) -> dict[int, dict[str, torch.Tensor]]:
        """Copies of every segment's fp32 state for a run, by segment id (tests)."""
        return {
            s.spec.segment_id: {**s.snapshot(), "step": torch.tensor(s.updates)} for s in self.registry.segments(run_id)
        }

    def masters(self, run_id: str) -> dict[int, torch.Tensor]:
        """fp32 master weights of every segment of a run, by segment id (export): read a
        partition at a time from the tiers, without the moments."""
        return {s.spec.segment_id: s.master_weights() for s in self.registry.segments(run_id)}

    def standing(self, run_id: str) -> HolderStanding:
        """Where the segments of ``run_id`` stand, for settling a step a lost worker left
        part-way (:func:`~cargohold.services.core.settlement.settle`)."""
        segments, newest = [], None
        for state in self.registry.segments(run_id):
            segment, terms = state.standing()
            segments.append(segment)
            if terms is not None and (newest is None or segment.updates > newest[0]):
                newest = (segment.updates, terms)
        return HolderStanding(tuple(segments), newest)

    def finish_update(self, run_id: str, update: int, terms: CommitTerms) -> int:
        """Commit the gradient staged for ``update`` on each segment of ``run_id`` still
        one update behind, with ``terms`` (those the other segments applied it with);
        returns how many it committed."""
        behind = [s for s in self.registry.segments(run_id) if s.updates == update - 1]
        for state in behind:
            state.commit(update, global_norm=terms.global_norm, lr=terms.lr, loss_scale=terms.loss_scale)
        return len(behind)

    def checkpoint_begin(self, run_id: str, directory: str, step: int) -> int:
        """Start writing the segments of ``run_id`` into ``directory``; returns their update count."""
        return self._checkpointer.begin(run_id, directory, step)

    def checkpoint_wait(self) -> tuple[list[tuple[SegmentRecord, FileRecord]], int]:
        """The records of the files written, and how many of their bytes are hard links."""
        return self._checkpointer.wait(), self._checkpointer.linked_bytes

    def restore(self, directory: str, manifest_json: str, segments: list[tuple[SegmentSpec, tuple[Run, ...]]]) -> None:
        """Create each spec from the checkpoint in ``directory``, reading the saved flat
        elements its runs name (:func:`~cargohold.services.checkpoint.reshard.segment_runs`)."""
        manifest = Manifest.from_json(manifest_json, source=f"{directory}/{MANIFEST_NAME}")
        self._checkpointer.restore(directory, manifest, segments)
