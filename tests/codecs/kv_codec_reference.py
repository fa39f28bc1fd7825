"""Brute-force references for the codec tests: group statistics by explicit loops, and error bounds.

Written from the grouping rules in the brief (keys: one group per (head, channel) over the block's
tokens; values: one group per (token, head, head_dim slice)), not from the codecs' own view logic.
"""

from __future__ import annotations

import torch
from torch import Tensor

INT_LEVELS = {"int8": 255, "int4": 15, "int2": 3}
# (mantissa bits, smallest normal exponent, largest finite value) of each fp8 format.
FP8_FORMATS = {"fp8_e4m3": (3, -6, 448.0), "fp8_e5m2": (2, -14, 57344.0)}


def group_slices(shape: tuple[int, ...], axis: str, group_size: int) -> list[tuple[int | slice, ...]]:
    """Index tuples into a ``[L, T, H, D]`` view, one per group (L = product of the leading dims)."""
    _, tokens, heads, head_dim = shape
    out: list[tuple[int | slice, ...]] = []
    for lead in range(shape[0]):
        for h in range(heads):
            if axis == "keys":
                out += [(lead, slice(None), h, d) for d in range(head_dim)]
            else:
                for t in range(tokens):
                    out += [(lead, t, h, slice(j, j + group_size)) for j in range(0, head_dim, group_size)]
    return out


def group_stats(x: Tensor, axis: str, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per-element (min, max, max |.|) of the element's group, float64, shape of ``x``."""
    flat = x.double().reshape(-1, *x.shape[-3:])
    lo, hi, amax = torch.empty_like(flat), torch.empty_like(flat), torch.empty_like(flat)
    for idx in group_slices(tuple(flat.shape), axis, group_size):
        group = flat[idx]
        lo[idx], hi[idx], amax[idx] = group.min(), group.max(), group.abs().max()
    return lo.reshape(x.shape), hi.reshape(x.shape), amax.reshape(x.shape)


def affine_bound(x: Tensor, lo: Tensor, hi: Tensor, levels: int) -> Tensor:
    """Largest allowed |x - x'| for asymmetric codes with ``levels`` steps and float16 statistics.

    Half a step of ``(hi - lo) / levels``, plus float16 slack: the zero point may sit one float16 ulp
    (<= 2**-10 relative) below ``lo``, and the scale may round up by one ulp (or to the smallest
    subnormal, 2**-24); plus float32 arithmetic on values of magnitude ``|x|``.
    """
    step = ((hi - lo) + 2**-10 * lo.abs() + 2**-23) / levels * (1 + 2**-9) + 2**-23
    return step / 2 + 2**-21 * torch.maximum(lo.abs(), hi.abs())


def fp8_bound(x: Tensor, dev: Tensor, amax: Tensor, name: str, offset: Tensor) -> Tensor:
    """Largest allowed |x - x'| for an fp8 format: ``dev`` = |x - zero|, ``amax`` its group maximum.

    Round to nearest with ``m`` mantissa bits: relative error 2**-(m+1) of ``dev`` for normal numbers,
    absolute half of the smallest subnormal, 2**(e_min - m - 1), times the scale ``amax / max`` below;
    float16 scale round-up adds at most one ulp to the scale; float32 arithmetic on the ``offset``
    (the zero point's magnitude, 0 for values) adds its rounding.
    """
    mantissa, e_min, fmax = FP8_FORMATS[name]
    scale = amax / fmax * (1 + 2**-9) + 2**-24
    return 2.0 ** -(mantissa + 1) * dev * (1 + 2**-20) + 2.0 ** (e_min - mantissa - 1) * scale + 2**-22 * offset


def error_bound(name: str, x: Tensor, axis: str, group_size: int) -> Tensor:
    """The per-element bound of codec ``name`` on ``x`` (float64, shape of ``x``)."""
    lo, hi, amax = group_stats(x, axis, group_size)
    if name in INT_LEVELS:
        return affine_bound(x.double(), lo, hi, INT_LEVELS[name])
    if axis != "keys":
        return fp8_bound(x.double(), x.double().abs(), amax, name, torch.zeros_like(amax))
    # Keys are centred on their channel's midpoint clamped to +-448 and stored in e4m3: within 2**-4 of it
    # relative (3 mantissa bits), or half of e4m3's smallest subnormal (2**-10) near 0, plus what the clamp cut.
    mid = (lo + hi) / 2
    slack = 2**-4 * mid.abs().clamp(max=448) + 2**-10 + (mid.abs() - 448).clamp(min=0)
    return fp8_bound(x.double(), (x.double() - mid).abs() + slack, (hi - lo) / 2 + slack, name, mid.abs())
