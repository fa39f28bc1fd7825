"""fp8 codecs (e4m3 and e5m2): one float8 code per element, scales that follow the data.

Codes keep the float8 dtype (``codes.view(torch.uint8)`` gives the raw bytes); per-channel scales, as int8's, cost
fp8 no precision and share int8's contract and kernels. `Float8Codec` gives the formulas and why keys carry a zero
point and values none.
"""

from __future__ import annotations

import functools
from typing import ClassVar

import torch
from torch import Tensor

from hf_kvgov.codecs.base import KVCodec
from hf_kvgov.codecs.grouping import GroupAxis
from hf_kvgov.codecs.numerics import ONE_BYTE_ZERO, round_up, stat_to_float

ZERO_DTYPE = ONE_BYTE_ZERO  # the keys' zero points, whatever the codes' format (see `Float8Codec`)
_ZERO_MAX = torch.finfo(ZERO_DTYPE).max


class Float8Codec(KVCodec):
    """Keys centred per channel, values symmetric per token; codes stored as ``codes_dtype`` (a float8 dtype).

    Keys are centred per channel, values scaled symmetrically per token (``grouping``); ``m`` mantissa bits::

        zero  = e4m3(clamp((lo + hi) / 2, -448, 448))     keys only, e4m3 [*lead, 1, H, D]; values: none (0)
        scale = round_up_to_scale_dtype(amax(|x - zero|) / finfo(fp8).max)       # 1 for an all-zero group
        code  = fp8(clamp((x - zero) / scale, -finfo.max, finfo.max))            # [*lead, T, H, D], nearest even
        x'    = float32(code) * scale + zero,  |x - x'| <= 2**-(m+1) * |x - zero| + 2**(e_min - m - 1) * scale
        e4m3fn : sign | 4-bit exponent (bias 7)  | 3-bit mantissa   max 448,   no inf, 0x7F/0xFF are NaN
        e5m2   : sign | 5-bit exponent (bias 15) | 2-bit mantissa   max 57344, IEEE-style inf and NaN

    Keys carry a zero point because a float format's error is relative: a RoPE'd key channel at 15 +- 2 over a
    block, rounded whole, moves by up to 0.47 on every token (an error the query multiplies by its large weight
    there); centred, it is rounded as +-2. Values have no channel offsets, so they keep none (and the symmetric
    format's bytes). One e4m3 byte is enough for the zero because deviations are taken from the stored zero,
    which need only land near the middle (measured: eval/RESULTS.md).
    """

    bits: ClassVar[int] = 8
    zero_axes: ClassVar[frozenset[GroupAxis]] = frozenset({GroupAxis.CHANNEL})

    @property
    def zero_dtype(self) -> torch.dtype:
        return ZERO_DTYPE

    def _quantize(self, grouped: Tensor, dim: int, with_zero: bool) -> tuple[Tensor, Tensor, Tensor | None]:
        fmax = torch.finfo(self.codes_dtype).max
        zero = None
        if with_zero:
            lo, hi = torch.aminmax(grouped, dim=dim, keepdim=True)
            # Any zero is exact: the deviation is taken from the stored (rounded) value.
            zero = (lo / 2 + hi / 2).clamp_(-_ZERO_MAX, _ZERO_MAX).to(ZERO_DTYPE)
            grouped = grouped - float8_to_float32(zero)
        amax = grouped.abs().amax(dim=dim, keepdim=True)
        step = amax / fmax
        # An all-zero group: any positive scale encodes it as exact zeros; 1 is exact in every scale dtype.
        scale = round_up(torch.where(step > 0, step, torch.ones_like(step)), self.scale_dtype)
        # The clamp guards the float32 division landing an ulp past fmax: e4m3fn has no inf, and an
        # out-of-range cast would give NaN.
        codes = (grouped / stat_to_float(scale)).clamp_(-fmax, fmax).to(self.codes_dtype)
        return codes, scale, zero

    def _dequantize(self, codes: Tensor, scale: Tensor, zero: Tensor | None) -> Tensor:
        decoded = float8_to_float32(codes).mul_(scale)  # zero: already float32 (`KVCodec.decode`)
        return decoded if zero is None else decoded.add_(zero)


def float8_to_float32(codes: Tensor) -> Tensor:
    """``codes.float()``, bit for bit; on the CPU through a 256-entry table (6x faster than the cast there)."""
    if codes.device.type != "cpu":
        return codes.float()
    table = _float32_table(codes.dtype)
    return table.index_select(0, codes.view(torch.uint8).reshape(-1).int()).view(codes.shape)


@functools.cache
def _float32_table(dtype: torch.dtype) -> Tensor:
    """The float32 value of each of the 256 codes of a float8 `dtype` (NaN codes included)."""
    return torch.arange(256, dtype=torch.uint8).view(dtype).float()


class Fp8E4M3Codec(Float8Codec):
    """fp8 e4m3fn: 3 mantissa bits (relative step 2**-3), range +-448 per scale."""

    name: ClassVar[str] = "fp8_e4m3"
    codes_dtype: ClassVar[torch.dtype] = torch.float8_e4m3fn


class Fp8E5M2Codec(Float8Codec):
    """fp8 e5m2: 2 mantissa bits (relative step 2**-2), range +-57344 per scale."""

    name: ClassVar[str] = "fp8_e5m2"
    codes_dtype: ClassVar[torch.dtype] = torch.float8_e5m2
