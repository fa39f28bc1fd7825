"""`PagedCache.stats()`: what a paged cache holds, counted from its block tables (every layer group's)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hf_kvgov.stats_repr import rounded_repr

if TYPE_CHECKING:
    from hf_kvgov.engine.block_store import BlockStore


@dataclass(frozen=True)
class CacheStats:
    """What a paged cache holds. Shared blocks (beams, prefixes) count once in the physical figures."""

    __repr__ = rounded_repr

    sequences: int
    tokens: int  # logical tokens: sequences x tokens per sequence
    blocks_in_use: int
    slots_allocated: int
    slots_filled: int
    utilization: float  # slots_filled / slots_allocated
    bytes_used: int
    bytes_per_token: float
    pool_blocks_reserved: int
    pool_bytes_reserved: int
    block_size: int
    attention: str


def live_entries(cache: BlockStore) -> set[int]:
    """The distinct table entries (pool ids, sealed or spilled ones) every group's rows still hold."""
    return {block for tables in cache.all_tables for row in tables.rows for block in row.live_ids}


def paged_cache_stats(cache: BlockStore) -> CacheStats:
    """Blocks in use are the distinct live blocks of every group's rows (shared blocks count once)."""
    pool, tables = cache.pool, cache.tables
    length = cache.stored_tokens()
    if pool is None or tables is None:
        return CacheStats(0, 0, 0, 0, 0, 0.0, 0, 0.0, 0, 0, cache.pool_args["block_size"] or 0, cache.attention)
    bs = pool.block_size
    filled: dict[int, int] = {}
    for group_tables in cache.all_tables:
        for row in group_tables.rows:
            for i, block in enumerate(row.block_ids[row.freed :], start=row.freed):
                filled[block] = max(filled.get(block, 0), min(bs, length - i * bs))
    blocks = len(filled)
    tokens = tables.batch_size * length
    used = blocks * pool.bytes_per_block
    return CacheStats(
        sequences=tables.batch_size,
        tokens=tokens,
        blocks_in_use=blocks,
        slots_allocated=blocks * bs,
        slots_filled=sum(filled.values()),
        utilization=sum(filled.values()) / (blocks * bs) if blocks else 0.0,
        bytes_used=used,
        bytes_per_token=used / tokens if tokens else 0.0,
        pool_blocks_reserved=pool.capacity,
        pool_bytes_reserved=pool.capacity * pool.bytes_per_block,
        block_size=bs,
        attention=cache.attention,
    )
