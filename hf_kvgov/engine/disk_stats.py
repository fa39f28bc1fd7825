"""What a cache with a disk tier and no codec (`DiskOffloadCache`) holds in memory and on disk: `DiskCacheStats`
and how it is counted."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hf_kvgov.engine.disk_prefix import tree_held
from hf_kvgov.engine.paged_stats import CacheStats, live_entries
from hf_kvgov.stats_repr import rounded_repr
from hf_kvgov.tiers.accounting import TierStats

if TYPE_CHECKING:
    from hf_kvgov.engine.block_store import BlockStore

_NO_TIER = TierStats(None, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0.0, 0.0, 0)  # before the first K/V arrives


@dataclass(frozen=True)
class DiskCacheStats(CacheStats):
    """`CacheStats` plus the disk tier's accounting.

    Here `bytes_used` (and `bytes_per_token`) count memory only: `resident_bytes`, the pool blocks this
    cache holds plus the read-ahead rows allocated (`read_buffer_bytes`: one layer of the spilled blocks,
    up to the configured cap; 0 before anything spills). A fetch reads one layer of a run of adjacent blocks;
    write amplification is bytes written / KV bytes spilled (1.0 unless a write failed halfway).
    With prefix sharing, blocks the tree holds that this cache uses (`prefix_blocks`) count in full in
    `resident_blocks` / `resident_bytes`, as this cache needs them in memory; caches sharing a prefix
    thus each count it, and the pool's own `stats()` gives the figure with each block counted once.
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
    kv_bytes_spilled: int
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


def disk_cache_stats(cache: BlockStore, base: CacheStats) -> DiskCacheStats:
    """`base` (the paged accounting) with memory counted as resident bytes, plus the tier's counters."""
    held = live_entries(cache)
    resident_blocks = sum(1 for b in held if b >= 0)
    prefix_blocks = len(held & tree_held(cache))
    reader = cache.prefetcher
    buffers = reader.buffer_bytes if reader is not None else 0
    resident = resident_blocks * (cache.pool.bytes_per_block if cache.pool is not None else 0) + buffers
    t = cache.tier.stats() if cache.tier is not None else _NO_TIER
    spilled = cache.blocks_spilled * (cache.pool.bytes_per_block if cache.pool is not None else 0)
    per_token = resident / base.tokens if base.tokens else 0.0
    return DiskCacheStats(
        **(dataclasses.asdict(base) | {"bytes_used": resident, "bytes_per_token": per_token}),
        resident_blocks=resident_blocks,
        spilled_blocks=len(held) - resident_blocks,
        resident_bytes=resident,
        read_buffer_bytes=buffers,
        disk_bytes=t.slots_in_use * t.slot_bytes,
        disk_file_bytes=t.file_bytes,
        spills=t.blocks_written,
        bytes_written=t.bytes_written,
        kv_bytes_spilled=spilled,
        write_amplification=t.bytes_written / spilled if spilled else 0.0,
        fetches=t.fetches,
        blocks_fetched=t.blocks_fetched,
        bytes_read=t.bytes_read,
        prefetched=reader.prefetched if reader is not None else 0,
        fetched_on_demand=reader.on_demand if reader is not None else 0,
        fetch_latency_mean_s=t.fetch_latency_mean_s,
        fetch_latency_p99_s=t.fetch_latency_p99_s,
        fetch_wait_s=reader.wait_s if reader is not None else 0.0,
        spilling=cache.stop_reason is None,
        stop_reason=cache.stop_reason,
        spill_path=t.path,
        prefix_blocks=prefix_blocks,
    )
