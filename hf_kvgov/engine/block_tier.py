"""`BlockTier`: the disk link of a block cache, whatever its blocks hold.

A `PagedCache` given a disk link spills its cold blocks to a `DiskTier` and reads them back ahead of need. The link
owns what every spilling cache does alike: the tier and its read-ahead, spilling what left the hot window at a
step's start (never blocks a prefix tree holds), bringing blocks back (a crop into a spilled block, a `publish`),
naming a damaged block's tokens, resetting or releasing the file. What differs with the codec link is a
`SpillFormat`: which entries move and how their bytes are read and written, how many leading blocks never move,
how spilled entries are numbered. Raw blocks are read back here, sealed ones by `hf_kvgov.engine.block_sealer`.
With layer groups a sliding group frees what left its window and spills only what is inside it but older than the
hot window (nothing, when `hot_tokens` covers the window); the tier stores one segment per position of a block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hf_kvgov.engine import disk_prefix
from hf_kvgov.engine.quant_config import QuantConfig
from hf_kvgov.errors import SpillCorrupted, SpillSpaceExhausted
from hf_kvgov.storage.block_table import BlockTables
from hf_kvgov.storage.pool import BlockPool, KVGeometry
from hf_kvgov.tiers.disk_tier import DiskTier, TierLayout
from hf_kvgov.tiers.kv_segments import (
    RAW_SPILLED_IDS,
    SegmentReader,
    SpilledIds,
    SpilledLayout,
    gather_tiered,
    raw_part_bytes,
)
from hf_kvgov.tiers.moves import TierBlocks, bring_back, raw_blocks, spill
from hf_kvgov.tiers.prefetch import LayerPrefetcher
from hf_kvgov.tiers.spill_config import Disk
from hf_kvgov.tiers.tiered_tables import TieredBlockTables

if TYPE_CHECKING:
    from hf_kvgov.engine.block_store import BlockStore, StoreLayer
    from hf_kvgov.engine.paged_view import PagedView

RESIDENT_FIRST_BLOCKS = 1  # a raw row's attention-sink block: read by every query, so never worth a round trip


@dataclass(frozen=True)
class SpillFormat:
    """How the tier holds one codec's blocks.

    Args:
        layout: the tier's segments per (block, position of a block). blocks: what can move, and how.
        resident_first: leading blocks of each row that never move. ids: how spilled entries are numbered.
    """

    layout: TierLayout
    blocks: TierBlocks
    resident_first: int
    ids: SpilledIds


def raw_spill_format(pool: BlockPool, extent_blocks: int) -> SpillFormat:
    """Full-precision pool blocks spill as their raw bytes; the first block of a row stays."""
    layout = TierLayout(pool.layers_per_block, raw_part_bytes(pool.geometry, pool.block_size), extent_blocks)
    return SpillFormat(layout, raw_blocks(pool), RESIDENT_FIRST_BLOCKS, RAW_SPILLED_IDS)


class BlockTier:
    """The disk link of one block cache (see the module docstring); the cache passes itself to each call.

    Args:
        disk: the tier's settings.
        sealed: the codec of a cache that spills sealed blocks (its cap counts their codes as well).
    """

    def __init__(self, disk: Disk, sealed: QuantConfig | None = None) -> None:
        self.disk, self.sealed = disk, sealed
        self.tier: DiskTier | None = None  # created with the pool, on the first K/V
        self.prefetcher: LayerPrefetcher | None = None
        self.stop_reason: str | None = None  # why spilling stopped (a full disk, the write budget), or None
        self.blocks_spilled = 0  # distinct blocks written to the tier since construction
        self._blocks: TierBlocks | None = None
        self._resident_first = 0

    # ------------------------------------------------------------------ with the pool

    def check_pool_budget(self, cache: BlockStore, geometry: KVGeometry) -> None:
        """Refuse a `max_resident_bytes` whose pool cannot hold what one sequence keeps in memory."""
        pool_bytes, block_size = self.disk.pool_bytes, cache.pool_args["block_size"]
        if pool_bytes is None or block_size is None:
            return
        blocks, coded, kept = disk_prefix.resident_need(block_size, self.disk, self.sealed)

        def per_group(count: int) -> int:  # a sliding group keeps at most its window, the tail and a step
            windows = [g.window for g in cache.groups]
            return sum(count if w is None else min(count, math.ceil(w / block_size) + 2) for w in windows)

        # A block holds one position of every group.
        full, sealed = per_group(blocks), per_group(coded)
        needed = full * cache.block_bytes(geometry)
        if sealed:
            assert cache.sealer is not None
            needed += sealed * cache.sealer.sealed_block_bytes(geometry, cache.layout.heads, block_size)
        if pool_bytes < needed:
            counted = f"{full} blocks" + (f" and {sealed} sealed blocks" if sealed else "")
            raise ValueError(
                f"max_resident_bytes={self.disk.max_resident_bytes} leaves {pool_bytes} bytes for the pool "
                f"after up to {self.disk.buffer_bytes} of read-ahead buffers, but {kept} need {counted} = {needed} "
                f"bytes at this geometry. Raise max_resident_bytes, or lower "
                f"{'residual, hot_tokens' if self.sealed is not None else 'hot_tokens'} or read_buffer_bytes."
            )

    def attach(self, cache: BlockStore, pool: BlockPool, spilled: SpillFormat) -> None:
        """The tier file, its read-ahead, and tiered block tables for every layer group of `cache`."""
        heads = pool.layout.heads  # position j of a block is read on the device of the layers at j
        self.tier = DiskTier(spilled.layout, self.disk.path, self.disk.max_write_bytes)
        self.prefetcher = LayerPrefetcher(
            self.tier, self.disk.buffer_bytes, lambda position: pool.layer_device(heads[position]), pool
        )
        tables: list[BlockTables] = [TieredBlockTables(pool, self.tier, spilled.ids, g) for g in pool.groups]
        cache.tables, cache.other_tables = tables[0], tables[1:]
        self._blocks, self._resident_first = spilled.blocks, spilled.resident_first

    def _parts(self) -> tuple[DiskTier, LayerPrefetcher, TierBlocks]:
        assert self.tier is not None and self.prefetcher is not None and self._blocks is not None
        return self.tier, self.prefetcher, self._blocks

    @staticmethod
    def tiered_tables(cache: BlockStore) -> list[TieredBlockTables]:
        """Every layer group's block tables of `cache` (their blocks may spill)."""
        return [tables for tables in cache.all_tables if isinstance(tables, TieredBlockTables)]

    @staticmethod
    def spilled_layout(cache: BlockStore, layer: int) -> SpilledLayout | None:
        """Where the batch's live blocks of `layer` live, on its device; None when none of them has spilled."""
        tables = cache.tables_of(layer)
        assert cache.pool is not None and isinstance(tables, TieredBlockTables)
        return tables.spilled_layout(cache.pool.layer_device(layer))

    # ------------------------------------------------------------------ spilling

    def spill_cold_blocks(self, cache: BlockStore) -> None:
        """Write the blocks older than the hot window to disk once (not the tree's), then free them in memory."""
        tier, _, blocks = self._parts()
        pool = cache.pool
        assert pool is not None
        keep_resident = self.disk.on_full == "keep_resident"
        private = disk_prefix.private_blocks(blocks, disk_prefix.tree_held(cache))
        for tables in self.tiered_tables(cache):
            if self.stop_reason is not None or not tables.rows:
                continue
            stop = (tables.num_tokens - self.disk.hot_tokens) // pool.block_size
            # Not what a sliding group frees at this step's start (queries from `num_tokens` on): never written.
            kept = tables.first_kept_token(tables.num_tokens) // pool.block_size
            first = max(self._resident_first, kept)
            try:
                moved, cold = spill(pool, tables, tier, first, stop, keep_resident, private)
            except SpillSpaceExhausted as err:
                if not keep_resident:
                    raise
                self.stop_reason = str(err)
                return
            self.blocks_spilled += moved
            if moved < cold:
                self.stop_reason = f"write budget: max_write_bytes={self.disk.max_write_bytes} reached"

    # ------------------------------------------------------------------ reading back

    def take(self, cache: BlockStore, layer: int, handles: list[int], outs: list[torch.Tensor]) -> None:
        """Read this layer's spilled blocks `handles` into `outs`, then start reading the next spilling layer's
        (the next layer whose group has spilled blocks: a sliding group may have none)."""
        prefetcher = self._parts()[1]
        try:
            prefetcher.take(cache.layout.position[layer], handles, outs)
        except SpillCorrupted as err:
            raise self.located(cache, err) from err
        for step in range(1, cache.num_layers + 1):  # the next layer (cyclically: the next step's) that reads some
            following = (layer + step) % cache.num_layers
            if cache.tables_of(following) is cache.tables_of(layer):  # one group's layers read the same blocks
                prefetcher.request(cache.layout.position[following], handles)
                return
            if (spilled := self.spilled_layout(cache, following)) is not None:
                prefetcher.request(cache.layout.position[following], spilled.handles)
                return

    def _raw_reader(self, cache: BlockStore, layer: int, layout: SpilledLayout) -> SegmentReader:
        """Reads this layer's spilled blocks into the tensors given, then starts reading the next layer's."""
        return lambda outs: self.take(cache, layer, layout.handles, outs)

    def raw_kv(self, cache: BlockStore, layer: StoreLayer) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A full-precision layer's K/V `[batch, kv_heads, length, head_dim]` with its spilled blocks read back;
        None when none of them has spilled."""
        layout, pool, i = self.spilled_layout(cache, layer.index), cache.pool, layer.index
        if layout is None:
            return None
        assert pool is not None
        first = cache.tables_of(i).first_block * pool.block_size  # the layout starts there, as attention does
        reader = self._raw_reader(cache, i, layout)
        return gather_tiered(pool.keys[i], pool.values[i], layout, layer.length - first, reader)

    def add_raw_to_view(self, cache: BlockStore, layer: StoreLayer, view: PagedView) -> None:
        """Append a full-precision layer's spilled blocks, read back, after the pool's in the paged view."""
        layout = self.spilled_layout(cache, layer.index)
        if layout is None:
            return
        capacity, caches = view.key_cache.shape[0], []
        for pool_layer in (view.key_cache, view.value_cache):
            copy = pool_layer.new_empty((capacity + len(layout.handles), *pool_layer.shape[1:]))
            copy[:capacity] = pool_layer
            caches.append(copy)
        self._raw_reader(cache, layer.index, layout)([copy[capacity:] for copy in caches])
        view.key_cache, view.value_cache = caches
        view.block_table = layout.paged_table(capacity)

    def located(self, cache: BlockStore, err: SpillCorrupted) -> SpillCorrupted:
        """The same error, naming the layer that reads the damaged segment and the tokens its block holds."""
        for tables in self.tiered_tables(cache):
            tokens = tables.tokens_of(err.block)
            if tokens is not None:
                assert tables.group is not None
                layer = tables.group.layers[err.layer]  # the tier numbers a block's segments by position
                return SpillCorrupted(err.block, layer, err.path, err.offset, tokens)
        return err

    def bring_back(self, cache: BlockStore, first: int, stop: int | None = None) -> None:
        """The spilled blocks at block columns [first, stop) (default: `first` only) come back into memory."""
        tier, prefetcher, blocks = self._parts()
        assert cache.pool is not None
        try:
            for tables in self.tiered_tables(cache):
                bring_back(cache.pool, tables, tier, first, blocks, stop)
        except SpillCorrupted as err:
            raise self.located(cache, err) from err
        prefetcher.clear()  # the freed disk slots' handles may come back for other blocks

    def before_truncate(self, cache: BlockStore, length: int) -> None:
        """A crop to `length` may end inside a spilled block; the next write lands there, so it comes back."""
        assert cache.pool is not None
        if self.tier is not None and length % cache.pool.block_size:
            self.bring_back(cache, length // cache.pool.block_size)

    def after_truncate(self) -> None:
        """Dropped spilled blocks freed their disk slots, whose handles may come back for other blocks."""
        if self.prefetcher is not None:
            self.prefetcher.clear()

    # ------------------------------------------------------------------ prefix sharing

    def after_match(self, cache: BlockStore) -> None:
        """The matched blocks stay in memory for as long as the cache holds them."""
        for tables in self.tiered_tables(cache):
            disk_prefix.make_rows_tiered(tables)

    def before_publish(self, cache: BlockStore, sequences: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        """Bring the spilled blocks a `publish` offers back into memory, or raise with nothing changed."""
        disk_prefix.bring_back_offered(cache, sequences, attention_mask, lambda a, b: self.bring_back(cache, a, b))

    # ------------------------------------------------------------------ lifetime

    def before_release(self) -> None:
        """Before the cache forgets its tokens: the read-ahead rows are freed (the next spill sizes them again)."""
        if self.prefetcher is not None:
            self.prefetcher.close()

    def after_release(self, close: bool) -> None:
        """After the cache forgot its tokens; `close`: also stop the reader and delete the spill file."""
        self.stop_reason = None
        if close and self.tier is not None:
            self.tier.close()

    def drop_page_cache(self) -> None:
        """Make the next reads of spilled blocks come from the device, not the OS page cache (benchmarks)."""
        if self.tier is not None:
            self.tier.drop_page_cache()
