"""`DiskOffloadCache`: the block store with a disk link: cold blocks spill to a file on SSD and come back ahead of need.

The pool keeps the first block, the blocks of the latest `hot_tokens` tokens and the tail being written. At each
step's start the blocks that became cold are written to the disk tier once and freed; each layer reads its spilled
blocks back, mostly from buffers a background thread filled while the previous layer computed. Blocks round-trip
bit for bit (CRC-32 checked), so the output is PagedCache's. `resident_bytes` (pool blocks + read-ahead buffers)
stays under `max_resident_bytes`; the buffers hold one layer of the spilled blocks, so spilling never costs memory
it does not save (the K/V of one layer handed to attention is not counted). The pool must hold the hot window plus
one step's tokens: feed long prompts in chunks (``prefill_chunk_size``). With ``prefix=PrefixCache(pool)`` only a
row's private cold blocks spill (`hf_kvgov.engine.disk_prefix`). The spilling is the disk link's
(`hf_kvgov.engine.block_tier.BlockTier`); this class only configures it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hf_kvgov.engine.block_stats import DiskCacheStats
from hf_kvgov.engine.block_tier import RESIDENT_FIRST_BLOCKS
from hf_kvgov.hf.paged_cache import AttentionPath, PagedCache
from hf_kvgov.prefix.sharing import PrefixCache
from hf_kvgov.tiers.disk_tier import DEFAULT_EXTENT_SLOTS
from hf_kvgov.tiers.spill_config import DEFAULT_HOT_TOKENS, Disk

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
        disk = Disk(
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
