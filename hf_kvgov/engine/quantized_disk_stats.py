"""What a cache with a codec and a disk tier (`QuantizedDiskCache`) holds in memory (full-precision blocks, sealed
slots, read-ahead buffers) and what it wrote to and read from disk."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hf_kvgov.engine.disk_prefix import tree_held
from hf_kvgov.engine.paged_stats import CacheStats, live_entries
from hf_kvgov.stats_repr import rounded_repr
from hf_kvgov.storage.quantized_pool import QuantizedBlockPool, is_sealed
from hf_kvgov.tiers.kv_segments import SEALED_SPILLED_IDS

if TYPE_CHECKING:
    from hf_kvgov.engine.block_store import BlockStore


@dataclass(frozen=True)
class QuantizedDiskCacheStats(CacheStats):
    """`CacheStats` of memory only (`bytes_used` = `resident_bytes`), plus the codec's and the tier's figures.

    Blocks are distinct blocks of the batch (shared by beams: counted once). `full_precision_bytes_spilled`
    is what a full-precision spill (`DiskOffloadCache`) writes for the blocks this cache spilled, and
    `spill_ratio` = `kv_bytes_spilled` / that. A fetch reads one layer of a run of adjacent blocks. With
    prefix sharing, the tree's blocks this cache uses (`prefix_blocks`) count in full in its resident
    bytes, as for `DiskCacheStats`.
    """

    __repr__ = rounded_repr

    codec: str
    full_precision_blocks: int
    sealed_blocks: int  # resident in the sealed store (the hot window)
    spilled_blocks: int
    full_precision_bytes: int
    sealed_bytes: int
    read_buffer_bytes: int
    resident_bytes: int  # full_precision_bytes + sealed_bytes + read_buffer_bytes
    disk_bytes: int  # live slots x slot size
    disk_file_bytes: int  # reserved on disk
    spills: int  # blocks written
    bytes_written: int
    kv_bytes_spilled: int  # codes + scales of the blocks spilled
    full_precision_bytes_spilled: int
    spill_ratio: float
    write_amplification: float  # bytes_written / kv_bytes_spilled: 1.0 unless a write failed halfway
    fetches: int
    blocks_fetched: int  # (block, layer) segments read back
    bytes_read: int
    prefetched: int  # segments served by the read-ahead
    fetched_on_demand: int  # segments read when their layer asked
    fetch_wait_s: float  # time layers waited for spilled blocks (I/O the read-ahead did not hide)
    spilling: bool
    stop_reason: str | None
    spill_path: str | None
    prefix_blocks: int = 0  # resident blocks this cache uses that the prefix tree holds (never spilled)


def quantized_disk_stats(cache: BlockStore, base: CacheStats) -> QuantizedDiskCacheStats:
    """`cache`'s figures; `base` is its `PagedCache.stats()` (logical tokens, blocks in use)."""
    pool = cache.pool if isinstance(cache.pool, QuantizedBlockPool) else None
    held = live_entries(cache)
    spilled = sum(1 for b in held if SEALED_SPILLED_IDS.is_spilled(b))
    sealed = sum(1 for b in held if is_sealed(b)) - spilled
    full = len(held) - sealed - spilled
    fp_block, sealed_block = (pool.bytes_per_block, pool.sealed.bytes_per_block) if pool else (0, 0)
    buffers = cache.prefetcher.buffer_bytes if cache.prefetcher is not None else 0
    resident = full * fp_block + sealed * sealed_block + buffers
    written, fp_written = cache.blocks_spilled * sealed_block, cache.blocks_spilled * fp_block
    return QuantizedDiskCacheStats(
        **(dataclasses.asdict(base) | {"bytes_used": resident, "bytes_per_token": _per(resident, base.tokens)}),
        codec=_codec_name(cache),
        full_precision_blocks=full,
        sealed_blocks=sealed,
        spilled_blocks=spilled,
        full_precision_bytes=full * fp_block,
        sealed_bytes=sealed * sealed_block,
        read_buffer_bytes=buffers,
        resident_bytes=resident,
        kv_bytes_spilled=written,
        full_precision_bytes_spilled=fp_written,
        spill_ratio=_per(written, fp_written),
        prefix_blocks=len(held & tree_held(cache)),
        **_tier_stats(cache, written),
    )


def _tier_stats(cache: BlockStore, written: int) -> dict[str, Any]:
    reader, t = cache.prefetcher, cache.tier.stats() if cache.tier is not None else None
    return {
        "disk_bytes": t.slots_in_use * t.slot_bytes if t else 0,
        "disk_file_bytes": t.file_bytes if t else 0,
        "spills": t.blocks_written if t else 0,
        "bytes_written": t.bytes_written if t else 0,
        "write_amplification": _per(t.bytes_written, written) if t else 0.0,
        "fetches": t.fetches if t else 0,
        "blocks_fetched": t.blocks_fetched if t else 0,
        "bytes_read": t.bytes_read if t else 0,
        "prefetched": reader.prefetched if reader is not None else 0,
        "fetched_on_demand": reader.on_demand if reader is not None else 0,
        "fetch_wait_s": reader.wait_s if reader is not None else 0.0,
        "spilling": cache.stop_reason is None,
        "stop_reason": cache.stop_reason,
        "spill_path": t.path if t else None,
    }


def _per(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else 0.0


def _codec_name(cache: BlockStore) -> str:
    assert cache.sealer is not None, "a cache spilling sealed blocks has a codec"
    return cache.sealer.quant.codec_name
