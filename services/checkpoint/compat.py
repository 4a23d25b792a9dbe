"""Whether a checkpoint fits the model being trained: the same parameters (by name and
shape, in any order) and the same alignment."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from cargohold.services.checkpoint.manifest import Manifest
from cargohold.services.core.errors import CheckpointError


def check_compatible(
    manifest: Manifest,
    *,
    model_signature: Sequence[tuple[str, Sequence[int]]],
    align: int,
) -> None:
    """Refuse a checkpoint of another model, naming the first parameter that differs.

    Parameters are matched by name: the checkpoint may list them in another order (its
    layout formed other units), and any worker or server count restores. The
    alignment the manifest's layout records must be ``align``.
    """
    theirs = _shape_map(manifest.model_signature, "the checkpoint")
    ours = _shape_map(model_signature, "this model")
    for name, shape in theirs.items():
        if name not in ours:
            raise CheckpointError(
                f"checkpoint is of another model: only the checkpoint has parameter {name!r} of shape "
                f"{shape} ({len(theirs)} parameters in the checkpoint, {len(ours)} in this model)"
            )
        if ours[name] != shape:
            raise CheckpointError(
                f"checkpoint is of another model: parameter {name!r} has shape {shape} in the "
                f"checkpoint but {ours[name]} in this model"
            )
    for name, shape in ours.items():
        if name not in theirs:
            raise CheckpointError(
                f"checkpoint is of another model: only this model has parameter {name!r} of shape "
                f"{shape} ({len(theirs)} parameters in the checkpoint, {len(ours)} in this model)"
            )
    saved_align = manifest.layout.align
    if saved_align != align:
        raise CheckpointError(
            f"checkpoint is of another layout: it was saved with align {saved_align}, this run uses {align}"
        )


def _shape_map(signature: Iterable[tuple[str, Sequence[int]]], whose: str) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for name, shape in signature:
        if name in shapes:
            raise CheckpointError(f"{whose} lists parameter {name!r} twice")
        shapes[str(name)] = tuple(int(d) for d in shape)
    return shapes
