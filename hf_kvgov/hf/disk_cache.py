"""`DiskOffloadCache`: the block store with a disk link: cold blocks spill to a file on SSD and come back ahead of need.

In memory (the pool) stay the first block, the blocks holding the latest `hot_tokens` tokens, and the
tail being written. Every older block is sealed (full) and cold: at the start of each forward step the
blocks that became cold are written to the disk tier once, their pool blocks are freed, and their table
entries point at disk. Each layer then reads its spilled blocks back, mostly from read-ahead buffers that
a background thread filled while the previous layer computed.

Blocks round-trip bit for bit (raw bytes, CRC-32 checked), so the output is PagedCache's, which is
DynamicCache's. Memory: `resident_bytes` (pool blocks held + read-ahead buffers) stays under
`max_resident_bytes`, which caps the pool the cache creates. The read-ahead buffers follow the spill: none
before a block is read back, then one layer of the spilled blocks (up to `read_buffer_bytes`), a fraction
1 / layers of what left the pool, so spilling never costs memory it does not save. The pool must hold the
hot window plus the tokens of one forward step: feed long prompts in chunks
(``generate(..., prefill_chunk_size=512)``).
Not counted: the one layer of K/V handed to attention, which every cache materialises.

Prefix sharing (``prefix=PrefixCache(pool)``, `match` / `publish` as PagedCache's): the cache draws its blocks
from the tree's pool, whose own cap bounds memory; blocks the tree holds stay resident and only a row's
private cold blocks spill (`hf_kvgov.engine.disk_prefix` says why, and what `publish` brings back).

The spilling itself is the disk link's (`hf_kvgov.engine.block_tier.BlockTier`), which `PagedCache` calls; this class
only configures it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hf_kvgov.engine.block_tier import RESIDENT_FIRST_BLOCKS
from hf_kvgov.engine.disk_stats import DiskCacheStats
from hf_kvgov.hf.paged_cache import AttentionPath, PagedCache
from hf_kvgov.prefix.sharing import PrefixCache
from hf_kvgov.tiers.disk_tier import DEFAULT_EXTENT_SLOTS
from hf_kvgov.tiers.spill_config import DEFAULT_HOT_TOKENS, DiskCacheConfig

__all__ = ["RESIDENT_FIRST_BLOCKS", "DiskCacheStats", "DiskOffloadCache"]


class DiskOffloadCache(PagedCache):
    """Lossless KV cache whose sealed blocks older than a hot window live in a file on disk.

    A `PagedCache` with a disk link (`hf_kvgov.engine.block_tier.BlockTier`) over its raw blocks.

    Args:
        model_or_config: as for `PagedCache`.
        path: directory for the spill file (created if missing; each cache creates its own file in it).
            None: a private ``kvgov-spill-*`` directory in the system's temporary directory
            (`tempfile.gettempdir()`: $TMPDIR, else /tmp), made when the first block spills and deleted by
            `release()` or garbage collection.
        hot_tokens: the latest tokens kept in memory (with the first block and the tail).
        max_resident_bytes: cap on pool blocks + read-ahead buffers; the pool is capped at the rest and
            raises `PoolExhausted` if one step's tokens do not fit. None: no cap.
        max_write_bytes: cap on bytes ever written to disk (SSD wear). None: no cap.
        block_size: tokens per block.
        read_buffer_bytes: the most read-ahead memory (default: a quarter of max_resident_bytes, else
            16 MiB). Rows are allocated as spilled blocks are read back, one segment (one layer of one
            block) per spilled block up to this cap, so a request that spills nothing holds none.
        prefetch: read the next layer's spilled blocks in a background thread.
        on_full: "raise" (`SpillSpaceExhausted` when the disk or the budget is full) or "keep_resident"
            (stop spilling; blocks stay in memory).
        attention: "contiguous" or "paged", as for `PagedCache`.
        extent_blocks: blocks reserved on disk per file growth step.
        prefix: a `PrefixCache` over a plain `BlockPool`, shared across requests; enables `match` and
            `publish`. Blocks come from its pool, whose cap bounds memory (max_resident_bytes is refused).
            block_size None: the tree's (else 16 tokens).
        namespace: prefix-sharing namespace (tenant salt). Blocks are stored as PagedCache stores them,
            so a PagedCache and a DiskOffloadCache on one tree share blocks of the same namespace.
    """

    def __init__(
        self,
        model_or_config: Any,
        path: str | Path | None = None,
        hot_tokens: int = DEFAULT_HOT_TOKENS,
        max_resident_bytes: int | None = None,
        max_write_bytes: int | None = None,
        *,
        block_size: int | None = None,
        read_buffer_bytes: int | None = None,
        prefetch: bool = True,
        on_full: str = "raise",
        attention: AttentionPath = "contiguous",
        extent_blocks: int = DEFAULT_EXTENT_SLOTS,
        prefix: PrefixCache | None = None,
        namespace: str = "",
    ) -> None:
        disk = DiskCacheConfig(
            path=None if path is None else str(path),
            hot_tokens=hot_tokens,
            max_resident_bytes=max_resident_bytes,
            max_write_bytes=max_write_bytes,
            read_buffer_bytes=read_buffer_bytes,
            prefetch=prefetch,
            on_full=on_full,
            extent_blocks=extent_blocks,
        )
        super().__init__(
            model_or_config, block_size, attention=attention, prefix=prefix, namespace=namespace, spill=disk
        )

    def stats(self) -> DiskCacheStats:
        """`DiskCacheStats`: what this cache holds in memory and on disk (see its docstring)."""
        stats = super().stats()
        assert isinstance(stats, DiskCacheStats)
        return stats
