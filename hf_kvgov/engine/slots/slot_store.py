"""Where an eviction layer's kept slots live: as the model produced them, or as codec codes.

The cache only asks a slot store to be read, gathered (eviction) and row-selected (beam search), so it never
branches on how the slots are stored (quantized slots are attended in full precision, then encoded at commit)::

    DenseSlots       keys, values   [batch, kv_heads, slots, head_dim]    the model's dtype
    QuantizedSlots   keys, values   CodedSlots: codes + scales of each slot (see ``coded_slots``)

Keys are quantized per slot, not per channel as in KIVI, because an eviction cache drops tokens one at a time per
KV head and a group spanning dropped and kept tokens would need re-encoding. A per-channel divisor from the first
chunk does not help (RoPE moves magnitude within each channel pair as positions grow); smaller groups help int4.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from hf_kvgov.codecs import KVCodec
from hf_kvgov.engine.slots.coded_slots import CodedSlots, decode_slots, encode_slots
from hf_kvgov.policies import gather_kept


class SlotStore(Protocol):
    """K/V of one layer's kept slots, ``[batch, kv_heads, slots, head_dim]`` once read."""

    @property
    def count(self) -> int: ...  # slots per (sequence, KV head)

    @property
    def batch(self) -> int: ...

    @property
    def nbytes(self) -> int: ...  # bytes of K/V actually held (codes and scales when quantized)

    def read(self) -> tuple[Tensor, Tensor]: ...  # keys, values as attention reads them

    def gather(self, keep: Tensor) -> SlotStore: ...  # keep: long [batch, kv_heads, kept]

    def select_rows(self, rows: Tensor) -> SlotStore: ...  # rows: long [new_batch]


class SlotFormat(Protocol):
    """How one layer stores its slots; ``codec_name`` is None for the model's own precision."""

    @property
    def codec_name(self) -> str | None: ...

    def store(self, kept: SlotStore | None, keys: Tensor, values: Tensor, q_len: int) -> SlotStore:
        """The store after a step.

        Args:
            kept: the store before the step (None on the first step).
            keys, values: ``[batch, kv_heads, kept + q_len, head_dim]`` the step attended: the kept slots as
                read, then the ``q_len`` new ones.
            q_len: the step's new tokens.
        """
        ...


class SlotHome(Protocol):
    """Where a layer keeps its slots between steps: `OwnSlots`, or blocks of a pool (`PooledSlotHome`)."""

    @property
    def batch(self) -> int: ...

    @property
    def count(self) -> int: ...  # slots per (sequence, KV head) of the working store, fillers included

    @property
    def nbytes(self) -> int: ...  # bytes of K/V held

    def get(self) -> SlotStore | None: ...  # the slots as the step's working store; None when empty

    def put(self, store: SlotStore, valid: Tensor, beside: int = 0) -> None: ...  # keep `store`'s `valid` slots

    def release(self) -> None: ...


class OwnSlots:
    """A layer without a pool keeps the working store itself, padding and fillers included (`beside` and `valid`
    are for a pool, whose cap counts them). Measured faster than blocks on the CPU (eval/RESULTS.md)."""

    def __init__(self) -> None:
        self.store: SlotStore | None = None

    @property
    def batch(self) -> int:
        return 0 if self.store is None else self.store.batch

    @property
    def count(self) -> int:
        return 0 if self.store is None else self.store.count

    @property
    def nbytes(self) -> int:
        return 0 if self.store is None else self.store.nbytes

    def get(self) -> SlotStore | None:
        return self.store

    def put(self, store: SlotStore, valid: Tensor, beside: int = 0) -> None:
        self.store = store

    def release(self) -> None:
        self.store = None


@dataclass(frozen=True)
class DenseSlots:
    """Slots as the model produced them: ``keys``, ``values`` ``[batch, kv_heads, slots, head_dim]``."""

    keys: Tensor
    values: Tensor

    @property
    def count(self) -> int:
        return int(self.keys.shape[2])

    @property
    def batch(self) -> int:
        return int(self.keys.shape[0])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values))

    def read(self) -> tuple[Tensor, Tensor]:
        return self.keys, self.values

    def gather(self, keep: Tensor) -> DenseSlots:
        return DenseSlots(gather_kept(self.keys, keep), gather_kept(self.values, keep))

    def select_rows(self, rows: Tensor) -> DenseSlots:
        return DenseSlots(self.keys.index_select(0, rows), self.values.index_select(0, rows))


@dataclass(frozen=True)
class QuantizedSlots:
    """Slots as codes, keys and values encoded per slot; both decode with ``codec`` to ``dtype`` (the model's)."""

    keys: CodedSlots
    values: CodedSlots
    codec: KVCodec
    dtype: torch.dtype

    @property
    def count(self) -> int:
        return self.keys.count

    @property
    def batch(self) -> int:
        return int(self.keys.codes.shape[0])

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def read(self) -> tuple[Tensor, Tensor]:
        keys, values = decode_slots(self.codec, self.keys), decode_slots(self.codec, self.values)
        return keys.to(self.dtype), values.to(self.dtype)

    def gather(self, keep: Tensor) -> QuantizedSlots:
        return QuantizedSlots(self.keys.gather(keep), self.values.gather(keep), self.codec, self.dtype)

    def select_rows(self, rows: Tensor) -> QuantizedSlots:
        return QuantizedSlots(self.keys.select_rows(rows), self.values.select_rows(rows), self.codec, self.dtype)

    def cat(self, newer: QuantizedSlots) -> QuantizedSlots:
        """These slots followed by ``newer``'s along the slot axis."""
        return QuantizedSlots(self.keys.cat(newer.keys), self.values.cat(newer.values), self.codec, self.dtype)


@dataclass(frozen=True)
class DenseFormat:
    """Keep slots in the model's precision (the default, and `QuantConfig.full_precision_layers`)."""

    @property
    def codec_name(self) -> str | None:
        return None

    def store(self, kept: SlotStore | None, keys: Tensor, values: Tensor, q_len: int) -> SlotStore:
        return DenseSlots(keys, values)


@dataclass(frozen=True)
class QuantizedFormat:
    """Encode each step's new slots with ``codec`` (per-slot groups) and append them to the kept codes."""

    codec: KVCodec

    @property
    def codec_name(self) -> str | None:
        return self.codec.name

    def store(self, kept: SlotStore | None, keys: Tensor, values: Tensor, q_len: int) -> SlotStore:
        new = self.encode(keys[:, :, -q_len:], values[:, :, -q_len:])
        if kept is None:
            return new
        assert isinstance(kept, QuantizedSlots), "a quantized layer only ever holds quantized slots"
        return kept.cat(new)  # the kept codes are never decoded and encoded again

    def encode(self, keys: Tensor, values: Tensor) -> QuantizedSlots:
        """``keys``, ``values`` ``[batch, kv_heads, q_len, head_dim]`` as codes with scales per slot."""
        return QuantizedSlots(encode_slots(self.codec, keys), encode_slots(self.codec, values), self.codec, keys.dtype)
