"""One of K or V of an eviction layer's kept slots, as codec codes with a scale per slot.

An eviction cache drops tokens one at a time and per KV head, so every statistic must belong to a single slot:
then dropping slots is a gather of codes and scales, and the codes that stay are never decoded and encoded again.
The codec groups each slot along head_dim (its TOKEN grouping, ``group_size`` elements per scale)::

    codes   uint8    [batch, kv_heads, slots, head_dim * bits / 8]   raw bytes (fp8 codes viewed as uint8)
    scale   float16  [batch, kv_heads, slots, head_dim / group]      one per slot and head_dim group
    zero    float16  same as scale, or None (fp8 has no zero point)

Codes are raw bytes because CPU torch cannot gather float8 tensors; decoding views them as the codec's dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from hf_kvgov.codecs import Encoded, GroupAxis, KVCodec
from hf_kvgov.policies import gather_kept


@dataclass(frozen=True)
class CodedSlots:
    """Codes ``[b, h, s, packed]`` and per-slot statistics ``[b, h, s, head_dim / group]`` (see the module)."""

    codes: Tensor
    scale: Tensor
    zero: Tensor | None
    head_dim: int
    group_size: int

    @property
    def count(self) -> int:
        """Slots per (sequence, KV head)."""
        return int(self.codes.shape[2])

    @property
    def nbytes(self) -> int:
        """Bytes held: codes + scales + zero points."""
        pieces = [self.codes, self.scale] + ([] if self.zero is None else [self.zero])
        return sum(t.numel() * t.element_size() for t in pieces)

    def gather(self, keep: Tensor) -> CodedSlots:
        """The slots ``keep`` (long ``[b, h, kept]``) picks, codes and statistics moved together."""
        return self._map(lambda t: gather_kept(t, keep))

    def select_rows(self, rows: Tensor) -> CodedSlots:
        """Rows ``rows`` (long ``[new_batch]``) of the batch, in that order."""
        return self._map(lambda t: t.index_select(0, rows))

    def cat(self, newer: CodedSlots) -> CodedSlots:
        """These slots followed by ``newer``'s along the slot axis."""
        zero = None if self.zero is None or newer.zero is None else torch.cat((self.zero, newer.zero), dim=2)
        return CodedSlots(
            torch.cat((self.codes, newer.codes), dim=2),
            torch.cat((self.scale, newer.scale), dim=2),
            zero,
            self.head_dim,
            self.group_size,
        )

    def _map(self, move: Callable[[Tensor], Tensor]) -> CodedSlots:
        zero = None if self.zero is None else move(self.zero)
        return CodedSlots(move(self.codes), move(self.scale), zero, self.head_dim, self.group_size)


def encode_slots(codec: KVCodec, x: Tensor) -> CodedSlots:
    """``x`` ``[b, h, s, head_dim]`` (float) -> its codes, one group of scales per slot."""
    # The codec encodes [*lead, T, H, D]; a unit H axis makes each slot one token of its own groups.
    encoded = codec.encode_values(x.unsqueeze(-2))
    return CodedSlots(
        codes=encoded.codes.squeeze(-2).view(torch.uint8),
        scale=encoded.scale.squeeze(-2),
        zero=None if encoded.zero is None else encoded.zero.squeeze(-2),
        head_dim=int(x.shape[-1]),
        group_size=encoded.group_size,
    )


def decode_slots(codec: KVCodec, slots: CodedSlots) -> Tensor:
    """Float32 ``[b, h, s, head_dim]``: what ``slots`` encode, exactly as ``codec.decode`` computes it."""
    batch, heads, count = slots.codes.shape[:3]
    encoded = Encoded(
        codes=slots.codes.view(codec.codes_dtype).unsqueeze(-2),
        scale=slots.scale.unsqueeze(-2),
        zero=None if slots.zero is None else slots.zero.unsqueeze(-2),
        shape=(batch, heads, count, 1, slots.head_dim),
        axis=GroupAxis.TOKEN,
        group_size=slots.group_size,
        codec=codec.name,
    )
    return codec.decode(encoded, torch.float32).squeeze(-2)
