"""The stored precision of AdamW's moments (``exp_avg``, ``exp_avg_sq``), and the update
over moments kept in it. Master weights stay fp32 in every kind; pure logic, no tiers.

Three kinds, opt-in per run:

* ``float32`` (the default): the moments are the fp32 tensors themselves, and
  :func:`adamw_step_` is :func:`~cargohold.services.core.optim.fused_adamw_` over them, bitwise
  ``torch.optim.AdamW(fused=True)``.
* ``bfloat16``: each moment is rounded to bf16 (nearest even) after every update; a
  round trip errs by at most half a bf16 ulp, ``2**-8 * |x|``. With ``beta2 > 1 - 2**-9``
  (0.999 is) one step's decay of ``exp_avg_sq`` is below half an ulp, so where the new
  ``grad**2`` is small the stored value does not decay and the update comes out smaller
  than fp32's: a conservative error, not a divergent one (tested, as is the 8-bit kind's
  decay through its scale).
* ``blockwise8``: 8-bit block-quantized moments as in Dettmers et al., "8-bit Optimizers
  via Block-wise Quantization" (arXiv:2110.02861; bitsandbytes, torchao's ``AdamW8bit``):
  blocks of :data:`BLOCK_ELEMENTS` elements, one fp32 scale per block (its absmax), each
  element a byte indexing a 256-entry code map of values in [-1, 1]. The scale carries a
  block's common decay, so the bytes need not change for it.

The code maps are bitsandbytes' dynamic (tree) maps: a decimal exponent and a linear
fraction whose bits shrink as the exponent falls, 7 decades below the absmax, finest near
it. ``exp_avg`` uses the signed map (values down to 5.5e-7 of the absmax). ``exp_avg_sq``
uses the unsigned map *squared*: it is the square of a gradient scale and enters the
update as ``sqrt``, so squaring gives ``sqrt(exp_avg_sq)`` the unsigned map's own 7
decades (down to 3.3e-7), where the unsigned map on ``exp_avg_sq`` itself would round to
zero every element whose gradient is 3.4 decades below its block's largest. A positive
``exp_avg_sq`` is never rounded to zero either (only one below ``2**-137`` of the absmax):
a zero denominator would make that element's update ``exp_avg / eps``.

Encoding is one division by the block scale and one table look-up indexed by the top 20
bits (sign, exponent, 11 mantissa bits) of the fp32 quotient, which picks the code
nearest the middle of those bits' interval; decoding is a look-up and a multiply. Both
are plain torch ops over a piece at a time, no search. The look-up's interval adds up to
``2**-12`` to the map's half gap; :func:`error_bound` states the whole bound.

Accuracy over a run, and where the 8-bit error lands (``benchmarks/state_dtype_spike.py``,
which reproduces the Ray runs' losses in one process): the demo's 200 steps stay within
0.65% (8-bit) and 0.054% (bf16) of fp32's loss at every step (docs/benchmarks.md), and
with the demo's AdamW (lr 1e-3, beta2 0.95, clipping at 1) 200 steps of the tests' tiny
GPT within 0.08% and 0.01% (tested with a 1% bound). On the tiny config's
own lr of 0.01 the 8-bit loss spikes 29% above fp32's at step 11 of 20. The largest error
of one step's direction ``exp_avg / sqrt(exp_avg_sq)`` is in the LayerNorm before each MLP
(5-10% relative, at most 3.6% elsewhere): in the flat space ``ln_2``'s weight and bias
share a block with ``attn.c_proj.bias``, whose gradients are ~250x larger, so their
``sqrt(exp_avg_sq)`` sit 3 decades below the block's absmax, where the map has 16 codes a
decade (the pathology of small tensors that bitsandbytes avoids); rounding only
``exp_avg_sq`` gives most of the spike (20%), only ``exp_avg`` 5%. But the spike is the
config's instability more than this error: fp32 moments given 0.3% of random noise on
``exp_avg_sq`` after every update (less than bf16's rounding) spike by up to 121% at step
13, and neither of bitsandbytes' remedies helps consistently: tensors below 4096 elements
kept fp32 (its ``min_8bit_size``) cut this seed's spike to 2.8% but raise another's from
38% to 52%, blocks per tensor raise this one to 41%, fp32 embeddings (what its
``StableEmbedding`` keeps) leave it at 17%. At lr 0.003 the 8-bit curve stays
within 0.3%. So no change here: a per-tensor fp32 exception would also need moments of two
kinds in one partition (its file format).

Own code rather than a library's (measured on this project's 2-core CPU host, torch
2.13.0+cpu, both from PyPI with ``--no-deps`` into a scratch folder): bitsandbytes 0.50.2
has a CPU blockwise quantizer (a C kernel) and needs nothing beyond torch, but its wheel
is 43 MB (125 MB installed, nearly all CUDA and ROCm builds), and in this update loop (16
Mi parameters, 1 Mi pieces) it gave 77 M parameters/s against this module's 152 (2
threads; 45 against 167 on one). torchao 0.18's ``AdamW8bit`` runs on the CPU through
``torch.compile`` (12 s to compile, a C++ compiler at run time, its own Adam arithmetic
instead of the fused kernel) at 36 M parameters/s; its eager quantizer, a binary search
of 8 gathers, encodes 7 M elements/s. ``benchmarks/state_precision.py`` measures this
module.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from cargohold.services.core.errors import ConfigError
from cargohold.services.core.optim import (
    AdamWHyperParams,
    AdamWState,
    FragmentGroup,
    apply_update,
    clip_fragments,
    fused_adamw_,
)

StateDtype = Literal["float32", "bfloat16", "blockwise8"]
"""How a run stores the moments (``optim.state_dtype``)."""
STATE_DTYPES: tuple[StateDtype, ...] = get_args(StateDtype)
Moment = Literal["exp_avg", "exp_avg_sq"]
MOMENTS: tuple[Moment, ...] = get_args(Moment)

BLOCK_ELEMENTS = 256
"""Elements per quantization block of ``blockwise8`` (one fp32 scale each)."""
PIECE_ELEMENTS = 1 << 20
"""Elements decoded to fp32 at a time by :func:`adamw_step_`: 12 MiB of temporaries."""

_STORED = {"float32": torch.float32, "bfloat16": torch.bfloat16, "blockwise8": torch.uint8}
STORED_TORCH_DTYPES: dict[str, torch.dtype] = dict(_STORED)
"""The torch dtype of a moment's stored values, by kind."""
_INDEX_SHIFT = 12
"""The look-up index is the top 32 - 12 = 20 bits of the fp32 quotient."""
_INDEX_MASK = (1 << (32 - _INDEX_SHIFT)) - 1
_ROUNDING = 2.0**-22
"""Slack for fp32 rounding (the division by the scale, the fp32 table, the multiply back),
relative to the block's absmax."""


def parse_state_dtype(name: str) -> StateDtype:
    """``name`` as a :data:`StateDtype`, or a :class:`ConfigError` listing the kinds."""
    if name not in STATE_DTYPES:
        raise ConfigError(f"optim.state_dtype must be one of {', '.join(STATE_DTYPES)}, got {name!r}")
    return name


def _blocks(numel: int) -> int:
    return -(-numel // BLOCK_ELEMENTS)


def stored_bytes(dtype: StateDtype, numel: int) -> int:
    """Bytes of one parameter range's state of ``numel`` elements: fp32 master weights, both
    moments and, for ``blockwise8``, their block scales."""
    parse_state_dtype(dtype)
    moment = numel * _STORED[dtype].itemsize + (4 * _blocks(numel) if dtype == "blockwise8" else 0)
    return 4 * numel + 2 * moment


def bytes_per_parameter(dtype: StateDtype) -> float:
    """State bytes per parameter: 12 (fp32), 8 (bf16), 6.03125 (8-bit, 256-element blocks)."""
    parse_state_dtype(dtype)
    scales = 2 * 4 / BLOCK_ELEMENTS if dtype == "blockwise8" else 0.0
    return 4 + 2 * _STORED[dtype].itemsize + scales


@dataclass(frozen=True, slots=True)
class StoredMoment:
    """One moment of a parameter range in its stored form: flat tensors a tier can write
    to a file as they are.

    ``values`` is fp32 (``float32``), bf16 (``bfloat16``) or uint8 codes (``blockwise8``,
    where byte 0 is the value 0, so zeroed bytes are zero moments); ``scales`` holds one
    fp32 absmax per block of ``blockwise8`` and is empty for the other kinds.
    """

    dtype: StateDtype
    moment: Moment
    values: torch.Tensor
    scales: torch.Tensor

    def __post_init__(self) -> None:
        parse_state_dtype(self.dtype)
        if self.moment not in MOMENTS:
            raise ValueError(f"unknown moment {self.moment!r}: one of {', '.join(MOMENTS)}")
        what = f"a {self.dtype} {self.moment}"
        _check_flat(f"{what}'s values", self.values, _STORED[self.dtype])
        _check_flat(f"{what}'s scales", self.scales, torch.float32)
        blocks = _blocks(self.numel) if self.dtype == "blockwise8" else 0
        if self.scales.numel() != blocks:
            raise ValueError(f"{what} of {self.numel} elements needs {blocks} block scales, got {self.scales.numel()}")

    @property
    def numel(self) -> int:
        return self.values.numel()


def _check_flat(what: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    if tensor.dtype != dtype:
        raise ValueError(f"{what} must be {dtype}, got {tensor.dtype}")
    if tensor.dim() != 1 or not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ValueError(f"{what} must be a flat contiguous CPU tensor, got shape {tuple(tensor.shape)}")


def zeros(dtype: StateDtype, moment: Moment, numel: int) -> StoredMoment:
    """A moment of ``numel`` zeros, as AdamW starts."""
    parse_state_dtype(dtype)
    scales = torch.zeros(_blocks(numel) if dtype == "blockwise8" else 0, dtype=torch.float32)
    return StoredMoment(dtype, moment, torch.zeros(numel, dtype=_STORED[dtype]), scales)


def encode(values: torch.Tensor, dtype: StateDtype, moment: Moment) -> StoredMoment:
    """fp32 ``values`` (flat) in their stored form; ``values`` is left as it was."""
    _check_flat(f"the {moment} to encode", values, torch.float32)
    stored = zeros(dtype, moment, values.numel())
    if dtype == "float32":
        stored.values.copy_(values)
        return stored
    for start in range(0, values.numel(), PIECE_ELEMENTS):
        encode_range_(stored, start, values[start : start + PIECE_ELEMENTS].clone())
    return stored


def decode(stored: StoredMoment) -> torch.Tensor:
    """The fp32 values of a stored moment, as a new tensor."""
    out = torch.empty(stored.numel, dtype=torch.float32)
    for start in range(0, stored.numel, PIECE_ELEMENTS):
        decode_range(stored, start, out[start : start + PIECE_ELEMENTS])
    return out


def _check_range(stored: StoredMoment, start: int, length: int) -> None:
    if start % BLOCK_ELEMENTS or start < 0 or start + length > stored.numel:
        raise ValueError(
            f"range [{start}, {start + length}) of a {stored.numel}-element {stored.moment}: it must lie "
            f"inside and start at a multiple of {BLOCK_ELEMENTS}"
        )
    if length % BLOCK_ELEMENTS and start + length != stored.numel:
        raise ValueError(
            f"range [{start}, {start + length}) of a {stored.numel}-element {stored.moment} must end at a "
            f"multiple of {BLOCK_ELEMENTS} or at the end"
        )


def decode_range(stored: StoredMoment, start: int, out: torch.Tensor, index: torch.Tensor | None = None) -> None:
    """Write elements ``[start, start + len(out))`` of ``stored`` into fp32 ``out``.

    ``start`` is a multiple of :data:`BLOCK_ELEMENTS`, and the range ends at one or at the
    end. ``index``, an int32 tensor at least as long as ``out``, saves an allocation.
    """
    _check_flat("the decoded range", out, torch.float32)
    _check_range(stored, start, out.numel())
    values = stored.values[start : start + out.numel()]
    if stored.dtype != "blockwise8":
        out.copy_(values)
        return
    codes = index[: out.numel()] if index is not None else torch.empty(out.numel(), dtype=torch.int32)
    codes.copy_(values)
    torch.index_select(_code_map(stored.moment)[0], 0, codes, out=out)
    first = start // BLOCK_ELEMENTS
    for rows, scales in _block_views(out, stored.scales[first:]):
        rows.mul_(scales[:, None])


def encode_range_(stored: StoredMoment, start: int, values: torch.Tensor) -> None:
    """Store fp32 ``values`` as elements ``[start, start + len(values))`` of ``stored``.

    The range is as :func:`decode_range`'s. ``values`` is used as scratch: it holds
    nothing meaningful afterwards.
    """
    _check_flat("the range to encode", values, torch.float32)
    _check_range(stored, start, values.numel())
    target = stored.values[start : start + values.numel()]
    if stored.dtype != "blockwise8":
        target.copy_(values)
        return
    first = start // BLOCK_ELEMENTS
    for rows, scales in _block_views(values, stored.scales[first:]):
        if stored.moment == "exp_avg":
            torch.maximum(rows.amax(dim=1), rows.amin(dim=1).neg_(), out=scales)
        else:  # nonnegative
            torch.amax(rows, dim=1, out=scales)
        rows.div_(torch.where(scales > 0, scales, 1.0)[:, None])
    bits = values.view(torch.int32)
    bits.bitwise_right_shift_(_INDEX_SHIFT).bitwise_and_(_INDEX_MASK)
    torch.index_select(_code_map(stored.moment)[1], 0, bits, out=target)


def _block_views(flat: torch.Tensor, scales: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``flat`` as rows of whole blocks and a last short row, each with its scales."""
    whole = flat.numel() // BLOCK_ELEMENTS
    views = [(flat[: whole * BLOCK_ELEMENTS].view(whole, BLOCK_ELEMENTS), scales[:whole])] if whole else []
    if flat.numel() % BLOCK_ELEMENTS:
        views.append((flat[whole * BLOCK_ELEMENTS :].view(1, -1), scales[whole : whole + 1]))
    return views


def error_bound(dtype: StateDtype, moment: Moment, values: torch.Tensor) -> torch.Tensor:
    """The most by which each element of fp32 ``values`` (flat) may differ after
    :func:`encode` then :func:`decode`: 0 for ``float32``; half a bf16 ulp for ``bfloat16``
    (``2**-8 * |x|``, and half the smallest subnormal step near zero); for ``blockwise8``
    :func:`code_bound` ``(moment)`` times the element's block absmax."""
    parse_state_dtype(dtype)
    if dtype == "float32":
        return torch.zeros_like(values)
    if dtype == "bfloat16":
        return torch.clamp(values.abs() * 2.0**-8, min=2.0**-134)
    absmax = torch.empty(_blocks(values.numel()), dtype=torch.float32)
    for rows, scales in _block_views(values.abs(), absmax):
        torch.amax(rows, dim=1, out=scales)
    return absmax.repeat_interleave(BLOCK_ELEMENTS)[: values.numel()] * code_bound(moment)


def code_bound(moment: Moment) -> float:
    """``blockwise8``'s round-trip error relative to the block's absmax: the code map's
    largest half gap widened by the look-up's interval, plus fp32 rounding (about 0.0073)."""
    return _code_map(moment)[2] + _ROUNDING


@functools.cache
def _dynamic_map(signed: bool) -> torch.Tensor:
    """bitsandbytes' ``create_dynamic_map(signed, max_exponent_bits=7, total_bits=8)``
    (functional.py, MIT licence), sorted, in float64: 256 values in [-1, 1] (signed, which
    has no -1) or [0, 1]."""
    values = [0.0, 1.0]
    for i in range(7):
        items = 2**i + 1 if signed else 2 ** (i + 1) + 1
        edges = torch.linspace(0.1, 1, items, dtype=torch.float64)
        means = ((edges[:-1] + edges[1:]) / 2 * 10.0 ** (i - 6)).tolist()
        values += means + ([-m for m in means] if signed else [])
    return torch.tensor(sorted(values), dtype=torch.float64)


@functools.cache
def _code_map(moment: Moment) -> tuple[torch.Tensor, torch.Tensor, float]:
    """A moment's fp32 decode table (code to value, code 0 = 0.0), its encode table (top
    20 bits of an fp32 in [-1, 1] to code) and its bound relative to the absmax."""
    levels = _dynamic_map(signed=True) if moment == "exp_avg" else _dynamic_map(signed=False) ** 2
    zero = int((levels == 0).nonzero())
    order = torch.roll(torch.arange(levels.numel()), -zero)  # code c decodes to levels[order[c]]
    code_of_level = torch.empty_like(order)
    code_of_level[order] = torch.arange(levels.numel())

    prefix = torch.arange(1 << (32 - _INDEX_SHIFT), dtype=torch.int64) << _INDEX_SHIFT
    low_bits = torch.where(prefix >= 1 << 31, prefix - (1 << 32), prefix)
    ends = [
        (low_bits + extra).to(torch.int32).view(torch.float32).to(torch.float64)
        for extra in (0, (1 << _INDEX_SHIFT) - 1)
    ]
    real = ends[0].isfinite() & ends[1].isfinite()
    lo, hi = (torch.where(real, e, 0.0).clamp(-1.0 if moment == "exp_avg" else 0.0, 1.0) for e in ends)
    centre = (lo + hi) / 2
    above = torch.searchsorted(levels, centre).clamp(1, levels.numel() - 1)
    nearest = torch.where(centre - levels[above - 1] <= levels[above] - centre, above - 1, above)
    if moment == "exp_avg_sq":  # a positive value never becomes 0
        nearest = torch.where((lo > 0) & (nearest == zero), zero + 1, nearest)
    chosen = levels[nearest]
    bound = float(torch.maximum((lo - chosen).abs(), (hi - chosen).abs()).max())
    decode_table = levels[order].to(torch.float32)
    return decode_table, code_of_level[nearest].to(torch.uint8), bound


def adamw_step_(
    master: torch.Tensor,
    exp_avg: StoredMoment,
    exp_avg_sq: StoredMoment,
    gradient: torch.Tensor,
    *,
    step: torch.Tensor,
    lr: float,
    hyper: AdamWHyperParams,
    piece_elements: int = PIECE_ELEMENTS,
) -> None:
    """AdamW at ``step`` over fp32 ``master`` and moments in their stored form, with fp32
    ``gradient`` (all flat, the same length), as :func:`optim.fused_adamw_` does: no
    clipping, no step increment (the caller counts ``step``, an fp32 scalar, once).

    ``float32`` is that function over the whole tensors. The others decode
    ``piece_elements`` of each moment at a time (a multiple of :data:`BLOCK_ELEMENTS`) into
    fp32, run the same fused kernel over the piece and store the moments again.
    """
    _check_step(master, exp_avg, exp_avg_sq, gradient, step, piece_elements)
    if exp_avg.dtype == "float32":
        state = AdamWState([master], [exp_avg.values], [exp_avg_sq.values], step)
        fused_adamw_(state, [gradient], lr=lr, hyper=hyper)
        return
    size = min(piece_elements, master.numel())
    first, second = torch.empty(size), torch.empty(size)
    index = torch.empty(size, dtype=torch.int32) if exp_avg.dtype == "blockwise8" else None
    for start in range(0, master.numel(), piece_elements):
        end = min(start + piece_elements, master.numel())
        m, v = first[: end - start], second[: end - start]
        decode_range(exp_avg, start, m, index)
        decode_range(exp_avg_sq, start, v, index)
        state = AdamWState([master[start:end]], [m], [v], step)
        fused_adamw_(state, [gradient[start:end]], lr=lr, hyper=hyper)
        encode_range_(exp_avg, start, m)
        encode_range_(exp_avg_sq, start, v)


def apply_update_stored(
    master: torch.Tensor,
    exp_avg: StoredMoment,
    exp_avg_sq: StoredMoment,
    groups: Sequence[FragmentGroup],
    gradient: torch.Tensor,
    *,
    step: torch.Tensor,
    coefficient: torch.Tensor | None,
    lr: float,
    owned: bool,
    piece_elements: int = PIECE_ELEMENTS,
) -> None:
    """:func:`optim.apply_update <cargohold.services.core.optim.apply_update>` over moments in
    their stored form: the state server's update of one partition.

    ``float32`` is that function over the moments' fp32 tensors themselves (bitwise the
    path without stored kinds). The others decode ``piece_elements`` of each moment at a
    time (a multiple of :data:`BLOCK_ELEMENTS`, from the partition's start: its blocks)
    into fp32, run ``apply_update`` over the piece's part of every group's fragments (the
    same fused kernel, one call per group) and store the moments again."""
    if exp_avg.dtype != exp_avg_sq.dtype or exp_avg.numel != master.numel() or exp_avg_sq.numel != master.numel():
        raise ValueError(
            f"moments of {exp_avg.numel} {exp_avg.dtype} and {exp_avg_sq.numel} {exp_avg_sq.dtype} elements "
            f"for {master.numel()} master weights"
        )
    if exp_avg.dtype == "float32":
        apply_update(
            master, exp_avg.values, exp_avg_sq.values, groups, gradient,
            step=step, coefficient=coefficient, lr=lr, owned=owned,
        )  # fmt: skip
        return
    if piece_elements <= 0 or piece_elements % BLOCK_ELEMENTS:
        raise ValueError(f"piece_elements must be a positive multiple of {BLOCK_ELEMENTS}, got {piece_elements}")
    size = min(piece_elements, master.numel())
    first, second = torch.empty(size), torch.empty(size)
    index = torch.empty(size, dtype=torch.int32) if exp_avg.dtype == "blockwise8" else None
    for start in range(0, master.numel(), piece_elements):
        end = min(start + piece_elements, master.numel())
        pieces = [
            FragmentGroup(clip_fragments(group.fragments, start, end), group.hyper, group.lr_scale) for group in groups
        ]
        if not any(group.fragments for group in pieces):
            continue  # padding only: its moments stay as they are (zero)
        m, v = first[: end - start], second[: end - start]
        decode_range(exp_avg, start, m, index)
        decode_range(exp_avg_sq, start, v, index)
        apply_update(
            master[start:end], m, v, pieces, gradient[start:end],
            step=step, coefficient=coefficient, lr=lr, owned=owned,
        )  # fmt: skip
        encode_range_(exp_avg, start, m)
        encode_range_(exp_avg_sq, start, v)


def _check_step(
    master: torch.Tensor,
    exp_avg: StoredMoment,
    exp_avg_sq: StoredMoment,
    gradient: torch.Tensor,
    step: torch.Tensor,
    piece_elements: int,
) -> None:
    _check_flat("master weights", master, torch.float32)
    _check_flat("the gradient", gradient, torch.float32)
    if (exp_avg.moment, exp_avg_sq.moment) != MOMENTS:
        raise ValueError(f"moments given as ({exp_avg.moment}, {exp_avg_sq.moment}), expected {MOMENTS}")
    if exp_avg.dtype != exp_avg_sq.dtype:
        raise ValueError(f"exp_avg is stored as {exp_avg.dtype} but exp_avg_sq as {exp_avg_sq.dtype}")
    sizes = {"master": master.numel(), "gradient": gradient.numel(), "exp_avg": exp_avg.numel}
    sizes["exp_avg_sq"] = exp_avg_sq.numel
    if len(set(sizes.values())) != 1:
        raise ValueError(f"AdamW needs equal lengths, got {sizes}")
    if step.dtype != torch.float32 or step.numel() != 1 or not math.isfinite(float(step)):
        raise ValueError(f"step must be a finite fp32 scalar tensor, got {step.dtype} of shape {tuple(step.shape)}")
    if piece_elements <= 0 or piece_elements % BLOCK_ELEMENTS:
        raise ValueError(f"piece_elements must be a positive multiple of {BLOCK_ELEMENTS}, got {piece_elements}")
