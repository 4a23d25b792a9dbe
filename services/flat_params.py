"""Moving a freshly built model's parameters into the worker's flat buffer, one at a
time, so that construction never holds two full copies of the model.

The model is built in fp32 (its initialisation fixes every value from the seed). Each
parameter is copied (and cast) into its view of the flat buffer and the parameter then
points at that view, which frees the fp32 original before the next one is copied: the
peak is about the fp32 model plus what of the flat buffer has been written (the buffer is
allocated empty, so its pages only count once written). The fp32 initial values of this
worker's pieces, which the state servers start from, are taken on the way, not from a
second full fp32 copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cargohold.services.layout import ShardLayout, parameter_views


def move_into_flat(
    model: torch.nn.Module,
    layout: ShardLayout,
    pieces: Sequence[tuple[int, int]],
    *,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the flat ``dtype`` buffer on ``device`` now holding every parameter of
    ``model`` (laid out by ``layout``; padding zero) and the fp32 initial values of the
    flat ranges ``pieces``, concatenated (padding zero). Afterwards each parameter's data
    is its view of the flat buffer."""
    params = list(model.parameters())
    if len(params) != len(layout.params):
        raise ValueError(f"the model has {len(params)} parameters, the layout {len(layout.params)}")
    flat = torch.empty(layout.total, dtype=dtype, device=device)
    cursor = 0
    for slot in layout.params:  # zero the padding only: the rest is written below
        flat[cursor : slot.offset].zero_()
        cursor = slot.offset + slot.numel
    flat[cursor:].zero_()
    initial = torch.zeros(sum(stop - start for start, stop in pieces), dtype=torch.float32)
    starts = [0]
    for start, stop in pieces:
        starts.append(starts[-1] + stop - start)
    for slot, param, view in zip(layout.params, params, parameter_views(layout, flat)):
        values = param.detach().reshape(-1)
        view.view(-1).copy_(values)
        for (start, stop), at in zip(pieces, starts):
            lo, hi = max(start, slot.offset), min(stop, slot.offset + slot.numel)
            if lo < hi:
                initial[at + lo - start : at + hi - start].copy_(values[lo - slot.offset : hi - slot.offset])
        del values
        param.data = view  # the fp32 original is freed here
    return flat, initial
