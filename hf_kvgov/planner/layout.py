"""Bytes of one KV block in each storage format, mirroring the packed layouts of ``hf_kvgov.codecs``.

`BlockFormat` gives the byte counts of a block in each format, `SlotLayout` those of an eviction cache's kept slots.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


def _check_group(group_size: int | None, head_dim: int) -> int:
    group = head_dim if group_size is None else group_size
    if group < 1 or head_dim % group:
        raise ValueError(
            f"The quantization group size {group_size} does not divide head_dim {head_dim}; use a divisor of "
            "head_dim, or leave it unset for one group per head."
        )
    return group


class BlockFormat(Protocol):
    """Bytes that one block of one layer and one KV head takes in some storage format.

    Per block (T = ``block_size`` tokens of one layer) and KV head, with D = head_dim, ``s`` the scale's bytes
    (fp16: 2) and ``g`` the value group (default D)::

        full precision (e bytes):     K codes T*D*e   + V codes T*D*e
        int8 / int4 / int2 (b bits):  K codes T*D*b/8 + V codes T*D*b/8 + K scale & zero per channel: D x 2 x s
                                                                        + V scale & zero per token:   T x D/g x 2 x s
        fp8 (e4m3):                   K codes T*D     + V codes T*D     + K scale & zero per channel: D x (s + 1)
                                                                        + V scale per token:          T x D/g x s
    """

    @property
    def name(self) -> str:
        """The format's name ('fp16', 'int8', ...)."""
        ...

    def block_bytes(self, block_size: int, head_dim: int) -> int:
        """Bytes of keys and values (codes and scales) for ``block_size`` tokens."""
        ...


@dataclass(frozen=True)
class FullPrecision:
    """Uncompressed keys and values, ``element_bytes`` each (fp32: 4, fp16/bf16: 2)."""

    name: str
    element_bytes: int

    def block_bytes(self, block_size: int, head_dim: int) -> int:
        return 2 * block_size * head_dim * self.element_bytes


@dataclass(frozen=True)
class IntegerKIVI:
    """Asymmetric integer codes: keys per channel, values per token (KIVI), a scale and a zero each, both of
    ``scale_bytes`` (one byte: a logarithmic scale byte and an e4m3 zero)."""

    name: str
    bits: int
    scale_bytes: int = 2
    value_group: int | None = None

    def block_bytes(self, block_size: int, head_dim: int) -> int:
        group = _check_group(self.value_group, head_dim)
        codes = 2 * math.ceil(block_size * head_dim * self.bits / 8)
        key_stats = head_dim * 2 * self.scale_bytes
        value_stats = block_size * (head_dim // group) * 2 * self.scale_bytes
        return codes + key_stats + value_stats


FP8_ZERO_BYTES = 1  # an fp8 key zero point is one e4m3 byte (`hf_kvgov.codecs.fp8`)


@dataclass(frozen=True)
class Float8:
    """One byte per element: keys centred per channel (a scale and a one-byte e4m3 zero), values a symmetric
    scale per (token, group)."""

    name: str
    scale_bytes: int = 2
    group_size: int | None = None

    def block_bytes(self, block_size: int, head_dim: int) -> int:
        group = _check_group(self.group_size, head_dim)
        key_stats = head_dim * (self.scale_bytes + FP8_ZERO_BYTES)
        value_scales = block_size * (head_dim // group) * self.scale_bytes
        return 2 * block_size * head_dim + key_stats + value_scales


# Codec name -> factory(scale_bytes, group_size). A registry, so a new codec is one entry, not a branch.
CODEC_FORMATS: dict[str, Callable[[int, int | None], BlockFormat]] = {
    "int8": lambda scale_bytes, group: IntegerKIVI("int8", 8, scale_bytes, group),
    "int4": lambda scale_bytes, group: IntegerKIVI("int4", 4, scale_bytes, group),
    "int2": lambda scale_bytes, group: IntegerKIVI("int2", 2, scale_bytes, group),
    "fp8": lambda scale_bytes, group: Float8("fp8", scale_bytes, group),
}


def codec_format(name: str, scale_bytes: int = 2, group_size: int | None = None) -> BlockFormat:
    """The sealed-block format of codec ``name`` ('int8', 'int4', 'int2', 'fp8')."""
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in CODEC_FORMATS:
        raise ValueError(f"Unknown KV codec {name!r}; accepted: {', '.join(CODEC_FORMATS)}.")
    check_scale_bytes(scale_bytes)
    return CODEC_FORMATS[key](scale_bytes, group_size)


def check_scale_bytes(scale_bytes: object) -> None:
    """Raise ValueError unless ``scale_bytes`` is a size the codecs store their statistics in."""
    if isinstance(scale_bytes, bool) or scale_bytes not in (1, 2, 4):
        raise ValueError(
            "Quantization scales are fp16 (scale_bytes=2), fp32 (4) or one byte (1: a logarithmic scale and an "
            f"e4m3 zero, `hf_kvgov.codecs.numerics`); got {scale_bytes!r}."
        )


class SlotLayout(Protocol):
    """Bytes of an eviction cache's kept slots of one layer and one KV head.

    An eviction cache keeps per-head slots dropped one at a time, so a codec groups each slot on its own, keys as
    values (`SlotCodes`; hence no zero point for fp8 slots). Per kept slot and KV head::

        int8/4/2:  K codes D*b/8 + V codes D*b/8 + (K, V) scale & zero per slot and group: 2 x D/g x 2 x s
        fp8:       K codes D     + V codes D     + (K, V) scale per slot and group:         2 x D/g x s
    """

    @property
    def name(self) -> str: ...

    def slot_bytes(self, head_dim: int) -> int:
        """Keys and values of one kept slot (codes and scales)."""
        ...


@dataclass(frozen=True)
class DenseSlotFormat:
    """Slots in the model's precision, ``element_bytes`` per element."""

    name: str
    element_bytes: int

    def slot_bytes(self, head_dim: int) -> int:
        return 2 * head_dim * self.element_bytes


@dataclass(frozen=True)
class SlotCodes:
    """Slots as codes: keys and values each grouped per slot, ``group_size`` channels per scale (None: the head)."""

    name: str
    bits: int
    zero_point: bool
    scale_bytes: int = 2
    group_size: int | None = None

    def slot_bytes(self, head_dim: int) -> int:
        group = _check_group(self.group_size, head_dim)
        stats = (2 if self.zero_point else 1) * (head_dim // group) * self.scale_bytes
        return 2 * (math.ceil(head_dim * self.bits / 8) + stats)


SLOT_CODECS: dict[str, Callable[[int, int | None], SlotLayout]] = {
    "int8": lambda scale_bytes, group: SlotCodes("int8", 8, True, scale_bytes, group),
    "int4": lambda scale_bytes, group: SlotCodes("int4", 4, True, scale_bytes, group),
    "int2": lambda scale_bytes, group: SlotCodes("int2", 2, True, scale_bytes, group),
    "fp8": lambda scale_bytes, group: SlotCodes("fp8", 8, False, scale_bytes, group),
}
