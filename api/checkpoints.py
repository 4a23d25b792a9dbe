"""OffloadedAdamW's state in the checkpoint format (:mod:`cargohold.services.checkpoint`).

Saving: every state server puts its segments' partition files into
``<root>/step-<updates>.partial`` (hard links from an NVMe tier, RAM partitions written
out), then the manifest is written last and the folder renamed: a checkpoint exists
complete or not at all, and the store keeps its ``keep_last``. Loading: the manifest is
read and checked against the optimizer's parameters, then each server restores its new
segments from the saved flat ranges that hold them, whatever number of servers saved
them (:mod:`cargohold.services.checkpoint.reshard`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cargohold.ranks import Shares
from cargohold.servers import StateServers
from cargohold.services.checkpoint import MANIFEST_NAME, CheckpointDir, Manifest, check_compatible
from cargohold.services.checkpoint.reshard import layout_record, saved_layout, segment_runs
from cargohold.services.core.errors import CheckpointError
from cargohold.services.core.layout import Layout
from cargohold.services.core.segment_spec import SegmentSpec


def save_checkpoint(servers: StateServers, layout: Layout, store: CheckpointDir, *, updates: int, options: Any) -> Path:
    """Write the servers' state after ``updates`` updates as checkpoint ``step-<updates>``
    of ``store``; returns its folder. ``options``: the groups' hyper-parameters as JSON
    data, kept in the manifest's ``config``."""
    directory = store.begin(updates)
    count = len(servers.addresses)
    try:
        began = servers.on_each("checkpoint_begin", [(servers.run_id, str(directory), updates)] * count)
        waited = servers.on_each("checkpoint_wait", [()] * count)
        if set(began) != {updates}:
            raise CheckpointError(f"the state servers are at updates {sorted(set(began))}, the optimizer at {updates}")
    except BaseException:
        store.abort(updates)
        raise
    records = [record for server_records, _ in waited for record in server_records]
    manifest = Manifest(
        step=updates,
        updates=updates,
        run_id=servers.run_id,
        config={"param_groups": json.loads(json.dumps(options))},  # tuples become lists
        model_signature=tuple((p.name, p.shape) for p in layout.params),
        layout=layout_record(layout),
        total=layout.total,
        segments=tuple(sorted((record for record, _ in records), key=lambda s: s.start)),
        files=tuple(file for _, file in records),
    )
    return store.commit(updates, manifest)


def read_checkpoint(path: Path, layout: Layout) -> Manifest:
    """The manifest of the complete checkpoint at ``path``, refused (naming the parameter)
    unless it holds exactly ``layout``'s parameters in their shapes."""
    path = CheckpointDir(path.parent).resolve(str(path))
    manifest = CheckpointDir(path.parent).load(path)
    check_compatible(manifest, model_signature=[(p.name, p.shape) for p in layout.params], align=layout.align)
    return manifest


def restore_checkpoint(
    servers: StateServers,
    layout: Layout,
    shares: Shares,
    specs: Sequence[SegmentSpec],
    path: Path,
    manifest: Manifest,
) -> None:
    """Create every segment of ``layout`` (``specs`` by segment id) on its server from the
    checkpoint at ``path``; the servers must hold none of them yet."""
    saved = saved_layout(manifest, str(path / MANIFEST_NAME))
    servers.on_each(
        "restore",
        [
            (
                str(path),
                manifest.to_json(),
                [
                    (specs[s.segment_id], segment_runs(saved, layout, s))
                    for s in layout.segments
                    if shares.server(s) == server
                ],
            )
            for server in range(len(servers.addresses))
        ],
    )
