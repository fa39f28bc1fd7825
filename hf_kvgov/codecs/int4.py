"""int4 codec: asymmetric 4-bit codes (``affine``), two per byte along head_dim.

Layout for a block ``[*lead, T, H, D]``, D even (token and block counts may be odd)::

    byte[j] = c[2j] | (c[2j+1] << 4)      low nibble: d = 2j, high nibble: d = 2j + 1
    codes  uint8 [*lead, T, H, D // 2]   each nibble 0..15
    scale  fp16  keys [*lead, 1, H, D]  values [*lead, T, H, D // g]
    zero   fp16  same shape as scale     (the value code 0 decodes to)
    x = ((codes[.., t, h, d // 2] >> 4 * (d % 2)) & 0xF) * s + z      float32; |x - x'| <= s / 2, s = (max - min) / 15

The bound holds exactly because scales are rounded up to the scale dtype (``numerics``).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from hf_kvgov.codecs.affine import AffineCodec


def pack_int4(codes: Tensor) -> Tensor:
    """Pack uint8 codes ``[..., D]`` (each 0..15, D even) into uint8 ``[..., D // 2]``.

    Only the low 4 bits of each code are kept.
    """
    if codes.dtype != torch.uint8:
        raise TypeError(f"int4 codes to pack must be uint8; got {codes.dtype}.")
    if codes.shape[-1] % 2:
        raise ValueError(f"int4 packs pairs along the last dim, which must be even; got shape {tuple(codes.shape)}.")
    return (codes[..., 0::2] & 0xF) | (codes[..., 1::2] << 4)


def unpack_int4(packed: Tensor) -> Tensor:
    """Unpack uint8 ``[..., D // 2]`` into uint8 codes ``[..., D]`` (inverse of ``pack_int4``)."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


class Int4Codec(AffineCodec):
    """Asymmetric int4: 15 steps between each group's min and max, two codes per byte."""

    name: ClassVar[str] = "int4"
    bits: ClassVar[int] = 4
    levels: ClassVar[int] = 15

    def _pack(self, codes: Tensor) -> Tensor:
        return pack_int4(codes)

    def _unpack(self, codes: Tensor) -> Tensor:
        return unpack_int4(codes)
