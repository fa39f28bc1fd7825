"""Asymmetric (min/max) integer quantization shared by the int8 and int4 codecs.

For each group (see ``grouping``) with minimum ``lo`` and maximum ``hi``, and ``L`` = 2**bits - 1
intervals (255 for int8, 15 for int4)::

    zero  = round_down_to_zero_dtype(lo)                   # the value code 0 decodes to
    scale = round_up_to_scale_dtype((hi - zero) / L)       # 1 when hi == zero (constant group)
    code  = clamp(round((x - zero) / scale), 0, L)         # uint8
    x'    = code * scale + zero                            # dequant: one FMA, in float32

so ``|x - x'| <= scale / 2`` for every element (up to float32 arithmetic), and a constant group whose
value the scale dtype holds decodes exactly (all codes 0, ``x' = zero``).

Why asymmetric rather than symmetric: keys are grouped per channel, and a channel over one block is
often not centred on zero (outlier channels carry a large, steady offset). A symmetric scale ``amax/127``
spends half its codes on values that never occur, doubling the step; min/max uses all ``L`` steps on
the range that exists (a zero dtype is fp16 like the scale, or one e4m3 byte beside one-byte scales:
``numerics``). The price is one extra float16 per group: per (head, channel) per block for
keys, per (token, head) for values, about 1.6% of int8 value bytes at head_dim 128.

Why the zero point is stored in the data's units (``x' = code * scale + zero``) rather than in code
units (``x' = (code - z) * scale``): the two are the same affine map with ``zero = -z * scale``, but
``z = -lo / scale`` is unbounded when a group's range excludes 0 (a channel spanning [1000, 1001] in
int8 gives ``z`` = -255000, beyond float16), and rounding ``z`` to an integer shifts the grid by up to
half a step. ``zero`` in data units is just the group minimum, always in range.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from hf_kvgov.codecs.base import KVCodec
from hf_kvgov.codecs.grouping import GroupAxis
from hf_kvgov.codecs.numerics import round_down, round_up, stat_to_float


class AffineCodec(KVCodec):
    """Asymmetric integer codec with ``levels`` = 2**bits - 1 steps per group; codes are uint8."""

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
