"""Prefix reuse for a `PagedCache` whose pool has layer groups (hybrid sliding-window models).

The tree caches one entry per block position, one block per group (`hf_kvgov.prefix.grouped_blocks`). A hit is
exact when every group can serve it: full-attention groups get every block of the prefix, sliding groups the blocks
of the last window before the hit point. A sliding group's table starts at the block holding the first token the
next query sees; what is before it is freed, as if the request had computed it and moved on. Because a sliding
group frees blocks as they leave its window, long before `publish` runs after generate, the cache publishes the
prompt's sliding blocks as they are computed (at each step's start); full-attention blocks wait for `publish` and
are the request's own until then (a disk cache may spill them). The tree thus keeps the sliding blocks of the whole
document, evictable (sliding blocks no sequence uses go first, then whole entries), and a later request hits
wherever it diverges. A quantized cache offers its blocks past the sink as sealed copies in every group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hf_kvgov.engine.prefix_layout import RowLayout
from hf_kvgov.errors import PoolExhausted
from hf_kvgov.prefix.grouped_blocks import Blocks
from hf_kvgov.storage.block_table import BlockTable, BlockTables

if TYPE_CHECKING:
    from hf_kvgov.engine.block_store import BlockStore

Hit = tuple[list[int], list[Blocks]]  # (entries to unlock, per group the hit's pool blocks)


def match_rows(cache: BlockStore, rows: list[list[int]], namespace: str) -> list[Hit]:
    """Each row's longest prefix every group can serve; the entries are locked for this cache."""
    assert cache.prefix is not None
    hits = [cache.prefix.match_groups(tokens, namespace, max_tokens=len(tokens) - 1) for tokens in rows]
    cache.prefix_locks.extend(entry for entries, _ in hits for entry in entries)
    return hits


def fill_from_hits(cache: BlockStore, hits: list[Hit], plan: list[RowLayout]) -> None:
    """Every group's tables from the rows' hits, rows shorter than the longest padded after their hit.

    A sliding group keeps the blocks from the one holding the first token a query at the longest hit sees; a
    row's hit blocks before it go back (the row's own hit needed them, the batch does not).
    """
    pool = cache.pool
    assert pool is not None and cache.tables is not None
    bs, longest = pool.block_size, max(row.cached for row in plan)
    firsts = [group.first_kept(longest, bs) // bs for group in cache.groups]
    pads = [[max(first, len(hit[1][g])) for hit in hits] for g, first in enumerate(firsts)]  # where pads start
    count = sum(longest // bs - start for starts in pads for start in starts)
    held = [block for _, tables in hits for table in tables for block in table if block is not None]
    try:
        fresh = iter(pool.allocate(count))  # all-or-nothing, like every allocation
    except PoolExhausted:
        pool.decref(held)  # no table holds them yet
        raise
    for g, tables in enumerate(cache.all_tables):
        first = firsts[g]
        tables.rows = []
        for (_, groups), start in zip(hits, pads[g], strict=True):
            hit = groups[g]
            pool.decref([block for block in hit[:first] if block is not None])
            pad_blocks = [next(fresh) for _ in range(longest // bs - start)]
            pool.zero_blocks(pad_blocks)  # masked, but must never hold stale non-finite values
            kept = [block for block in hit[first:] if block is not None]
            assert len(kept) == len(hit[first:]), "a hit serves every block from its window's first on"
            row = BlockTable(pool, [0] * first + kept + pad_blocks)
            row.freed = first  # the leading entries are freed: stale ids, never read
            tables.rows.append(row)
        tables.first_block, tables.num_tokens = first, longest
        tables.invalidate_views()


def publish_rows(cache: BlockStore, rows: list[list[int]], namespace: str, offered_tables: list[BlockTables]) -> int:
    """Offer row r's full blocks of `rows[r]` (its publishable tokens) to the tree, those of the groups whose
    tables are `offered_tables` (the others' as absent); returns the blocks offered."""
    assert cache.prefix is not None
    offered = 0
    for r, tokens in enumerate(rows):
        full = len(tokens) // cache.prefix.block_size
        if not full:
            continue
        tables: list[Blocks] = []
        for group_tables in cache.all_tables:
            row = group_tables.rows[r]
            offer = any(group_tables is t for t in offered_tables)
            tables.append([None if i < row.freed or not offer else row.block_ids[i] for i in range(full)])
        swapped, locked = cache.prefix.publish_groups(tokens, tables, namespace)
        for group_tables, blocks in zip(cache.all_tables, swapped, strict=True):
            row = group_tables.rows[r]
            for i, block in enumerate(blocks):
                if block is not None:
                    row.block_ids[i] = block
        cache.prefix_locks.extend(locked)
        offered += len(locked)
    for group_tables in cache.all_tables:
        group_tables.invalidate_views()
    return offered


def publish_computed(cache: BlockStore) -> None:
    """At the start of a step: publish the prompt blocks computed since the last call (see the module docstring).

    Only rows `match` laid out, up to their first padded slot (after it, a slot is not its token's position).
    """
    layouts, tables = cache.row_layouts, cache.tables
    if cache.prefix is None or cache.prefix.grouped is None or layouts is None or tables is None:
        return
    if len(layouts) != tables.batch_size:
        return
    stored, bs = cache.stored_tokens(), cache.prefix.block_size
    rows = [row.tokens[: min(stored, len(row.tokens) if row.first_pad is None else row.first_pad)] for row in layouts]
    ready = max(len(tokens) // bs for tokens in rows)
    if ready > cache.published_blocks:
        cache.publish_tokens(rows, sliding_only=True)
        cache.published_blocks = ready
