"""The host buffers OffloadedAdamW's gradients and weights pass through: per param group
(each one unit of the layout), one flat buffer of its part of the flat space for
gradients and one for weights, in the group's dtype. A segment's gradient and weights
are slices of them, sent and received in place; the padding between parameters stays
zero."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cargohold.services.core.layout import Layout, Segment


class Exchange:
    """Gradients gathered from the parameters, weights scattered back into them."""

    def __init__(self, layout: Layout, params: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype]) -> None:
        """``params`` in layout order; ``dtypes`` one per param group (unit): its parameters' dtype,
        which is also the gradients' wire dtype and the weights' fetch dtype."""
        self.layout = layout
        self.params = list(params)
        self.grads = [torch.zeros(u.stop - u.start, dtype=d) for u, d in zip(layout.units, dtypes)]
        self.weights = [torch.empty(u.stop - u.start, dtype=d) for u, d in zip(layout.units, dtypes)]

    def gradient(self, segment: Segment) -> torch.Tensor:
        return self._slice(self.grads, segment)

    def weights_of(self, segment: Segment) -> torch.Tensor:
        return self._slice(self.weights, segment)

    def gather_grads(self) -> None:
        """Copy every parameter's gradient into the gradient buffers (from any device)."""
        for place, param in zip(self.layout.params, self.params):
            assert param.grad is not None  # the optimizer checked every one before
            self._param_view(self.grads, place.unit, place.offset, place.numel).copy_(param.grad.reshape(-1))

    @torch.no_grad()
    def scatter_weights(self) -> None:
        """Copy the fetched weights into the parameters (to any device)."""
        for place, param in zip(self.layout.params, self.params):
            param.copy_(self._param_view(self.weights, place.unit, place.offset, place.numel).view(place.shape))

    def _slice(self, buffers: list[torch.Tensor], segment: Segment) -> torch.Tensor:
        base = self.layout.units[segment.unit].start
        return buffers[segment.unit][segment.start - base : segment.stop - base]

    def _param_view(self, buffers: list[torch.Tensor], unit: int, offset: int, numel: int) -> torch.Tensor:
        base = self.layout.units[unit].start
        return buffers[unit][offset - base : offset - base + numel]
