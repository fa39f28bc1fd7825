"""Between the pool's K/V tensors and the tier's bytes: the raw segment format and the tiered gather.

Raw segment of (block b, layer l): two parts, in the pool's dtype and the machine's byte order::

    part 0 = keys[l][b]   : block_size x kv_heads x head_dim
    part 1 = values[l][b] : the same

A batch's block table holds pool ids (>= 0) and spilled blocks as ``-1 - handle``. For one layer,
`gather_tiered` copies the resident blocks from the pool into the output and has the spilled ones read
into it: straight into the output when they fill one run of it in handle order (one sequence, the usual
case), else into a stack that is then scattered (batches, beams sharing blocks).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hf_kvgov.storage.geometry import index_per_layer
from hf_kvgov.storage.pool import BlockPool, KVGeometry
from hf_kvgov.tiers.disk_tier import SegmentSource


def spilled_id(handle: int) -> int:
    """The block-table entry of a spilled block (negative, so it can never be taken for a pool id)."""
    return -1 - handle


def handle_of(block_id: int) -> int:
    return -1 - block_id


@dataclass(frozen=True)
class SpilledIds:
    """How block-table entries name spilled blocks: handle h is entry `base - h`, every entry <= `base`.

    Raw pools use every negative entry (`RAW_SPILLED_IDS`, base -1). A quantized pool already names its
    sealed blocks by negative entries (-1 - sealed id), so its spilled blocks live far below them
    (`SEALED_SPILLED_IDS`): no store reaches 2**62 sealed ids, so the two ranges never meet.
    """

    base: int

    def entry(self, handle: int) -> int:
        return self.base - handle

    def handle(self, entry: int) -> int:
        return self.base - entry

    def is_spilled(self, entry: int) -> bool:
        return entry <= self.base


RAW_SPILLED_IDS = SpilledIds(-1)
SEALED_SPILLED_IDS = SpilledIds(-(1 << 62))


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A byte view of a contiguous CPU tensor's own memory (no copy; writable)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("byte_view needs a contiguous CPU tensor; copy it to the host first.")
    return tensor.reshape(-1).view(torch.uint8).numpy().data


def raw_part_bytes(geometry: KVGeometry, block_size: int) -> tuple[int, int]:
    """Bytes of the two parts of a raw segment: K, then V, of one layer of one block."""
    element = torch.empty((), dtype=geometry.dtype).element_size()
    size = block_size * geometry.num_kv_heads * geometry.head_dim * element
    return size, size


def pool_segments(pool: BlockPool, block_ids: Sequence[int]) -> SegmentSource:
    """The raw segments of pool blocks, one position of a block at a time (views of the pool on CPU, one copy on
    GPU). Position j is layer j without layer groups; with them, the j-th layer of the block's group."""
    index = index_per_layer(block_ids, pool.geometry)  # each layer's blocks sit on that layer's device

    def segments(position: int) -> list[list[memoryview]]:
        layer = pool.layout.heads[position]
        keys, values = pool.keys[layer], pool.values[layer]
        if keys.device.type == "cpu":
            return [[byte_view(keys[b]), byte_view(values[b])] for b in block_ids]
        host_k, host_v = keys[index[layer]].cpu(), values[index[layer]].cpu()
        return [[byte_view(host_k[i]), byte_view(host_v[i])] for i in range(len(block_ids))]

    return segments


# Fills, for each tensor in the list, row i with its part of the segment of handles[i] (see LayerPrefetcher.take).
SegmentReader = Callable[[list[torch.Tensor]], None]


@dataclass(frozen=True)
class SpilledLayout:
    """Where each entry of a batch's block table lives, as flat (row-major) positions of the table."""

    block_table: torch.Tensor  # long [batch, blocks]; spilled entries <= the SpilledIds base
    handles: list[int]  # distinct spilled handles, ascending: row r of a spilled stack holds handles[r]
    resident_positions: torch.Tensor  # long: positions of pool entries
    resident_ids: torch.Tensor  # long: their entries (pool ids; sealed entries too in a quantized pool)
    spilled_positions: torch.Tensor  # long: positions of spilled entries
    spilled_rows: torch.Tensor  # long: the stack row each of them reads
    direct: slice | None  # when the spilled entries are positions [a, b) holding handles[0], handles[1], ...

    @classmethod
    def of(cls, block_table: torch.Tensor, ids: SpilledIds = RAW_SPILLED_IDS) -> SpilledLayout:
        flat = block_table.reshape(-1)
        is_spilled = flat <= ids.base
        resident = (~is_spilled).nonzero().squeeze(1)
        spilled = is_spilled.nonzero().squeeze(1)
        distinct, rows = torch.unique(ids.base - flat[spilled], sorted=True, return_inverse=True)
        n = spilled.numel()
        in_order = n > 0 and bool((rows == torch.arange(n, device=rows.device)).all())
        contiguous = in_order and int(spilled[-1]) - int(spilled[0]) == n - 1
        direct = slice(int(spilled[0]), int(spilled[0]) + n) if contiguous else None
        return cls(block_table, distinct.tolist(), resident, flat[resident], spilled, rows, direct)

    def paged_table(self, pool_capacity: int) -> torch.Tensor:
        """The block table for a key cache made of the pool's blocks followed by the spilled stack."""
        table = self.block_table.clone().reshape(-1)
        table[self.spilled_positions] = pool_capacity + self.spilled_rows
        return table.view_as(self.block_table)


def gather_tiered(
    pool_keys: torch.Tensor, pool_values: torch.Tensor, layout: SpilledLayout, length: int, read: SegmentReader
) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous K and V of the first `length` tokens of every row, from the pool and the spilled blocks.

    Args:
        pool_keys, pool_values: one layer of the pool, `[capacity, block_size, kv_heads, head_dim]`.
        read: fills `[keys, values]` stacks (`[n, block_size, kv_heads, head_dim]`, n = len(layout.handles))
            with the spilled blocks; given slices of the output itself when `layout.direct` allows.
    Returns:
        keys, values `[batch, kv_heads, length, head_dim]`, the layout `BlockPool.gather` returns.
    """
    batch, blocks = layout.block_table.shape
    block_size, heads, head_dim = pool_keys.shape[1:]
    out = [pool.new_empty((batch * blocks, block_size, heads, head_dim)) for pool in (pool_keys, pool_values)]
    for dest, pool in zip(out, (pool_keys, pool_values), strict=True):
        dest.index_copy_(0, layout.resident_positions, pool.index_select(0, layout.resident_ids))
    if layout.direct is not None:  # read straight into the output: no staging copy
        read([dest[layout.direct] for dest in out])
    else:
        stacks = [dest.new_empty((len(layout.handles), *dest.shape[1:])) for dest in out]
        read(stacks)
        for dest, stack in zip(out, stacks, strict=True):
            dest.index_copy_(0, layout.spilled_positions, stack.index_select(0, layout.spilled_rows))
    shape = (batch, blocks * block_size, heads, head_dim)
    keys, values = (dest.view(shape)[:, :length].transpose(1, 2) for dest in out)
    return keys, values
