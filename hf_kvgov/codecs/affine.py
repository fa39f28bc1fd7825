"""Asymmetric (min/max) integer quantization shared by the integer codecs.

Asymmetric because a key channel over a block is often not centred on zero (outlier channels carry a steady
offset), and a symmetric ``amax/127`` scale would spend half its codes on values that never occur; the price is
one more statistic per group. `AffineCodec` gives the formulas.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from hf_kvgov.codecs.base import KVCodec
from hf_kvgov.codecs.grouping import GroupAxis
from hf_kvgov.codecs.numerics import round_down, round_up, stat_to_float


class AffineCodec(KVCodec):
    """Asymmetric integer codec with ``levels`` = 2**bits - 1 steps per group; codes are uint8.

    For each group (``grouping``) with minimum ``lo``, maximum ``hi`` and ``L`` = 2**bits - 1 intervals::

        zero  = round_down_to_zero_dtype(lo)                   # the value code 0 decodes to
        scale = round_up_to_scale_dtype((hi - zero) / L)       # 1 when hi == zero (constant group)
        code  = clamp(round((x - zero) / scale), 0, L)         # uint8
        x'    = code * scale + zero                            # dequant: one FMA, in float32; |x - x'| <= scale / 2

    The zero is in data units, not code units (``(code - z) * scale``), because ``z = -lo / scale`` is unbounded
    when a group's range excludes 0 and rounding it would shift the grid.
    """

    levels: ClassVar[int]
    zero_axes: ClassVar[frozenset[GroupAxis]] = frozenset(GroupAxis)
    codes_dtype: ClassVar[torch.dtype] = torch.uint8

    def _quantize(self, grouped: Tensor, dim: int, with_zero: bool) -> tuple[Tensor, Tensor, Tensor | None]:
        assert with_zero, "affine codes carry a zero point on both groupings"
        lo, hi = torch.aminmax(grouped, dim=dim, keepdim=True)
        zero = round_down(lo, self.zero_dtype)
        floor = stat_to_float(zero)
        step = (hi - floor) / self.levels
        # A constant group has no range: any positive scale with all codes 0 decodes it to `zero`; 1 is exact in
        # every scale dtype.
        scale = round_up(torch.where(step > 0, step, torch.ones_like(step)), self.scale_dtype)
        codes = ((grouped - floor) / stat_to_float(scale)).round_().clamp_(0, self.levels)
        return codes.to(torch.uint8), scale, zero

    def _dequantize(self, codes: Tensor, scale: Tensor, zero: Tensor | None) -> Tensor:
        assert zero is not None, "affine codes always carry a zero point"
        # In place on the fresh float copy: one temporary less, the same rounding as `codes * scale + zero`.
        return codes.float().mul_(scale).add_(zero)
