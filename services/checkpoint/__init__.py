"""Checkpoints of the state servers' optimizer state: partition files, a manifest
written last.

A checkpoint is one directory under a root, named after its step::

    <root>/step-0000001200/
        manifest.json                         written last (:mod:`.manifest`)
        server0-shard000003-part00000.tier    payload: partition files in the NVMe tier's
        server0-shard000003-part00001.tier    format (:mod:`.payload`), one per partition
        server1-shard000004-part00000.tier    of each segment (all in RAM: part00000 only)
        ...

Modules, one job each: :mod:`.manifest` (schema, JSON, validation), :mod:`.compat`
(does a checkpoint fit this model), :mod:`.payload` (the payload files and their
verification), :mod:`.files` (opening them: regular files in the folder only),
:mod:`.reader` (any flat range, whatever cut the files), :mod:`.directory`
(build, commit, prune, find the checkpoints under a root) and :mod:`.writer` (a state
server's side: save its segments, restore them). Files are written with
:func:`cargohold.services.core.durable.replace_durably`.

Where a parameter element sits in the flat space depends on the worker count and the
units, so restoring onto another layout reads each new segment's elements from their
saved positions (:mod:`cargohold.services.checkpoint.reshard`, from the layout the manifest
records).

:mod:`.writer` is imported from there: it needs the tiers and the segment registry, which
the launcher and the plan do not, and it imports :mod:`cargohold.services.checkpoint.reshard`,
which imports the manifest from here.
"""

from cargohold.services.checkpoint.compat import check_compatible
from cargohold.services.checkpoint.directory import CheckpointDir
from cargohold.services.checkpoint.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    FileRecord,
    LayoutRecord,
    Manifest,
    SegmentRecord,
)
from cargohold.services.checkpoint.reader import CheckpointReader, read_flat_range

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "CheckpointReader",
    "CheckpointDir",
    "FileRecord",
    "LayoutRecord",
    "Manifest",
    "SegmentRecord",
    "check_compatible",
    "read_flat_range",
]
