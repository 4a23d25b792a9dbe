"""One segment's state in RAM for the SegmentState tests: a spec with padding between its
fragments (a recognisable value in it), seeded weights and gradients, and the snapshot
comparison. Used by the ``test_segment_state*`` modules."""

from __future__ import annotations

import torch

from cargohold.services.core.optim import AdamWHyperParams
from cargohold.services.core.segment_spec import SegmentSpec
from cargohold.services.segments.segment_state import SegmentState

HYPER = AdamWHyperParams(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, max_grad_norm=1.0)
"""The spec's hyper-parameters: clipping on."""
NUMEL = 256
"""Elements of the segment, padding included."""
FRAGMENTS = ((0, 101), (128, 85))
"""Real elements at [0, 101) and [128, 213); the rest is padding."""
PADDING_VALUE = 12345.0
"""What the initial weights hold in the padding."""


def segment_spec(**overrides: object) -> SegmentSpec:
    """Segment 3 of run 'run-a' (``NUMEL`` elements at 1024, ``FRAGMENTS``, fp32 gradients,
    ``HYPER``), with ``overrides``."""
    fields: dict[str, object] = dict(
        run_id="run-a",
        segment_id=3,
        start=1024,
        numel=NUMEL,
        fragments=FRAGMENTS,
        grad_dtype="float32",
        hyper=HYPER,
    )
    fields.update(overrides)
    return SegmentSpec(**fields)  # type: ignore[arg-type]


def padding_mask(spec: SegmentSpec) -> torch.Tensor:
    """True where ``spec``'s segment is padding."""
    mask = torch.ones(spec.numel, dtype=torch.bool)
    for offset, length in spec.fragments:
        mask[offset : offset + length] = False
    return mask


def initial_weights(spec: SegmentSpec, seed: int = 0) -> torch.Tensor:
    """Random real elements, a recognisable value in the padding."""
    weights = torch.randn(spec.numel, generator=torch.Generator().manual_seed(seed))
    weights[padding_mask(spec)] = PADDING_VALUE
    return weights


def step_gradient(step: int, numel: int = NUMEL, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The gradient of ``step``, a pure function of it."""
    # Non-zero everywhere, padding included: the padding must still be left alone.
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 + step)).to(dtype)


def fresh_state(spec: SegmentSpec | None = None) -> SegmentState:
    """A state of ``spec`` (default :func:`segment_spec`) at its initial weights, step 0."""
    spec = spec or segment_spec()
    return SegmentState(spec, initial_weights(spec))


def assert_snapshot_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Assert two snapshots hold the three arrays, bitwise equal."""
    assert a.keys() == b.keys() == {"master", "exp_avg", "exp_avg_sq"}
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} changed"
