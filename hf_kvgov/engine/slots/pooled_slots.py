"""Kept slots in pool blocks: where an eviction layer with a pool keeps its slots between steps (`PooledSlotHome`).

An eviction pool has one layer group per layer, so a block id is one layer's block, read as ``block_size x
kv_heads`` slot records. Records are bytes (model dtype, or codes then scales), so one pool serves dense and
quantized caches; `SlotRecords` gives how a layer's slots become records and back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from hf_kvgov.engine.slots.coded_slots import CodedSlots
from hf_kvgov.engine.slots.slot_store import DenseSlots, QuantizedFormat, QuantizedSlots, SlotFormat, SlotStore
from hf_kvgov.errors import PoolExhausted
from hf_kvgov.storage.layer_groups import LayerGroup
from hf_kvgov.storage.pool import BlockPool


def per_layer_groups(windows: Sequence[int | None]) -> tuple[LayerGroup, ...]:
    """One group per layer: a block id is one layer's block (see `PooledSlotHome`)."""
    return tuple(LayerGroup((layer,), window) for layer, window in enumerate(windows))


class SlotRecords:
    """How one layer's slots become byte records of the pool and back.

    ``width`` is the bytes of one slot's K (or V) record of one KV head; a pool row is ``row_bytes`` wide.
    """

    def __init__(self, slot_format: SlotFormat, head_dim: int, dtype: torch.dtype) -> None:
        self.format = slot_format
        self.head_dim = head_dim
        self.dtype = dtype
        self.element = torch.empty((), dtype=dtype).element_size()
        self.coded: tuple[int, int, int] | None = None  # codes, scale and zero-point bytes of a coded record
        if isinstance(slot_format, QuantizedFormat):
            probe = slot_format.encode(torch.zeros(1, 1, 1, head_dim), torch.zeros(1, 1, 1, head_dim))
            self.coded = _coded_widths(probe.keys)
            self.width = sum(self.coded)
        else:
            self.width = head_dim * self.element

    def to_records(self, store: SlotStore) -> tuple[Tensor, Tensor]:
        """K and V records, uint8 ``[batch, kv_heads, slots, width]``."""
        if isinstance(store, DenseSlots):
            return _bytes(store.keys), _bytes(store.values)
        assert isinstance(store, QuantizedSlots), f"a slot store of type {type(store).__name__} has no records"
        return _coded_bytes(store.keys), _coded_bytes(store.values)

    def from_records(self, keys: Tensor, values: Tensor) -> SlotStore:
        """The store whose records are ``keys``/``values`` uint8 ``[batch, kv_heads, slots, >= width]``."""
        keys, values = keys[..., : self.width], values[..., : self.width]
        if self.coded is None:
            return DenseSlots(_typed(keys, self.dtype), _typed(values, self.dtype))
        assert isinstance(self.format, QuantizedFormat)
        codec = self.format.codec
        return QuantizedSlots(self._coded(keys), self._coded(values), codec, self.dtype)

    def _coded(self, records: Tensor) -> CodedSlots:
        assert self.coded is not None
        codes_bytes, scale_bytes, zero_bytes = self.coded
        codes = records[..., :codes_bytes].contiguous()
        scale = _typed(records[..., codes_bytes : codes_bytes + scale_bytes], torch.float16)
        zero = None if not zero_bytes else _typed(records[..., codes_bytes + scale_bytes :], torch.float16)
        group_size = self.head_dim // (scale_bytes // 2)
        return CodedSlots(codes, scale, zero, self.head_dim, group_size)


class PooledSlotHome:
    """Where one eviction layer's slots live between steps: block tables over a pool, one per batch row.

    Each row of a layer stores only its valid slots, as one stream::

        row r's stream     head 0's valid slots in slot order, then head 1's, ...    (c_0 + c_1 + ... records)
        record j           block tables[r][j // (block_size x kv_heads)], record j % (block_size x kv_heads)

    A stream, because heads keep different tokens (and numbers of them, under `HeadAdaptive`): padding takes no
    memory or per-head table, and a smaller layer budget holds fewer blocks. Blocks are allocated before any write,
    so `PoolExhausted` changes nothing; writes hold the pool's lock (another request may grow its tensors), reads
    need none (one owner).
    """

    def __init__(self, pool: BlockPool, layer: int, records: SlotRecords) -> None:
        self.pool = pool
        self.layer = layer
        self.records = records
        self.tables: list[list[int]] = []
        self.count = 0  # slots per (row, KV head) of the working store, fillers included
        self.valid: Tensor | None = None  # bool [batch, kv_heads, count]: the slots the blocks hold
        self._places: Tensor | None = None  # the pool record of each valid slot (`_locate`)
        self._cached: SlotStore | None = None  # the store read this step, until the commit writes the next

    @property
    def batch(self) -> int:
        return len(self.tables)

    @property
    def per_block(self) -> int:
        """Slot records one block holds: ``block_size`` rows of ``kv_heads`` records."""
        return self.pool.block_size * self.pool.geometry.num_kv_heads

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks held (whole blocks: a partly filled last block counts in full)."""
        return sum(len(table) for table in self.tables) * self.pool.bytes_per_block

    def get(self) -> SlotStore | None:
        """The slots as the working store (read from the blocks once per step), or None when empty."""
        if not self.tables:
            return None
        if self._cached is None:
            self._cached = self._read()
        return self._cached

    def put(self, store: SlotStore, valid: Tensor, beside: int = 0) -> None:
        """Keep the ``valid`` slots of ``store`` (bool ``[batch, kv_heads, slots]``) in this layer's blocks, and
        charge the pool ``beside`` bytes the layer keeps next to them (positions, mass, statistics, recall).

        Raises `PoolExhausted` and changes nothing when the pool cannot hand out the blocks or bytes.
        """
        if valid.shape != (store.batch, self.pool.geometry.num_kv_heads, store.count):
            raise ValueError(
                f"layer {self.layer}: the validity of {store.batch} rows x {store.count} slots must be "
                f"[batch, kv_heads, slots] = {(store.batch, self.pool.geometry.num_kv_heads, store.count)}; "
                f"got {tuple(valid.shape)}."
            )
        rows = store.batch
        needs = [-(-int(held) // self.per_block) for held in valid.sum(dim=(1, 2)).tolist()]
        old = self.tables + [[] for _ in range(rows - len(self.tables))]
        missing = sum(max(0, need - len(table)) for need, table in zip(needs, old, strict=False))
        charged = self.pool.charged(self)
        self.pool.charge(self, beside)  # raises before anything changes
        try:
            fresh = iter(self.pool.allocate(missing))  # raises before anything is written
        except PoolExhausted:
            self.pool.charge(self, charged)
            raise
        tables = [
            table[:need] + [next(fresh) for _ in range(need - len(table[:need]))]
            for need, table in zip(needs, old, strict=False)
        ]
        spare = [block for need, table in zip(needs, old, strict=False) for block in table[need:]]
        spare += [block for table in old[rows:] for block in table]
        places = _locate(valid, tables, self.per_block) if any(tables) else None
        if places is not None:
            self._write(store, valid, places)
        self.tables, self.count, self.valid, self._places, self._cached = tables, store.count, valid, places, None
        if spare:
            self.pool.decref(spare)

    def _blocks(self) -> list[int]:
        """Every block the rows' tables hold, row by row."""
        return [block for table in self.tables for block in table]

    def copy(self) -> PooledSlotHome:
        """A home on the same pool holding copies of this one's blocks and its charge (a copy of the cache writes its
        own blocks each step). Raises `PoolExhausted`, holding nothing, when the pool cannot hand them out."""
        copied = PooledSlotHome(self.pool, self.layer, self.records)
        held = self._blocks()
        self.pool.charge(copied, self.pool.charged(self))
        try:
            fresh = self.pool.allocate(len(held))
        except PoolExhausted:
            self.pool.charge(copied, 0)
            raise
        blocks = iter(fresh)
        copied.tables = [[next(blocks) for _ in table] for table in self.tables]
        if held:
            with self.pool.lock:  # another request may grow the pool's tensors meanwhile
                source, target = (torch.tensor(ids, dtype=torch.long) for ids in (held, fresh))
                for tensor in (self.pool.keys[self.layer], self.pool.values[self.layer]):
                    tensor.index_copy_(0, target.to(tensor.device), tensor.index_select(0, source.to(tensor.device)))
        copied.count, copied.valid = self.count, None if self.valid is None else self.valid.clone()
        if self.valid is not None and any(copied.tables):
            copied._places = _locate(self.valid, copied.tables, self.per_block)
        return copied

    def release(self) -> None:
        """Give every block and charged byte back to the pool."""
        held = self._blocks()
        self.tables, self.count, self.valid, self._places, self._cached = [], 0, None, None, None
        self.pool.charge(self, 0)
        if held:
            self.pool.decref(held)

    def _write(self, store: SlotStore, valid: Tensor, places: Tensor) -> None:
        keys, values = self.records.to_records(store)  # [b, hk, s, width]
        with self.pool.lock:  # another request may grow the pool's tensors meanwhile
            for records, target in ((keys, self.pool.keys[self.layer]), (values, self.pool.values[self.layer])):
                words, unit = _words(_record_view(target, self.per_block), self.records.width)
                rows = words.view(-1, words.shape[-1])[:, : self.records.width // unit]
                source = _as_words(records, unit)[valid.to(records.device)]
                rows.index_copy_(0, places.to(target.device), source.to(target.device))

    def _read(self) -> SlotStore:
        assert self.valid is not None
        parts = []
        for source in (self.pool.keys[self.layer], self.pool.values[self.layer]):
            words, _ = _words(_record_view(source, self.per_block), self.records.width)
            slots = words.new_zeros((*self.valid.shape, words.shape[-1]))  # fillers read as zeros: never attended
            if self._places is not None:  # None: every row's slots are fillers, all zeros
                rows = words.view(-1, words.shape[-1]).index_select(0, self._places.to(words.device))
                slots[self.valid.to(words.device)] = rows
            parts.append(slots.view(torch.uint8))
        return self.records.from_records(parts[0], parts[1])


def check_eviction_pool(pool: BlockPool, windows: Sequence[int | None], heads: int, widths: Sequence[int],
                        dtype: torch.dtype, owner: str) -> None:  # fmt: skip
    """Refuse a pool not laid out for these eviction slots, naming what differs and how to build one."""
    geometry = pool.geometry
    element = torch.empty((), dtype=dtype).element_size()
    expected = {
        "layers": (geometry.num_layers, len(windows)),
        "KV heads": (geometry.num_kv_heads, heads),
        "dtype": (geometry.dtype, dtype),
        "record elements": (geometry.head_dim, math.ceil(max(widths) / element)),
        "layer groups": (pool.groups, per_layer_groups(windows)),
    }
    wrong = [f"{name} {got} (needs {want})" for name, (got, want) in expected.items() if got != want]
    if wrong:
        raise ValueError(
            f"{owner}: the pool is not laid out for this model's eviction slots: {'; '.join(wrong)}. Build it "
            "with hf_kvgov.eviction_pool(model, codec=...), with the codec the caches store their slots in."
        )


def _coded_widths(slots: CodedSlots) -> tuple[int, int, int]:
    zero = 0 if slots.zero is None else slots.zero.shape[-1] * 2
    return int(slots.codes.shape[-1]), int(slots.scale.shape[-1]) * 2, zero


def _coded_bytes(slots: CodedSlots) -> Tensor:
    pieces = [slots.codes, _bytes(slots.scale)] + ([] if slots.zero is None else [_bytes(slots.zero)])
    return torch.cat(pieces, dim=-1)


def _bytes(tensor: Tensor) -> Tensor:
    return tensor.contiguous().view(torch.uint8)


def _typed(records: Tensor, dtype: torch.dtype) -> Tensor:
    return records.contiguous().view(dtype)


def _byte_view(pool_tensor: Tensor) -> Tensor:
    """A pool tensor ``[blocks, size, hk, head_dim]`` as bytes ``[blocks, size, hk, head_dim * element]``."""
    return pool_tensor.view(torch.uint8)


def _locate(valid: Tensor, tables: list[list[int]], per_block: int) -> Tensor:
    """The record of each valid slot in the pool's record rows (block id x ``per_block`` + record within it), in
    (row, head, slot) order, on ``valid``'s device.

    A row's valid slots form one stream, head by head, ``per_block`` records to a block. Computed once when the
    slots are written; the reads of the next step reuse it.
    """
    longest = max(len(table) for table in tables)
    padded = torch.tensor([table + [0] * (longest - len(table)) for table in tables], dtype=torch.long)
    flat = valid.reshape(valid.shape[0], -1)
    order = flat.cumsum(dim=1) - 1  # each valid slot's place in its row's stream
    rows = torch.arange(flat.shape[0], device=valid.device)[:, None].expand_as(flat)
    place, row = order[flat], rows[flat]
    return padded.to(valid.device)[row, place // per_block] * per_block + place % per_block


def _words(records: Tensor, width: int) -> tuple[Tensor, int]:
    """Byte records ``[..., row_bytes]`` viewed in the widest integer unit that divides both the row and a slot's
    ``width`` bytes, with that unit's size: a gather or scatter of records then moves 8 (or 4, 2) bytes per element,
    not one (the copies of a pooled layer's step, several times faster)."""
    unit = next(u for u in (8, 4, 2, 1) if records.shape[-1] % u == 0 and width % u == 0)
    return records.view(_UNITS[unit]), unit


def _as_words(records: Tensor, unit: int) -> Tensor:
    """Byte records ``[..., width]`` in the integer unit of `_words` (a copy when they are not contiguous)."""
    return records.contiguous().view(_UNITS[unit])


_UNITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _record_view(pool_tensor: Tensor, per_block: int) -> Tensor:
    """A pool tensor ``[blocks, size, hk, head_dim]`` as byte records ``[blocks, size * hk, head_dim * element]``."""
    records = _byte_view(pool_tensor)
    return records.view(records.shape[0], per_block, records.shape[-1])
