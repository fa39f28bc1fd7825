"""How one layer of a sealed block is stored: encoded by a codec, or kept in full precision.

A sealed block is a full K/V block that will never be written again, stored per layer as named *pieces*, each a
tensor with one leading dim per block. A `SealedFormat` says which pieces a block needs (`layout`) and converts
(`encode`, `decode`); it holds no data, and takes the piece shapes from the codec (one dummy block is encoded at
construction), so the storage never repeats a codec's packing arithmetic::

    CodecFormat(Int8Codec())    ->  key_codes, key_scale, key_zero, value_codes, value_scale, value_zero
    CodecFormat(Fp8E4M3Codec()) ->  key_codes, key_scale, key_zero, value_codes, value_scale  (no value zero)
    RawFormat(torch.float32)    ->  keys, values                      (a layer kept in full precision)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import Tensor

from hf_kvgov.codecs.base import Encoded, KVCodec
from hf_kvgov.codecs.grouping import GroupAxis

# name -> (shape of one block's piece, dtype)
PieceLayout = dict[str, tuple[tuple[int, ...], torch.dtype]]


def piece_bytes(layout: PieceLayout) -> tuple[int, ...]:
    """Bytes of each piece of one block, in the layout's order."""
    return tuple(int(torch.Size(shape).numel()) * dtype.itemsize for shape, dtype in layout.values())


class SealedFormat(ABC):
    """Stateless description of how one layer of a sealed block is stored."""

    @property
    @abstractmethod
    def name(self) -> str:
        """Short name shown in stats and reports ("int8", "fp8_e4m3", "full")."""

    @abstractmethod
    def layout(self, block_size: int, num_kv_heads: int, head_dim: int) -> PieceLayout:
        """The pieces one block needs, each as (shape without the leading block dim, dtype)."""

    def block_bytes(self, block_size: int, num_kv_heads: int, head_dim: int) -> int:
        """Bytes of one block of one layer in this format: every piece."""
        return sum(piece_bytes(self.layout(block_size, num_kv_heads, head_dim)))

    @abstractmethod
    def encode(self, keys: Tensor, values: Tensor) -> dict[str, Tensor]:
        """`keys`, `values` `[n, block_size, H, D]` -> pieces, each `[n, *shape]` as in `layout`."""

    @abstractmethod
    def decode(self, pieces: dict[str, Tensor], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Pieces of n blocks -> keys, values `[n, block_size, H, D]` of `dtype`."""


@dataclass(frozen=True)
class CodecFormat(SealedFormat):
    """Keys and values encoded by `codec` (keys per channel over the block, values per token)."""

    codec: KVCodec

    @property
    def name(self) -> str:
        return self.codec.name

    def layout(self, block_size: int, num_kv_heads: int, head_dim: int) -> PieceLayout:
        # bytes_per_token validates head_dim and group_size with a full-sentence ValueError.
        self.codec.bytes_per_token(num_kv_heads, head_dim, block_size)
        dummy = torch.zeros(1, block_size, num_kv_heads, head_dim)
        pieces = self.encode(dummy, dummy)
        return {name: (tuple(t.shape[1:]), t.dtype) for name, t in pieces.items()}

    def encode(self, keys: Tensor, values: Tensor) -> dict[str, Tensor]:
        pieces: dict[str, Tensor] = {}
        for prefix, enc in (("key", self.codec.encode_keys(keys)), ("value", self.codec.encode_values(values))):
            pieces[f"{prefix}_codes"] = enc.codes
            pieces[f"{prefix}_scale"] = enc.scale
            if enc.zero is not None:
                pieces[f"{prefix}_zero"] = enc.zero
        return pieces

    def decode(self, pieces: dict[str, Tensor], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        # Keys' scale is [n, 1, H, D] and carries head_dim; values' scale is [n, T, H, D // group].
        n, block_size, heads, _ = pieces["key_codes"].shape
        head_dim = pieces["key_scale"].shape[-1]
        shape = (n, block_size, heads, head_dim)
        group = head_dim // pieces["value_scale"].shape[-1]
        keys = self._encoded(pieces, "key", shape, GroupAxis.CHANNEL, block_size)
        values = self._encoded(pieces, "value", shape, GroupAxis.TOKEN, group)
        return self.codec.decode(keys, dtype), self.codec.decode(values, dtype)

    def _encoded(
        self, pieces: dict[str, Tensor], prefix: str, shape: tuple[int, ...], axis: GroupAxis, group: int
    ) -> Encoded:
        return Encoded(
            codes=pieces[f"{prefix}_codes"],
            scale=pieces[f"{prefix}_scale"],
            zero=pieces.get(f"{prefix}_zero"),
            shape=shape,
            axis=axis,
            group_size=group,
            codec=self.codec.name,
        )


@dataclass(frozen=True)
class RawFormat(SealedFormat):
    """Keys and values kept as they are, in `dtype` (a layer excluded from quantization)."""

    dtype: torch.dtype

    def __post_init__(self) -> None:
        if not self.dtype.is_floating_point:
            raise TypeError(f"RawFormat keeps K/V in a floating-point dtype; got {self.dtype}.")

    @property
    def name(self) -> str:
        return "full"

    def layout(self, block_size: int, num_kv_heads: int, head_dim: int) -> PieceLayout:
        shape = (block_size, num_kv_heads, head_dim)
        return {"keys": (shape, self.dtype), "values": (shape, self.dtype)}

    def encode(self, keys: Tensor, values: Tensor) -> dict[str, Tensor]:
        return {"keys": keys.to(self.dtype), "values": values.to(self.dtype)}

    def decode(self, pieces: dict[str, Tensor], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        return pieces["keys"].to(dtype), pieces["values"].to(dtype)
