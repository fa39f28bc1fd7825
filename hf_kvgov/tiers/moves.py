"""Moving blocks between the pool and the disk tier, with every reference count kept right.

Both moves work on all rows of a batch at once: a block held by several rows (beams forked from one
sequence) moves once, and its new home takes all their references. The cache decides which blocks move
(the tier never decides what is cold); these functions only move them.
"""

from __future__ import annotations

import torch

from hf_kvgov.storage.geometry import index_per_layer
from hf_kvgov.storage.pool import BlockPool
from hf_kvgov.tiers.block_table import TieredBlockTables
from hf_kvgov.tiers.disk_tier import DiskTier
from hf_kvgov.tiers.kv_segments import byte_view, handle_of, pool_segments, spilled_id


def spill(
    pool: BlockPool, tables: TieredBlockTables, tier: DiskTier, first: int, stop: int, within_budget: bool = False
) -> tuple[int, int]:
    """Write the pool blocks at block indices [first, stop) of every row to `tier` and free them.

    With `within_budget`, only as many as the tier's write budget allows move, oldest first. Returns
    (blocks moved, blocks that were to move). If the tier refuses the write (`SpillSpaceExhausted`,
    `SpillFileLost`) nothing has changed: the blocks are still in the pool.
    """
    refs = tables.references(first, stop, spilled=False)  # pool id -> rows holding it, oldest first
    ids = list(refs)
    if within_budget:
        ids = ids[: tier.blocks_within_budget(len(ids))]
    handles = tier.put(len(ids), [refs[b] for b in ids], pool_segments(pool, ids))
    tables.replace({b: spilled_id(h) for b, h in zip(ids, handles, strict=True)})
    pool.decref([b for b in ids for _ in range(refs[b])])
    return len(ids), len(refs)


def bring_back(pool: BlockPool, tables: TieredBlockTables, tier: DiskTier, index: int) -> int:
    """Read the spilled blocks at block index `index` of every row into fresh pool blocks; returns how many.

    Raises `PoolExhausted` (nothing changed) when the pool has no room, `SpillCorrupted` on damage.
    """
    refs = tables.references(index, index + 1, spilled=True)  # spilled entry -> rows holding it
    if not refs:
        return 0
    entries = list(refs)
    handles = [handle_of(b) for b in entries]
    g, bs = pool.geometry, pool.block_size
    keys, values = (torch.empty((len(entries), bs, g.num_kv_heads, g.head_dim), dtype=g.dtype) for _ in "kv")
    fresh = pool.allocate(len(entries))
    try:
        target = index_per_layer(fresh, g)
        for layer in range(g.num_layers):
            tier.read(layer, handles, [byte_view(keys), byte_view(values)])
            device = g.layer_device(layer)  # the host staging copy goes to the layer's own device
            pool.keys[layer][target[layer]] = keys.to(device)
            pool.values[layer][target[layer]] = values.to(device)
    except BaseException:
        pool.decref(fresh)
        raise
    pool.incref([f for b, f in zip(entries, fresh, strict=True) for _ in range(refs[b] - 1)])
    tables.replace(dict(zip(entries, fresh, strict=True)))
    tier.decref([h for b, h in zip(entries, handles, strict=True) for _ in range(refs[b])])
    return len(entries)
