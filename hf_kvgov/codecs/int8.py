"""int8 codec: asymmetric 8-bit codes (``affine``), one uint8 per element.

Layout for a block ``[*lead, T, H, D]`` (stat shapes: ``grouping``)::

    codes  uint8 [*lead, T, H, D]        one byte per element, values 0..255
    scale  fp16  keys [*lead, 1, H, D]  values [*lead, T, H, D // g]
    zero   fp16  same shape as scale     (the value code 0 decodes to)
    x = code * s + z                     float32; |x - x'| <= s / 2, s = (max - min) / 255 rounded up
"""

from __future__ import annotations

from typing import ClassVar

from hf_kvgov.codecs.affine import AffineCodec


class Int8Codec(AffineCodec):
    """Asymmetric int8: 255 steps between each group's min and max."""

    name: ClassVar[str] = "int8"
    bits: ClassVar[int] = 8
    levels: ClassVar[int] = 255
