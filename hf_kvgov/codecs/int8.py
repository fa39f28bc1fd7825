"""int8 codec: asymmetric 8-bit codes, one uint8 per element.

Layout for a block ``[*lead, T, H, D]`` (see ``grouping`` for the stat shapes)::

    codes  uint8 [*lead, T, H, D]        one byte per element, values 0..255
    scale  fp16  keys [*lead, 1, H, D]  values [*lead, T, H, D // g]
    zero   fp16  same shape as scale     (the value code 0 decodes to)

Dequantize, element (.., t, h, d) with its group's scale ``s`` and zero ``z``, in float32::

    x = code * s + z

Error: ``|x - x'| <= s / 2`` with ``s = (max - min) / 255`` of the group, rounded up to the scale
dtype. Asymmetric rather than symmetric, and why the zero point is in data units: see ``affine``.
"""

from __future__ import annotations

from typing import ClassVar

from hf_kvgov.codecs.affine import AffineCodec


class Int8Codec(AffineCodec):
    """Asymmetric int8: 255 steps between each group's min and max."""

    name: ClassVar[str] = "int8"
    bits: ClassVar[int] = 8
    levels: ClassVar[int] = 255
