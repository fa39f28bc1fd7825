"""`QuantizedDiskCache`: the block store with a codec and a disk link; sealed blocks past a hot window spill as codes.

Spilled blocks are written as stored and read back as sealed blocks, so the output is `QuantizedCache`'s bit for bit
at a fraction of a full-precision spill's bytes (`QuantizedDiskCache` gives the layout).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

from hf_kvgov.engine.block_stats import QuantizedDiskCacheStats
from hf_kvgov.hf.paged_cache import AttentionPath, PagedCache
from hf_kvgov.hf.quantized_cache import QuantizedCache, quant_config_for
from hf_kvgov.prefix.sharing import PrefixCache
from hf_kvgov.tiers.disk_tier import DEFAULT_EXTENT_SLOTS
from hf_kvgov.tiers.spill_config import DEFAULT_HOT_TOKENS, Disk

__all__ = ["QuantizedDiskCache", "QuantizedDiskCacheStats"]


class QuantizedDiskCache(QuantizedCache):
    """int8 / int4 / fp8 KV cache whose sealed blocks older than a hot window live in a file on disk.

    A `QuantizedCache` with a disk link (`hf_kvgov.engine.block_tier.BlockTier`) over its sealed blocks::

        block:    0        1  ..  k-1      k  ..  n-2       n-1
               [ sink ][ spilled codes ][ sealed codes ][ resid. ][ tail ]
                 fp       disk tier       sealed store     fp       fp
                       (older than hot_tokens)  (the hot window)

    At each step's start the sealed blocks that left the hot window are written once, as stored
    (`tiers.sealed_segments`). Blocks read back are appended after the store's pieces for their layer, so every
    attention path decodes them as sealed blocks: the output is `QuantizedCache`'s bit for bit, at a fraction of a
    full-precision spill's bytes (`spill_ratio`, eval/RESULTS.md). Under a prefix tree only private blocks spill,
    and `publish` brings spilled ones back first, so the tree never points at disk (`hf_kvgov.engine.disk_prefix`).

    Args:
        model_or_config: as for `QuantizedCache`.
        path, hot_tokens, max_resident_bytes, max_write_bytes, read_buffer_bytes, prefetch, on_full,
            extent_blocks: the disk tier, as for `DiskOffloadCache`: ``max_resident_bytes`` bounds every
            byte in memory, the full-precision blocks, the hot window's codes and the read-ahead buffers.
        bits, fmt, residual, sink_blocks, full_precision_layers, group_size, layer_formats, scale_bytes,
            attention: as for `QuantizedCache`.
        block_size: tokens per block (None: the prefix tree's, else 16).
        prefix: a `PrefixCache` over a `QuantizedBlockPool` of this configuration (`prefix_tree(model,
            codec=...)`); enables `match` and `publish`. Its pool's cap bounds blocks and codes
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
        residual: int | None = None,
        sink_blocks: int = 1,
        full_precision_layers: Iterable[int] = (),
        group_size: int | Literal["auto"] | None = "auto",
        layer_formats: Mapping[int, str] | Iterable[tuple[int, str]] = (),
        scale_bytes: int | None = None,
        read_buffer_bytes: int | None = None,
        prefetch: bool = True,
        on_full: str = "raise",
        attention: AttentionPath = "contiguous",
        extent_blocks: int = DEFAULT_EXTENT_SLOTS,
        prefix: PrefixCache | None = None,
        namespace: str = "",
    ) -> None:
        disk = Disk(
            None if path is None else str(path),
            hot_tokens,
            max_resident_bytes,
            max_write_bytes,
            read_buffer_bytes,
            prefetch,
            on_full,
            extent_blocks,
        )
        quant = quant_config_for(
            model_or_config, residual, group_size, scale_bytes, bits=bits, fmt=fmt, sink_blocks=sink_blocks,
            full_precision_layers=tuple(full_precision_layers), layer_formats=layer_formats,
        )  # fmt: skip
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

    def stats(self) -> QuantizedDiskCacheStats:
        """What this cache holds in memory and wrote to / read from disk (see `QuantizedDiskCacheStats`)."""
        stats = PagedCache.stats(self)
        assert isinstance(stats, QuantizedDiskCacheStats)
        return stats
