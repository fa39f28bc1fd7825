"""What a cache with a codec holds: `QuantizedCacheStats`, the real bytes of codes, scales and full-precision
blocks."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from hf_kvgov.engine.paged_stats import CacheStats, live_entries
from hf_kvgov.stats_repr import rounded_repr
from hf_kvgov.storage.quantized_pool import QuantizedBlockPool, is_sealed

if TYPE_CHECKING:
    from hf_kvgov.engine.block_store import BlockStore


@dataclass(frozen=True)
class QuantizedCacheStats(CacheStats):
    """`CacheStats` whose bytes are the real bytes held: codes + scales + full-precision blocks."""

    __repr__ = rounded_repr

    codec: str
    full_precision_blocks: int
    sealed_blocks: int
    full_precision_bytes: int
    sealed_bytes: int
    unquantized_bytes: int  # what a PagedCache would hold for the same blocks
    compression: float  # unquantized_bytes / bytes_used
    overflow_blocks: int  # blocks the pool kept in full precision: their statistics did not fit the format


def quantized_cache_stats(cache: BlockStore, base: CacheStats, codec: str) -> QuantizedCacheStats:
    """`base` (the paged accounting of `cache`) with bytes counted as stored; distinct blocks count once."""
    pool = cache.pool if isinstance(cache.pool, QuantizedBlockPool) else None
    distinct = live_entries(cache)
    sealed = sum(1 for block in distinct if is_sealed(block))
    full_bytes = (len(distinct) - sealed) * (pool.bytes_per_block if pool else 0)
    sealed_bytes = sealed * (pool.sealed.bytes_per_block if pool else 0)
    used = full_bytes + sealed_bytes
    store = pool.sealed_stats() if pool else None
    fields = asdict(base)
    fields.update(
        bytes_used=used,
        bytes_per_token=used / base.tokens if base.tokens else 0.0,
        pool_blocks_reserved=base.pool_blocks_reserved + (store.capacity_blocks if store else 0),
        pool_bytes_reserved=base.pool_bytes_reserved + (store.bytes_reserved if store else 0),
    )
    return QuantizedCacheStats(
        **fields,
        codec=codec,
        full_precision_blocks=len(distinct) - sealed,
        sealed_blocks=sealed,
        full_precision_bytes=full_bytes,
        sealed_bytes=sealed_bytes,
        unquantized_bytes=base.bytes_used,
        compression=base.bytes_used / used if used else 1.0,
        overflow_blocks=pool.overflow_blocks if pool else 0,
    )
