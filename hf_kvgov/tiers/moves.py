"""Moving blocks between the pool and the disk tier, with every reference count kept right.

Both moves work on all rows of a batch at once: a block held by several rows (beams forked from one
sequence) moves once, and its new home takes all their references. The cache decides which blocks move
(the tier never decides what is cold); these functions only move them.

What a block is made of differs by pool: a raw pool block is its K/V (`raw_blocks`), a sealed block of a
quantized pool is its codes and scales (`hf_kvgov.tiers.sealed_segments.sealed_blocks`). A `TierBlocks`
says which resident entries can move, how to write them and how to restore them; the moves are the same.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hf_kvgov.storage.geometry import index_per_layer
from hf_kvgov.storage.pool import BlockPool
from hf_kvgov.tiers.disk_tier import DiskTier, SegmentSource
from hf_kvgov.tiers.kv_segments import byte_view, pool_segments
from hf_kvgov.tiers.tiered_tables import TieredBlockTables


@dataclass(frozen=True)
class TierBlocks:
    """One kind of resident block, as the moves see it.

    movable(entry): whether a resident table entry of this kind may spill.
    segments(entries): their segments, layer by layer, for `DiskTier.put`.
    restore(tier, handles): new resident entries (one reference each) holding the spilled blocks `handles`,
        verified; raises (nothing allocated) when the pool has no room or a block is damaged.
    """

    movable: Callable[[int], bool]
    segments: Callable[[Sequence[int]], SegmentSource]
    restore: Callable[[DiskTier, list[int]], list[int]]


def raw_blocks(pool: BlockPool) -> TierBlocks:
    """Pool blocks written as their raw K/V (`kv_segments`): every resident entry of a raw pool."""
    return TierBlocks(lambda entry: True, lambda ids: pool_segments(pool, ids), lambda t, h: _restore_raw(pool, t, h))


def spill(
    pool: BlockPool,
    tables: TieredBlockTables,
    tier: DiskTier,
    first: int,
    stop: int,
    within_budget: bool = False,
    blocks: TierBlocks | None = None,
) -> tuple[int, int]:
    """Write the resident blocks at block indices [first, stop) of every row to `tier` and free them.

    `blocks` (default: raw pool blocks) says which of them can move and how. With `within_budget`, only as
    many as the tier's write budget allows move, oldest first. Returns (blocks moved, blocks that were to
    move). If the tier refuses the write (`SpillSpaceExhausted`, `SpillFileLost`) nothing has changed: the
    blocks are still in the pool.
    """
    kind = blocks if blocks is not None else raw_blocks(pool)
    found = tables.references(first, stop, spilled=False)  # resident entry -> rows holding it, oldest first
    refs = {entry: count for entry, count in found.items() if kind.movable(entry)}
    ids = list(refs)
    if within_budget:
        ids = ids[: tier.blocks_within_budget(len(ids))]
    handles = tier.put(len(ids), [refs[b] for b in ids], kind.segments(ids))
    tables.replace({b: tables.ids.entry(h) for b, h in zip(ids, handles, strict=True)})
    pool.decref([b for b in ids for _ in range(refs[b])])
    return len(ids), len(refs)


def bring_back(
    pool: BlockPool,
    tables: TieredBlockTables,
    tier: DiskTier,
    index: int,
    blocks: TierBlocks | None = None,
    stop: int | None = None,
) -> int:
    """Read the spilled blocks at block index `index` of every row back into the pool; returns how many.

    With `stop`, those at block indices [index, stop), restored together. Raises `PoolExhausted` (nothing
    changed) when the pool has no room, `SpillCorrupted` on damage.
    """
    kind = blocks if blocks is not None else raw_blocks(pool)
    refs = tables.references(index, index + 1 if stop is None else stop, spilled=True)  # entry -> rows holding it
    if not refs:
        return 0
    entries = list(refs)
    handles = [tables.ids.handle(b) for b in entries]
    fresh = kind.restore(tier, handles)
    pool.incref([f for b, f in zip(entries, fresh, strict=True) for _ in range(refs[b] - 1)])
    tables.replace(dict(zip(entries, fresh, strict=True)))
    tier.decref([h for b, h in zip(entries, handles, strict=True) for _ in range(refs[b])])
    return len(entries)


def _restore_raw(pool: BlockPool, tier: DiskTier, handles: list[int]) -> list[int]:
    g, bs = pool.geometry, pool.block_size
    keys, values = (torch.empty((len(handles), bs, g.num_kv_heads, g.head_dim), dtype=g.dtype) for _ in "kv")
    fresh = pool.allocate(len(handles))
    try:
        target = index_per_layer(fresh, g)
        for position, layer in enumerate(pool.layout.heads):  # a block holds one layer per position
            tier.read(position, handles, [byte_view(keys), byte_view(values)])
            pool.write_blocks(layer, target[layer], keys, values)  # the host staging copy to the layer's device
    except BaseException:
        pool.decref(fresh)
        raise
    return fresh
