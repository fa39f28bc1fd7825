"""The codec contract: ``Encoded`` (what is stored) and ``KVCodec`` (stateless encode/decode).

A codec turns one or more K/V blocks ``[*lead, T, H, D]`` into codes plus per-group scales (and zero
points for integer formats) and back. It holds configuration only; the cache decides *when* to encode
(a block is sealed) and where the pieces live. Every codec decodes in float32 and casts to the
requested dtype at the end, which is what a fused kernel does too.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from hf_kvgov.codecs.grouping import GroupAxis, ScaleGroups, check_block_shape, check_group_size
from hf_kvgov.codecs.numerics import (
    LOG_SCALE,
    ONE_BYTE_ZERO,
    SCALE_DTYPES,
    ZERO_DTYPES,
    check_input_dtype,
    check_output_dtype,
    require_finite,
    require_finite_stats,
    stat_to_float,
)


@dataclass(frozen=True, eq=False)
class Encoded:
    """One encoded K or V tensor: packed codes and their per-group statistics.

    Attributes:
        codes: the codes, shape ``[*lead, T, H, D * bits // 8]`` (packing runs along head_dim only).
        scale: per-group scales, shape ``ScaleGroups.stat_shape`` (``[*lead, 1, H, D]`` for keys,
            ``[*lead, T, H, D // group_size]`` for values), float16, float32 or one logarithmic byte
            (``numerics.LOG_SCALE``).
        zero: per-group zero points with the shape of ``scale``, in the codec's ``zero_dtype`` (a float
            scale's dtype, or float8_e4m3fn beside one-byte scales and for fp8 keys), or None where the codec
            keeps none for this grouping (fp8 values; see ``KVCodec.zero_axes``).
        shape: shape ``[*lead, T, H, D]`` of the tensor that was encoded.
        axis: ``GroupAxis.CHANNEL`` (keys, one scale per channel over the tokens) or
            ``GroupAxis.TOKEN`` (values, one scale per token and head_dim group).
        group_size: elements sharing one scale: ``T`` for CHANNEL, the head_dim slice for TOKEN.
        codec: name of the codec that produced it; decoding with another codec is refused.
    """

    codes: Tensor
    scale: Tensor
    zero: Tensor | None
    shape: tuple[int, ...]
    axis: GroupAxis
    group_size: int
    codec: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        layout = self.layout  # validates shape, axis and group_size
        stats = [("scale", self.scale)] + ([] if self.zero is None else [("zero", self.zero)])
        for label, stat in stats:
            if tuple(stat.shape) != layout.stat_shape:
                raise ValueError(
                    f"The {label} tensor of a {self.axis.value}-grouped encoding of shape {self.shape} must "
                    f"have shape {layout.stat_shape}; got {tuple(stat.shape)}."
                )
            accepted = SCALE_DTYPES if label == "scale" else ZERO_DTYPES
            if stat.dtype not in accepted:
                names = ", ".join(str(d).removeprefix("torch.") for d in accepted)
                raise ValueError(f"The {label} tensor must be one of {names}; got {stat.dtype}.")
        if tuple(self.codes.shape[:-1]) != self.shape[:-1]:
            raise ValueError(
                f"The codes must share all but the last dim with the encoded shape {self.shape}; got codes "
                f"of shape {tuple(self.codes.shape)}."
            )

    @property
    def layout(self) -> ScaleGroups:
        """The grouping these statistics follow."""
        return ScaleGroups(self.shape, self.axis, self.group_size)

    @property
    def nbytes(self) -> int:
        """Real bytes held: codes + scales + zero points."""
        pieces = [self.codes, self.scale] + ([] if self.zero is None else [self.zero])
        return sum(t.numel() * t.element_size() for t in pieces)


@dataclass(frozen=True)
class KVCodec(ABC):
    """A stateless K/V block codec; subclasses fix the number format.

    Attributes:
        group_size: head_dim elements per value scale (None: the whole head_dim). Keys always use one
            scale per channel over the block's tokens. Must divide head_dim (checked on encode).
        scale_dtype: storage dtype of scales: torch.float16 (default), torch.float32, or
            ``numerics.LOG_SCALE`` (one logarithmic byte, with one-byte e4m3 zero points). Zero points are
            in a float scale's dtype unless the format says otherwise (``zero_dtype``).
        check_finite: reject NaN/inf input with a ValueError (one reduction and host sync per call);
            turn off on hot paths that already guarantee finite K/V.
    """

    group_size: int | None = None
    scale_dtype: torch.dtype = torch.float16
    check_finite: bool = True

    name: ClassVar[str]
    bits: ClassVar[int]
    zero_axes: ClassVar[frozenset[GroupAxis]]
    """The groupings whose encodings carry a zero point: both for integer codes, keys only for fp8."""
    codes_dtype: ClassVar[torch.dtype]

    def __post_init__(self) -> None:
        gs = self.group_size
        if gs is not None and (isinstance(gs, bool) or not isinstance(gs, int) or gs < 1):
            raise ValueError(f"group_size must be a positive int or None; got {gs!r}.")
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(
                "scale_dtype must be torch.float16, torch.float32 or torch.uint8 (one logarithmic byte, "
                f"numerics.LOG_SCALE); got {self.scale_dtype!r}."
            )

    # ---- public API -------------------------------------------------------------------------------

    def encode_keys(self, k: Tensor) -> Encoded:
        """Encode keys ``[*lead, T, H, D]`` with one scale per (head, channel) over the T tokens."""
        return self._encode(k, GroupAxis.CHANNEL, "keys")

    def encode_values(self, v: Tensor) -> Encoded:
        """Encode values ``[*lead, T, H, D]`` with one scale per (token, head, head_dim group)."""
        return self._encode(v, GroupAxis.TOKEN, "values")

    @property
    def zero_dtype(self) -> torch.dtype:
        """Storage dtype of zero points: a float scale's, one e4m3 byte beside one-byte scales, unless a format
        stores them more compactly."""
        return ONE_BYTE_ZERO if self.scale_dtype == LOG_SCALE else self.scale_dtype

    def decode(self, enc: Encoded, dtype: torch.dtype) -> Tensor:
        """Decode ``enc`` to a ``[*lead, T, H, D]`` tensor of ``dtype`` (math in float32)."""
        check_output_dtype(dtype)
        if enc.codec != self.name:
            raise ValueError(f"The {self.name} codec cannot decode data encoded by the {enc.codec} codec.")
        self._check_codes(enc)
        layout = enc.layout
        codes = layout.to_groups(self._unpack(enc.codes))
        scale = stat_to_float(layout.load_stat(enc.scale))
        zero = None if enc.zero is None else stat_to_float(layout.load_stat(enc.zero))
        return layout.from_groups(self._dequantize(codes, scale, zero)).to(dtype)

    def nbytes(self, enc: Encoded) -> int:
        """Real bytes of ``enc``: codes + scales + zero points."""
        return enc.nbytes

    def bytes_per_token(self, num_kv_heads: int, head_dim: int, block_size: int) -> float:
        """Bytes one token costs in one layer, keys and values together, scales amortised per block.

        Equals ``(nbytes(encode_keys(b)) + nbytes(encode_values(b))) / block_size`` for a full block
        ``b`` of shape ``[block_size, num_kv_heads, head_dim]``.
        """
        for label, n in (("num_kv_heads", num_kv_heads), ("head_dim", head_dim), ("block_size", block_size)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{label} must be a positive int; got {n!r}.")
        self._check_head_dim(head_dim)
        group = head_dim if self.group_size is None else self.group_size
        check_group_size(group, head_dim)
        codes = 2 * num_kv_heads * head_dim * self.bits // 8
        key_stats = num_kv_heads * head_dim * self._stat_bytes(GroupAxis.CHANNEL) / block_size
        value_stats = num_kv_heads * (head_dim // group) * self._stat_bytes(GroupAxis.TOKEN)
        return codes + key_stats + value_stats

    def _stat_bytes(self, axis: GroupAxis) -> int:
        """Bytes of one group's statistics under ``axis``: a scale, and a zero point where the codec keeps one."""
        return self.scale_dtype.itemsize + (self.zero_dtype.itemsize if axis in self.zero_axes else 0)

    # ---- hooks for a number format ----------------------------------------------------------------

    @abstractmethod
    def _quantize(self, grouped: Tensor, dim: int, with_zero: bool) -> tuple[Tensor, Tensor, Tensor | None]:
        """Float32 grouped view -> (codes, scale, zero), stats keepdim along ``dim``, in scale_dtype.

        ``with_zero``: this grouping carries a zero point (``zero_axes``); the zero is None otherwise.
        """

    @abstractmethod
    def _dequantize(self, codes: Tensor, scale: Tensor, zero: Tensor | None) -> Tensor:
        """Grouped codes and broadcastable float32 stats -> float32 values."""

    def _pack(self, codes: Tensor) -> Tensor:
        """Unpacked codes ``[..., D]`` -> stored codes; identity for one-byte formats."""
        return codes

    def _unpack(self, codes: Tensor) -> Tensor:
        """Stored codes -> unpacked codes ``[..., D]``; identity for one-byte formats."""
        return codes

    def _check_head_dim(self, head_dim: int) -> None:
        """Raise ValueError if head_dim does not fill whole bytes of packed codes."""
        per_byte = 8 // self.bits
        if head_dim % per_byte:
            raise ValueError(
                f"The {self.name} codec packs {per_byte} codes per byte along head_dim, so head_dim must "
                f"be a multiple of {per_byte}; got head_dim={head_dim}. Use a codec with one byte per code "
                "(int8, fp8_e4m3, fp8_e5m2) for this model."
            )

    # ---- shared plumbing --------------------------------------------------------------------------

    def _encode(self, x: Tensor, axis: GroupAxis, what: str) -> Encoded:
        check_input_dtype(x, what)
        check_block_shape(tuple(x.shape), what)
        self._check_head_dim(x.shape[-1])
        layout = ScaleGroups.for_block(tuple(x.shape), axis, self.group_size)  # validates group_size
        if self.check_finite:
            require_finite(x, what, self.name)
        codes, scale, zero = self._quantize(layout.to_groups(x.float()), layout.reduce_dim, axis in self.zero_axes)
        stats = (scale,) if zero is None else (scale, zero)
        if self.check_finite:
            require_finite_stats(stats, what, self.name, self.scale_dtype)
        return Encoded(
            codes=self._pack(layout.from_groups(codes)),
            scale=layout.store_stat(scale),
            zero=None if zero is None else layout.store_stat(zero),
            shape=layout.shape,
            axis=axis,
            group_size=layout.group_size,
            codec=self.name,
        )

    def _check_codes(self, enc: Encoded) -> None:
        expected_last = enc.shape[-1] * self.bits // 8
        if enc.codes.dtype != self.codes_dtype or enc.codes.shape[-1] != expected_last:
            raise ValueError(
                f"The {self.name} codec expects codes of dtype {self.codes_dtype} with last dim "
                f"{expected_last} for head_dim {enc.shape[-1]}; got {enc.codes.dtype} with last dim "
                f"{enc.codes.shape[-1]}."
            )
        needs_zero = enc.axis in self.zero_axes
        if (enc.zero is None) == needs_zero:
            raise ValueError(
                f"The {self.name} codec {'needs' if needs_zero else 'takes no'} zero points for "
                f"{enc.axis.value}-grouped codes; got zero={'None' if enc.zero is None else 'a tensor'}."
            )
