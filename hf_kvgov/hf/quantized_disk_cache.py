"""`QuantizedDiskCache`: a `QuantizedCache` whose sealed blocks older than a hot window spill to SSD as codes.

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
offers back into the sealed store, so the tree never points at disk (`hf_kvgov.hf.disk_prefix`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from hf_kvgov.chain.parts import Paging
from hf_kvgov.hf import disk_prefix
from hf_kvgov.hf.block_tier import BlockTier
from hf_kvgov.hf.paged_cache import PAGED_VIEW_KEY, AttentionPath, PagedCache, PagedLayer
from hf_kvgov.hf.quant_config import QuantConfig
from hf_kvgov.hf.quantized_cache import QuantizedCache
from hf_kvgov.hf.quantized_disk_stats import QuantizedDiskCacheStats, quantized_disk_stats
from hf_kvgov.kernels.quantized_reference import SealedReader, gather_quantized
from hf_kvgov.kernels.sealed_blocks import SealedBlocks
from hf_kvgov.prefix.sharing import PrefixCache
from hf_kvgov.storage.pool import BlockPool
from hf_kvgov.storage.quantized_pool import QuantizedBlockPool
from hf_kvgov.tiers.disk_tier import DEFAULT_EXTENT_SLOTS
from hf_kvgov.tiers.kv_segments import SEALED_SPILLED_IDS
from hf_kvgov.tiers.sealed_segments import (
    after_the_store,
    empty_pieces,
    read_store_or_stack,
    sealed_blocks,
    sealed_tier_layout,
)
from hf_kvgov.tiers.spill_config import DEFAULT_HOT_TOKENS, DiskCacheConfig


class QuantizedDiskCache(QuantizedCache):
    """int8 / int4 / fp8 KV cache whose sealed blocks older than a hot window live in a file on disk.

    A `QuantizedCache` with a disk link (`hf_kvgov.hf.block_tier.BlockTier`) over its sealed blocks; this class
    says how the link lays out their codes and how attention reads the ones that come back.

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
        self.spill_link = BlockTier(disk, sealed=quant)
        block_size = disk_prefix.cache_block_size(prefix, self.disk, block_size, sealed=quant)
        super().__init__(
            model_or_config,
            bits,
            fmt,
            block_size,
            residual,
            sink_blocks,
            layers,
            group_size,
            layer_formats,
            scale_bytes,
            max_bytes=self.disk.pool_bytes,
            attention=attention,
            prefix=prefix,
            namespace=namespace,
        )
        self.parts = dataclasses.replace(self.parts, pool=Paging(block_size), spill=self.disk)

    # ------------------------------------------------------------------ pool and tier

    def _adopt_pool(self, pool: BlockPool) -> None:
        super()._adopt_pool(pool)  # refuses anything but a QuantizedBlockPool of this configuration
        assert isinstance(pool, QuantizedBlockPool)
        layout = sealed_tier_layout(pool, self.disk.extent_blocks)
        # Sealed entries are -1 - sealed id, so spilled ones are numbered below -2**62.
        self._link.attach(self, pool, layout, sealed_blocks(pool), self.quant.sink_blocks, SEALED_SPILLED_IDS)

    # ------------------------------------------------------------------ reading back

    def _with_spilled(
        self, layer: int, in_place: bool = False
    ) -> tuple[torch.Tensor, SealedReader, SealedBlocks | None] | None:
        """This layer's (block table, sealed reader, sealed blocks), its spilled blocks read back and numbered
        after the store's; None when nothing has spilled.

        The reader copies only the blocks it is asked for. The sealed blocks, for kernels that read codes in
        place (`in_place`, the paged path), are the store's pieces followed by the read-back ones: one copy of
        the layer's store per step.
        """
        pool, layout = self._quantized_pool, self._link.spilled_layout(self, layer)
        if layout is None:
            return None
        stack = empty_pieces(pool, layer, len(layout.handles), pool.layer_device(layer))
        self._link.take(self, layer, layout.handles, list(stack.values()))
        stored, fmt = pool.sealed.pieces[layer], pool.sealed.formats[layer]

        def read(entries: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
            return fmt.decode(read_store_or_stack(stored, stack, -1 - entries), dtype)

        if not in_place:
            return after_the_store(pool, layout), read, None
        # Kernels reading codes in place take one tensor per piece: the store's, then the stack (one copy).
        pieces = {name: torch.cat([stored[name], stack[name]]) for name in stored}
        return after_the_store(pool, layout), read, SealedBlocks(fmt.name, pieces)

    def _contiguous_kv(self, layer: PagedLayer) -> tuple[torch.Tensor, torch.Tensor]:
        spilled = self._with_spilled(layer.index)
        if spilled is None:
            return super()._contiguous_kv(layer)
        pool, (table, read, _) = self._quantized_pool, spilled
        i = layer.index
        first = self._tables_of(i).first_block * pool.block_size  # the layout starts there, as attention does
        return gather_quantized(pool.keys[i], pool.values[i], table, layer.length - first, read, pool.geometry.dtype)

    def _hand_view_to_attention(
        self,
        layer: PagedLayer,
        attn_kwargs: dict[str, Any] | None,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        result = super()._hand_view_to_attention(layer, attn_kwargs, key_states, value_states)
        spilled = self._with_spilled(layer.index, in_place=True)
        if spilled is not None and attn_kwargs is not None:
            view = attn_kwargs[PAGED_VIEW_KEY]
            view.block_table, view.read_sealed, view.sealed = spilled
        return result

    # ------------------------------------------------------------------ accounting

    def stats(self) -> QuantizedDiskCacheStats:  # type: ignore[override]
        """What this cache holds in memory and wrote to / read from disk (see `QuantizedDiskCacheStats`)."""
        return quantized_disk_stats(self, PagedCache.stats(self))
