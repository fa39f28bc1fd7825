"""`QuantizedDiskCache`: the block store with a codec and a disk link: sealed blocks older than a hot window
spill to SSD as codes.

Per row, where each block lives::

    block:    0        1  ..  k-1      k  ..  n-2       n-1
           [ sink ][ spilled codes ][ sealed codes ][ resid. ][ tail ]
             fp       disk tier       sealed store     fp       fp
                   (older than hot_tokens)  (the hot window)

Sealing is `QuantizedCache`'s (at the end of the step that filled a block). At the start of each step the
sealed blocks that left the hot window are written to the disk tier once, as their stored bytes (codes +
scales: one segment per (block, layer), `tiers.sealed_segments`), their sealed slots are freed and their
table entries point at disk. Each layer then reads its spilled blocks back (mostly from the read-ahead
buffers filled while the previous layer computed) and attention decodes them exactly as the sealed store
would: the output is `QuantizedCache`'s with the same codec, block size and residual, bit for bit.

Against a 16-bit full-precision spill of the same tokens, an int8 spill writes (and reads back) 0.58x the
bytes at 16-token blocks of head dim 64 and 0.53x at 64-token blocks, int4 0.33x and 0.28x: codes plus
the scales and zero points (`QuantizedDiskCacheStats.spill_ratio` reports it). Spilled blocks read back by a step are
appended after the store's pieces for the layer that reads them (one copy of the layer's resident sealed
slots, which the hot window bounds), so every attention path, in-place kernels included, reads them as
sealed blocks.

Layers kept in full precision (`full_precision_layers`) spill their sealed blocks as raw K/V, the other
layers as codes: the tier records each layer's segment layout.

Memory: `max_resident_bytes` caps the full-precision pool blocks and the read-ahead buffers, as for
`DiskOffloadCache` (the buffers hold one layer of the spilled codes, up to `read_buffer_bytes`, and nothing
before a block spills); sealed slots come on top: the hot window's (``hot_tokens / block_size + 1`` blocks of
codes per row) and the blocks a step seals, which spill at the start of the next.

Prefix sharing (``prefix=PrefixCache(pool)`` over a `QuantizedBlockPool` of this configuration, `match` /
`publish` as `QuantizedCache`'s, so the two share blocks): blocks the tree holds (the sink and sealed codes)
stay resident, and only a row's private sealed blocks spill; `publish` first brings the spilled blocks it
offers back into the sealed store, so the tree never points at disk (`hf_kvgov.engine.disk_prefix`).

The two links (`hf_kvgov.engine.block_sealer.BlockSealer`, `hf_kvgov.engine.block_tier.BlockTier`) do the work, called
by `PagedCache`; this class only configures them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from hf_kvgov.engine.quant_config import QuantConfig
from hf_kvgov.engine.quantized_disk_stats import QuantizedDiskCacheStats
from hf_kvgov.hf.paged_cache import AttentionPath, PagedCache
from hf_kvgov.hf.quantized_cache import QuantizedCache
from hf_kvgov.prefix.sharing import PrefixCache
from hf_kvgov.tiers.disk_tier import DEFAULT_EXTENT_SLOTS
from hf_kvgov.tiers.spill_config import DEFAULT_HOT_TOKENS, DiskCacheConfig

__all__ = ["QuantizedDiskCache", "QuantizedDiskCacheStats"]


class QuantizedDiskCache(QuantizedCache):
    """int8 / int4 / fp8 KV cache whose sealed blocks older than a hot window live in a file on disk.

    A `QuantizedCache` with a disk link (`hf_kvgov.engine.block_tier.BlockTier`) over its sealed blocks.

    Args:
        model_or_config: as for `QuantizedCache`.
        path, hot_tokens, max_resident_bytes, max_write_bytes, read_buffer_bytes, prefetch, on_full,
            extent_blocks: the disk tier, as for `DiskOffloadCache` (see the module docstring for the cap).
        bits, fmt, residual, sink_blocks, full_precision_layers, group_size, layer_formats, scale_bytes,
            attention: as for `QuantizedCache`.
        block_size: tokens per block (None: the prefix tree's, else 16).
        prefix: a `PrefixCache` over a `QuantizedBlockPool` of this configuration (`prefix_tree(model,
            codec=...)`); enables `match` and `publish`. Its pool's cap bounds the full-precision blocks
            (max_resident_bytes is refused).
        namespace: prefix-sharing namespace, as for `QuantizedCache` (which shares blocks with this cache).
    """

    def __init__(
        self,
        model_or_config: Any,
        path: str | Path | None = None,
        hot_tokens: int = DEFAULT_HOT_TOKENS,
        max_resident_bytes: int | None = None,
        max_write_bytes: int | None = None,
        *,
        bits: int = 8,
        fmt: str = "int",
        block_size: int | None = None,
        residual: int = 0,
        sink_blocks: int = 1,
        full_precision_layers: Iterable[int] = (),
        group_size: int | None = None,
        layer_formats: Mapping[int, str] | Iterable[tuple[int, str]] = (),
        scale_bytes: int = 2,
        read_buffer_bytes: int | None = None,
        prefetch: bool = True,
        on_full: str = "raise",
        attention: AttentionPath = "contiguous",
        extent_blocks: int = DEFAULT_EXTENT_SLOTS,
        prefix: PrefixCache | None = None,
        namespace: str = "",
    ) -> None:
        disk = DiskCacheConfig(
            None if path is None else str(path),
            hot_tokens,
            max_resident_bytes,
            max_write_bytes,
            read_buffer_bytes,
            prefetch,
            on_full,
            extent_blocks,
        )
        layers = tuple(full_precision_layers)
        quant = QuantConfig(bits, fmt, residual, sink_blocks, layers, group_size, layer_formats, scale_bytes)
        # The store's own constructor: QuantizedCache's takes no disk link.
        PagedCache.__init__(
            self,
            model_or_config,
            block_size,
            attention=attention,
            prefix=prefix,
            namespace=namespace,
            codec=quant,
            spill=disk,
        )

    def stats(self) -> QuantizedDiskCacheStats:  # type: ignore[override]
        """What this cache holds in memory and wrote to / read from disk (see `QuantizedDiskCacheStats`)."""
        stats = PagedCache.stats(self)
        assert isinstance(stats, QuantizedDiskCacheStats)
        return stats
