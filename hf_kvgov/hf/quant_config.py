"""`QuantConfig`: what a `QuantizedCache` stores in reduced precision, validated on construction."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from hf_kvgov.codecs.base import KVCodec
from hf_kvgov.codecs.registry import get_codec
from hf_kvgov.storage.sealed_formats import CodecFormat, RawFormat, SealedFormat

# The block size for the most compact sealed blocks. Keys carry one scale (and zero point) per channel per
# block, so their cost per token falls as 1 / block_size; values carry theirs per token. Per KV head and
# token, as a fraction of float16 K + V (4 x head_dim bytes), with fp16 scales:
#
#     int8  1/2 + 1/block_size + 1/head_dim        fp8  1/2 + 1/(2 block_size) + 1/(2 head_dim)
#     int4  1/4 + 1/block_size + 1/head_dim
#
# At head_dim 64 (SmolLM2) blocks of 16 (QuantizedCache's default, like PagedCache's) give int8 0.578, fp8
# 0.539, int4 0.328; blocks of 128 give 0.523, 0.512 and 0.273, within 0.53 / 0.53 / 0.30 for head_dim >= 64
# (blocks of 64 leave int8 at 0.531). Quality does not suffer: on SmolLM2, 2,048 tokens, int8 +0.00%, fp8
# +0.35%, int4 +0.27% perplexity. The price is a larger full-precision sink and tail per row (up to 2 x 128
# tokens), which is why it is not the default: a short prompt would then hold nothing sealed.
COMPACT_BLOCK_SIZE = 128

# (fmt, bits) -> codec name. "fp8" is e4m3: one more mantissa bit than e5m2, and K/V never need e5m2's range
# once every group has its own scale.
CODEC_NAMES: dict[tuple[str, int], str] = {
    ("int", 8): "int8",
    ("int", 4): "int4",
    ("fp8", 8): "fp8_e4m3",
    ("fp8_e4m3", 8): "fp8_e4m3",
    ("fp8_e5m2", 8): "fp8_e5m2",
}


@dataclass(frozen=True)
class QuantConfig:
    """How a `QuantizedCache` stores sealed blocks.

    Attributes:
        bits: 8 or 4 (4 only with fmt="int").
        fmt: "int" (asymmetric integer codes), "fp8" (= "fp8_e4m3") or "fp8_e5m2".
        residual: the newest `residual` tokens stay in full precision (a block is sealed once it is full
            and all its tokens are older than that); 0 seals every full block.
        sink_blocks: leading blocks kept in full precision (attention sinks, where outliers live).
        full_precision_layers: layers whose sealed blocks are stored unquantized.
        group_size: head_dim elements per value scale (None: one scale per token and head).
    """

    bits: int = 8
    fmt: str = "int"
    residual: int = 0
    sink_blocks: int = 1
    full_precision_layers: tuple[int, ...] = ()
    group_size: int | None = None

    def __post_init__(self) -> None:
        if (self.fmt, self.bits) not in CODEC_NAMES:
            accepted = ", ".join(f"fmt={f!r} bits={b}" for f, b in CODEC_NAMES)
            raise ValueError(f"No KV format for fmt={self.fmt!r} with bits={self.bits!r}; accepted: {accepted}.")
        for name in ("residual", "sink_blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int; got {value!r}.")
        layers = _layer_tuple(self.full_precision_layers)
        object.__setattr__(self, "full_precision_layers", layers)
        self.codec()  # validates group_size

    @property
    def codec_name(self) -> str:
        return CODEC_NAMES[(self.fmt, self.bits)]

    def codec(self) -> KVCodec:
        return get_codec(self.codec_name, group_size=self.group_size)

    def check_model(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int) -> None:
        """Raise ValueError if this configuration cannot serve a model of this geometry."""
        outside = [layer for layer in self.full_precision_layers if layer >= num_layers]
        if outside:
            raise ValueError(
                f"full_precision_layers {outside} are not layers of this model, which has layers 0..{num_layers - 1}."
            )
        self.codec().bytes_per_token(num_kv_heads, head_dim, block_size)  # head_dim / group_size fit the codec

    def formats(self, num_layers: int, dtype: torch.dtype) -> list[SealedFormat]:
        """The sealed format of each layer."""
        quantized = CodecFormat(self.codec())
        raw = RawFormat(dtype)
        return [raw if layer in self.full_precision_layers else quantized for layer in range(num_layers)]

    def describe(self) -> str:
        """One line for reports, e.g. "int4, layers 0, 1 in full precision"."""
        text = self.codec_name
        if self.group_size is not None:
            text += f" (value groups of {self.group_size})"
        if self.residual:
            text += f", newest {self.residual} tokens in full precision"
        if self.full_precision_layers:
            text += f", layers {', '.join(map(str, self.full_precision_layers))} in full precision"
        return text


def _layer_tuple(layers: Iterable[int]) -> tuple[int, ...]:
    if isinstance(layers, (str, bytes)):
        raise TypeError(f"full_precision_layers must be layer indices (ints); got {layers!r}.")
    values = tuple(layers)
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
        raise ValueError(f"full_precision_layers must be non-negative ints; got {values!r}.")
    return tuple(sorted(set(values)))
