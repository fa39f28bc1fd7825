"""int2 codec: asymmetric 2-bit codes (``affine``), four per byte along head_dim (KIVI's 2-bit format).

With four levels a group's range matters most, which is why keys are grouped per channel (an outlier channel gets its
own range), values per token, and the newest tokens stay in full precision (``QuantConfig.residual``): those attention
leans on most are never rounded to 2 bits. `Int2Codec` gives the layout and the statistics' bytes.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from hf_kvgov.codecs.affine import AffineCodec


def pack_int2(codes: Tensor) -> Tensor:
    """Pack uint8 codes ``[..., D]`` (each 0..3, D a multiple of 4) into uint8 ``[..., D // 4]``.

    Only the low 2 bits of each code are kept.
    """
    if codes.dtype != torch.uint8:
        raise TypeError(f"int2 codes to pack must be uint8; got {codes.dtype}.")
    if codes.shape[-1] % 4:
        raise ValueError(
            f"int2 packs four codes per byte along the last dim, which must be a multiple of 4; got shape "
            f"{tuple(codes.shape)}."
        )
    c = codes & 0x3
    return c[..., 0::4] | (c[..., 1::4] << 2) | (c[..., 2::4] << 4) | (c[..., 3::4] << 6)


def unpack_int2(packed: Tensor) -> Tensor:
    """Unpack uint8 ``[..., D // 4]`` into uint8 codes ``[..., D]`` (inverse of ``pack_int2``)."""
    return torch.stack([(packed >> shift) & 0x3 for shift in (0, 2, 4, 6)], dim=-1).flatten(-2)


class Int2Codec(AffineCodec):
    """Asymmetric int2: 3 steps between each group's min and max, four codes per byte.

    Layout for a block ``[*lead, T, H, D]``, D a multiple of 4; lower bits hold lower indices, as in int4::

        byte[j] = c[4j] | c[4j+1] << 2 | c[4j+2] << 4 | c[4j+3] << 6      c[4j+i] = (byte[j] >> 2i) & 0x3
        codes  uint8 [*lead, T, H, D // 4]   each code 0..3
        scale  fp16  keys [*lead, 1, H, D]  values [*lead, T, H, D // g]
        zero   fp16  same shape as scale     (the value code 0 decodes to)
        x = ((codes[.., t, h, d // 4] >> 2 * (d % 4)) & 0x3) * s + z      float32; |x - x'| <= s / 2,
                                                                          s = (max - min) / 3

    ``scale_dtype=LOG_SCALE`` stores each statistic in one byte (``numerics``), because at 2 bits fp16 statistics
    take half the bytes of the codes at 16-token blocks. KIVI also splits values into groups of 32
    (``group_size=32``); eval/RESULTS.md measures both.
    """

    name: ClassVar[str] = "int2"
    bits: ClassVar[int] = 2
    levels: ClassVar[int] = 3

    def _pack(self, codes: Tensor) -> Tensor:
        return pack_int2(codes)

    def _unpack(self, codes: Tensor) -> Tensor:
        return unpack_int2(codes)
