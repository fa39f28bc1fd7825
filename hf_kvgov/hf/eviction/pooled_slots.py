"""Kept slots in pool blocks: eviction caches that draw from one shared, capped `BlockPool`.

Layout. An eviction pool (`eviction_pool`) has one layer group per layer, so a block id is one layer's
block, and a block holds ``block_size`` slot rows of that layer::

    block b of layer l     [block_size, kv_heads, record]      (the pool's usual [tokens, heads, head_dim])
    slot row r of a row    block tables[row][r // block_size], offset r % block_size
    (row r, KV head h)     head h's r-th kept token: heads keep different tokens, the same number of them

Why slot rows, not per-head blocks: every policy here keeps the same number of slots in each KV head of a
layer (the budget is per layer), so a slot row fills every head and nothing is padded; the block keeps the
pool's layout, allocator, cap and `PoolExhausted`; and since a block id is one layer, a layer with a
smaller budget (``layer_budgets``, a sliding window) holds fewer blocks: layer-variable budgets free real
memory. What differs per head (which token a slot is) lives in the layer's per-slot positions. A policy
giving heads different budgets (head-adaptive allocation) would pad each layer to its largest head here.

A slot's record is its K or V as the slot format stores it, as bytes: the model's dtype for dense slots,
codes then scales (then zero points) for a codec, so one pool serves dense and quantized eviction caches of
one model and codec. The pool's ``head_dim`` is the record in elements of the model's dtype (records are
copied as bytes, never computed on); a layer kept in full precision beside quantized ones pads to the
widest record.

Between steps a layer's slots live only in its blocks; a step reads them into the working store (dense or
codes) it attends and evicts from, and the commit writes the kept slots back, allocating or freeing blocks
so a row holds ceil(slots / block_size) of them. The blocks are allocated before anything is written, so
`PoolExhausted` changes nothing in the pool. Writes hold the pool's lock (another request's allocation may
grow the pool's tensors); every block is owned by one row of one cache, so reads need no lock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from hf_kvgov.hf.eviction.coded_slots import CodedSlots
from hf_kvgov.hf.eviction.slot_store import DenseSlots, QuantizedFormat, QuantizedSlots, SlotFormat, SlotStore
from hf_kvgov.storage.layer_groups import LayerGroup
from hf_kvgov.storage.pool import DEFAULT_BLOCK_SIZE, BlockPool, KVGeometry


def per_layer_groups(windows: Sequence[int | None]) -> tuple[LayerGroup, ...]:
    """One group per layer: a block id is one layer's block (see the module docstring)."""
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


def eviction_pool(
    model: Any,
    codec: Any = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    max_tokens: int | None = None,
    max_bytes: int | None = None,
    preallocate: bool = False,
) -> BlockPool:
    """A pool laid out for the eviction caches of ``model`` whose slots ``codec`` stores (None: dense).

    Pass it as ``pool=`` to as many `HeavyHitterCache` / `PolicyCache` instances as share the memory;
    ``max_tokens`` counts slot rows (one kept token of every KV head of one layer), ``max_bytes`` bytes.
    """
    from hf_kvgov.hf.compat import decoder_config, kv_heads_and_head_dim
    from hf_kvgov.hf.eviction.model_inputs import layer_windows
    from hf_kvgov.hf.eviction.slot_codecs import slot_formats

    config = decoder_config(model)
    heads, head_dim = kv_heads_and_head_dim(config)
    windows = layer_windows(config)
    dtype = _model_dtype(model)
    formats, _ = slot_formats(codec, len(windows), heads, head_dim, "eviction_pool")
    element = torch.empty((), dtype=dtype).element_size()
    width = max(SlotRecords(fmt, head_dim, dtype).width for fmt in formats)
    devices = _layer_devices(model, len(windows))
    geometry = KVGeometry(len(windows), heads, math.ceil(width / element), dtype, devices[0], devices)
    return BlockPool(
        geometry, block_size, max_tokens=max_tokens, max_bytes=max_bytes, preallocate=preallocate,
        groups=per_layer_groups(windows),
    )  # fmt: skip


class PooledSlotHome:
    """Where one eviction layer's slots live between steps: block tables over a pool, one per batch row."""

    def __init__(self, pool: BlockPool, layer: int, records: SlotRecords) -> None:
        self.pool = pool
        self.layer = layer
        self.records = records
        self.tables: list[list[int]] = []
        self.count = 0  # slots per (row, KV head)
        self._cached: SlotStore | None = None  # the store read this step, until the commit writes the next

    @property
    def batch(self) -> int:
        return len(self.tables)

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

    def put(self, store: SlotStore | None) -> None:
        """Keep ``store``'s slots in this layer's blocks (None: free them all). Raises `PoolExhausted` and
        changes nothing when the pool cannot hand out the blocks."""
        if store is None:
            self.release()
            return
        size = self.pool.block_size
        rows, count = store.batch, store.count
        need = -(-count // size)
        old = self.tables + [[] for _ in range(rows - len(self.tables))]
        missing = sum(max(0, need - len(table)) for table in old[:rows])
        fresh = iter(self.pool.allocate(missing))  # raises before anything is written
        tables = [table[:need] + [next(fresh) for _ in range(need - len(table[:need]))] for table in old[:rows]]
        spare = [block for table in old[:rows] for block in table[need:]] + [b for t in old[rows:] for b in t]
        self._write(store, tables, count)
        self.tables, self.count, self._cached = tables, count, None
        if spare:
            self.pool.decref(spare)

    def release(self) -> None:
        """Give every block back to the pool."""
        held = [block for table in self.tables for block in table]
        self.tables, self.count, self._cached = [], 0, None
        if held:
            self.pool.decref(held)

    def _write(self, store: SlotStore, tables: list[list[int]], count: int) -> None:
        keys, values = self.records.to_records(store)  # [b, hk, s, width]
        if not count:
            return
        size, width = self.pool.block_size, self.records.width
        need = len(tables[0])
        ids = torch.tensor(tables, dtype=torch.long, device=keys.device).reshape(-1)
        with self.pool.lock:  # another request may grow the pool's tensors meanwhile
            for records, target in ((keys, self.pool.keys[self.layer]), (values, self.pool.values[self.layer])):
                rows = _to_blocks(records, need * size, size).to(target.device)  # [b * need, size, hk, width]
                _byte_view(target)[ids.to(target.device), :, :, :width] = rows

    def _read(self) -> SlotStore:
        size = self.pool.block_size
        ids = torch.tensor(self.tables, dtype=torch.long)
        parts = []
        for source in (self.pool.keys[self.layer], self.pool.values[self.layer]):
            blocks = _byte_view(source)[ids.reshape(-1).to(source.device)]  # [b * need, size, hk, row]
            batch, need = ids.shape
            rows = blocks.reshape(batch, need * size, *blocks.shape[2:])[:, : self.count]
            parts.append(rows.permute(0, 2, 1, 3))  # [b, hk, slots, row]
        return self.records.from_records(parts[0], parts[1])


def pooled_homes(
    pool: BlockPool,
    model: Any,
    windows: Sequence[int | None],
    formats: Sequence[SlotFormat],
    heads: int,
    head_dim: int,
    owner: str,
) -> list[PooledSlotHome]:
    """One home per layer in ``pool``, after checking the pool is laid out for these slots."""
    if not isinstance(pool, BlockPool):
        raise TypeError(f"{owner}: pool must be a BlockPool from hf_kvgov.eviction_pool(model); got {pool!r}.")
    dtype = getattr(model, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{owner}: a pool needs the model itself (its dtype sizes the slots), not its config.")
    records = [SlotRecords(fmt, head_dim, dtype) for fmt in formats]
    check_eviction_pool(pool, windows, heads, [r.width for r in records], dtype, owner)
    return [PooledSlotHome(pool, layer, layer_records) for layer, layer_records in enumerate(records)]


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


def _to_blocks(records: Tensor, rows: int, size: int) -> Tensor:
    """``[b, hk, s, width]`` records zero-padded to ``rows`` slots, as ``[b * rows / size, size, hk, width]`` blocks."""
    batch, heads, count, width = records.shape
    if count < rows:
        records = torch.cat((records, records.new_zeros(batch, heads, rows - count, width)), dim=2)
    return records.permute(0, 2, 1, 3).reshape(batch * rows // size, size, heads, width)


def _model_dtype(model: Any) -> torch.dtype:
    dtype = getattr(model, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError("eviction_pool needs the model itself (its dtype and devices place the pool), not a config.")
    return dtype


def _layer_devices(model: Any, layers: int) -> tuple[torch.device, ...]:
    device = next(model.parameters()).device
    return (device,) * layers
