"""What a block cache holds (`BlockStore.stats()`), counted once from its block tables (every layer group's).

`CacheStats` is what every block cache reports. A codec link adds the codec's figures (`QuantizedCacheStats`), a
disk link the tier's (`DiskCacheStats`), and a store with both links reports both (`QuantizedDiskCacheStats`, a
subclass of the two): each section is computed by one function, whatever the other link. Shared blocks (beams,
prefixes) count once; with a disk link `bytes_used` counts memory only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from hf_kvgov.engine.disk_prefix import tree_held
from hf_kvgov.engine.kv_stats import KVStats
from hf_kvgov.stats_repr import rounded_repr
from hf_kvgov.storage.quantized_pool import QuantizedBlockPool, is_sealed
from hf_kvgov.tiers.kv_segments import SEALED_SPILLED_IDS

if TYPE_CHECKING:
    from hf_kvgov.engine.block_store import BlockStore


@dataclass(frozen=True, kw_only=True)
class CacheStats(KVStats):
    """What a paged cache holds (`KVStats`, then its blocks). Shared blocks (beams, prefixes) count once in the
    physical figures."""

    __repr__ = rounded_repr

    blocks_in_use: int
    slots_allocated: int
    slots_filled: int
    utilization: float  # slots_filled / slots_allocated
    pool_blocks_reserved: int
    pool_bytes_reserved: int
    block_size: int
    attention: str


@dataclass(frozen=True, kw_only=True)
class QuantizedCacheStats(CacheStats):
    """`CacheStats` whose bytes are the real bytes held: codes + scales + full-precision blocks."""

    __repr__ = rounded_repr

    codec: str
    full_precision_blocks: int
    sealed_blocks: int  # in memory, in the sealed store (with a disk link: the hot window's)
    full_precision_bytes: int
    sealed_bytes: int
    unquantized_bytes: int  # what a PagedCache would hold for the same blocks in memory
    compression: float  # unquantized_bytes / (full_precision_bytes + sealed_bytes)
    overflow_blocks: int  # blocks the pool kept in full precision: their statistics did not fit the format


@dataclass(frozen=True, kw_only=True)
class DiskCacheStats(CacheStats):
    """`CacheStats` plus the disk tier's accounting.

    Here `bytes_used` (and `bytes_per_token`) count memory only: `resident_bytes`, the blocks this cache holds in
    memory (as stored: codes with a codec) plus the read-ahead rows allocated (`read_buffer_bytes`: one layer of the
    spilled blocks, up to the configured cap; 0 before anything spills). A fetch reads one layer of a run of
    adjacent blocks; write amplification is bytes written / KV bytes spilled (1.0 unless a write failed halfway).
    With prefix sharing, blocks the tree holds that this cache uses (`prefix_blocks`) count in full in
    `resident_blocks` / `resident_bytes`, as this cache needs them in memory; caches sharing a prefix thus each
    count it, and the pool's own `stats()` gives the figure with each block counted once.
    """

    __repr__ = rounded_repr

    resident_blocks: int
    spilled_blocks: int
    resident_bytes: int
    read_buffer_bytes: int
    disk_bytes: int  # live slots x slot size
    disk_file_bytes: int  # reserved on disk
    spills: int  # blocks written
    bytes_written: int
    kv_bytes_spilled: int  # the blocks spilled, as stored (codes and scales with a codec)
    write_amplification: float
    fetches: int
    blocks_fetched: int  # (block, layer) segments read back
    bytes_read: int
    prefetched: int  # segments served by the read-ahead
    fetched_on_demand: int  # segments read when their layer asked
    fetch_latency_mean_s: float
    fetch_latency_p99_s: float
    fetch_wait_s: float  # time layers waited for spilled blocks (I/O the read-ahead did not hide)
    spilling: bool
    stop_reason: str | None
    spill_path: str | None
    prefix_blocks: int = 0  # resident blocks this cache uses that the prefix tree holds (never spilled)


@dataclass(frozen=True, kw_only=True)
class QuantizedDiskCacheStats(DiskCacheStats, QuantizedCacheStats):
    """Both sections: memory only (`bytes_used` = `resident_bytes`), the codec's figures for the blocks in memory, the
    tier's for the sealed blocks spilled as their codes. `full_precision_bytes_spilled` is what a full-precision
    spill (`DiskOffloadCache`) writes for the same blocks, and `spill_ratio` = `kv_bytes_spilled` / that."""

    __repr__ = rounded_repr

    full_precision_bytes_spilled: int
    spill_ratio: float


def live_entries(cache: BlockStore) -> set[int]:
    """The distinct table entries (pool ids, sealed or spilled ones) every group's rows still hold."""
    return {block for tables in cache.all_tables for row in tables.rows for block in row.live_ids}


def block_cache_stats(cache: BlockStore) -> CacheStats:
    """The stats of `cache`: `CacheStats`, with each link's section when it has that link."""
    base = _paged(cache)
    if cache.sealer is None and cache.spill_link is None:
        return base
    held = live_entries(cache)
    spilled = {b for b in held if (SEALED_SPILLED_IDS.is_spilled(b) if cache.sealer is not None else b < 0)}
    resident = held - spilled
    sealed = sum(1 for b in resident if is_sealed(b))
    pool = cache.pool
    fp_block = pool.bytes_per_block if pool is not None else 0
    sealed_block = pool.sealed.bytes_per_block if isinstance(pool, QuantizedBlockPool) else 0
    kv = (len(resident) - sealed) * fp_block + sealed * sealed_block
    fields = asdict(base)
    if cache.sealer is not None:
        fields |= _codec(cache, base, len(resident), sealed, kv)
    if cache.spill_link is None:
        return QuantizedCacheStats(**fields)
    fields |= _disk(cache, base, held, len(spilled), kv, sealed_block if cache.sealer is not None else fp_block)
    if cache.sealer is None:
        return DiskCacheStats(**fields)
    fp_spilled = cache.blocks_spilled * fp_block
    return QuantizedDiskCacheStats(
        **fields, full_precision_bytes_spilled=fp_spilled, spill_ratio=_per(fields["kv_bytes_spilled"], fp_spilled)
    )


def _paged(cache: BlockStore) -> CacheStats:
    """Blocks in use are the distinct live blocks of every group's rows (shared blocks count once)."""
    pool, tables = cache.pool, cache.tables
    length = cache.stored_tokens()
    if pool is None or tables is None:
        empty = dict.fromkeys(("sequences", "tokens", "blocks_in_use", "slots_allocated", "slots_filled"), 0)
        return CacheStats(
            **empty, utilization=0.0, bytes_used=0, bytes_per_token=0.0, pool_blocks_reserved=0,
            pool_bytes_reserved=0, block_size=cache.pool_args["block_size"] or 0, attention=cache.attention,
        )  # fmt: skip
    bs = pool.block_size
    filled: dict[int, int] = {}
    for group_tables in cache.all_tables:
        for row in group_tables.rows:
            for i, block in enumerate(row.block_ids[row.freed :], start=row.freed):
                filled[block] = max(filled.get(block, 0), min(bs, length - i * bs))
    blocks = len(filled)
    tokens = tables.batch_size * length
    used = blocks * pool.bytes_per_block
    store = pool.sealed_stats() if isinstance(pool, QuantizedBlockPool) else None
    return CacheStats(
        sequences=tables.batch_size,
        tokens=tokens,
        blocks_in_use=blocks,
        slots_allocated=blocks * bs,
        slots_filled=sum(filled.values()),
        utilization=sum(filled.values()) / (blocks * bs) if blocks else 0.0,
        bytes_used=used,
        bytes_per_token=used / tokens if tokens else 0.0,
        pool_blocks_reserved=pool.capacity + (store.capacity_blocks if store else 0),
        pool_bytes_reserved=pool.capacity * pool.bytes_per_block + (store.bytes_reserved if store else 0),
        block_size=bs,
        attention=cache.attention,
    )


def _codec(cache: BlockStore, base: CacheStats, resident: int, sealed: int, kv: int) -> dict[str, Any]:
    """The codec's section over the blocks in memory (`resident` of them, `sealed` sealed, `kv` bytes as stored)."""
    assert cache.sealer is not None and cache.pool is not None
    pool = cache.pool
    unquantized = resident * pool.bytes_per_block
    return {
        "bytes_used": kv,
        "bytes_per_token": _per(kv, base.tokens),
        "codec": cache.sealer.quant.codec_name,
        "full_precision_blocks": resident - sealed,
        "sealed_blocks": sealed,
        "full_precision_bytes": (resident - sealed) * pool.bytes_per_block,
        "sealed_bytes": kv - (resident - sealed) * pool.bytes_per_block,
        "unquantized_bytes": unquantized,
        "compression": unquantized / kv if kv else 1.0,
        "overflow_blocks": pool.overflow_blocks if isinstance(pool, QuantizedBlockPool) else 0,
    }


def _disk(
    cache: BlockStore, base: CacheStats, held: set[int], spilled: int, kv: int, spilled_block: int
) -> dict[str, Any]:
    """The tier's section: `kv` bytes of blocks in memory plus the read-ahead rows; `spilled_block` is the bytes a
    spilled block was written as."""
    reader, t = cache.prefetcher, cache.tier.stats() if cache.tier is not None else None
    buffers = reader.buffer_bytes if reader is not None else 0
    resident = kv + buffers
    written = cache.blocks_spilled * spilled_block
    return {
        "bytes_used": resident,
        "bytes_per_token": _per(resident, base.tokens),
        "resident_blocks": len(held) - spilled,
        "spilled_blocks": spilled,
        "resident_bytes": resident,
        "read_buffer_bytes": buffers,
        "disk_bytes": t.slots_in_use * t.slot_bytes if t else 0,
        "disk_file_bytes": t.file_bytes if t else 0,
        "spills": t.blocks_written if t else 0,
        "bytes_written": t.bytes_written if t else 0,
        "kv_bytes_spilled": written,
        "write_amplification": _per(t.bytes_written, written) if t else 0.0,
        "fetches": t.fetches if t else 0,
        "blocks_fetched": t.blocks_fetched if t else 0,
        "bytes_read": t.bytes_read if t else 0,
        "prefetched": reader.prefetched if reader is not None else 0,
        "fetched_on_demand": reader.on_demand if reader is not None else 0,
        "fetch_latency_mean_s": t.fetch_latency_mean_s if t else 0.0,
        "fetch_latency_p99_s": t.fetch_latency_p99_s if t else 0.0,
        "fetch_wait_s": reader.wait_s if reader is not None else 0.0,
        "spilling": cache.stop_reason is None,
        "stop_reason": cache.stop_reason,
        "spill_path": t.path if t else None,
        "prefix_blocks": len(held & tree_held(cache)),
    }


def _per(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else 0.0
