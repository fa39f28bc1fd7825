"""What every cache with a disk tier does the same way, whatever its blocks hold.

`DiskOffloadCache` spills full-precision pool blocks and `QuantizedDiskCache` spills sealed codes; both
keep the same bookkeeping around the tier, which lives here once: the tier and its read-ahead, spilling
the blocks that left the hot window at the start of a step (never the ones a prefix tree holds),
bringing blocks back (a crop into a spilled block, a `publish`), naming the tokens of a damaged block,
and resetting or releasing the file.

Layer groups (a hybrid sliding-window model): every group's tables are tiered. A sliding group frees every
block that left its window (from memory or from disk), so it holds at most about `window + block_size`
tokens per row, and spills only what is inside its window but older than the hot window: with
`hot_tokens` at least the window, nothing of a sliding layer is ever written. The tier stores one segment
per position of a block (a pool block holds one group's layers, `hf_kvgov.storage.layer_groups`), and each
layer reads the segment of its position; the read-ahead fetches the next layer's blocks.

A subclass says what differs when it attaches the tier (`_attach_tier`): its blocks' kind (which entries
the tier can take and how their bytes are read and written), how many leading blocks of a row never move
(the sink every query reads), and how spilled entries are numbered; and how it counts what it spilled
(`_count_spilled`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from hf_kvgov.errors import SpillCorrupted, SpillSpaceExhausted
from hf_kvgov.hf import disk_prefix
from hf_kvgov.hf.paged_cache import PagedCache
from hf_kvgov.hf.quant_config import QuantConfig
from hf_kvgov.storage.block_table import BlockTables
from hf_kvgov.storage.pool import BlockPool, KVGeometry
from hf_kvgov.tiers.block_table import TieredBlockTables
from hf_kvgov.tiers.disk_tier import DiskTier, TierLayout
from hf_kvgov.tiers.kv_segments import SpilledIds, SpilledLayout
from hf_kvgov.tiers.moves import TierBlocks, bring_back, spill
from hf_kvgov.tiers.prefetch import LayerPrefetcher
from hf_kvgov.tiers.spill_config import DiskCacheConfig


class DiskTieredCache(PagedCache):
    """A `PagedCache` (or subclass) whose cold blocks live in a `DiskTier`; see the module docstring."""

    disk: DiskCacheConfig

    def _init_tier(self, disk: DiskCacheConfig, sealed: QuantConfig | None = None) -> None:
        """Before the base `__init__`: the tier is created with the pool, on the first K/V.

        `sealed`: the codec of a cache that spills sealed blocks (its cap counts full-precision blocks only).
        """
        self.disk, self._sealed = disk, sealed
        self.tier: DiskTier | None = None
        self.prefetcher: LayerPrefetcher | None = None
        self.stop_reason: str | None = None  # why spilling stopped (a full disk, the write budget), or None

    def _create_pool(self, dtype: torch.dtype, device: torch.device) -> None:
        self._check_pool_budget(self._geometry(dtype, device))
        super()._create_pool(dtype, device)

    def _check_pool_budget(self, geometry: KVGeometry) -> None:
        """Refuse a `max_resident_bytes` whose pool cannot hold what one sequence keeps in memory."""
        pool_bytes, block_size = self.disk.pool_bytes, self._pool_args["block_size"]
        if pool_bytes is None or block_size is None:
            return
        blocks, kept = disk_prefix.resident_need(block_size, self.disk, self._sealed)
        # A block holds one position of every group; a sliding group keeps at most its window, the tail and a step.
        bytes_per_block = geometry.bytes_per_token // geometry.num_layers * len(self.layout.heads) * block_size
        per_group = [
            blocks if g.window is None else min(blocks, math.ceil(g.window / block_size) + 2) for g in self.groups
        ]
        needed = sum(per_group) * bytes_per_block
        if pool_bytes < needed:
            raise ValueError(
                f"max_resident_bytes={self.disk.max_resident_bytes} leaves {pool_bytes} bytes for full-precision "
                f"blocks after up to {self.disk.buffer_bytes} of read-ahead buffers, but {kept} need {blocks} blocks = "
                f"{needed} bytes at this geometry. Raise max_resident_bytes, or lower "
                f"{'residual' if self._sealed is not None else 'hot_tokens'} or read_buffer_bytes."
            )

    def _attach_tier(
        self, pool: BlockPool, layout: TierLayout, blocks: TierBlocks, resident_first: int, ids: SpilledIds
    ) -> None:
        """With the pool: the tier file, its read-ahead, and tiered block tables for the full-attention groups.

        Args:
            layout: the tier's segments per (block, position of a block). blocks: what can move, and how.
            resident_first: leading blocks of each row that never move. ids: how spilled entries are numbered.
        """
        heads = pool.layout.heads  # position j of a block is read on the device of the layers at j
        self.tier = DiskTier(layout, self.disk.path, self.disk.max_write_bytes)
        self.prefetcher = LayerPrefetcher(
            self.tier, self.disk.buffer_bytes, lambda position: pool.layer_device(heads[position])
        )
        tables: list[BlockTables] = [TieredBlockTables(pool, self.tier, ids, group) for group in pool.groups]
        self.tables, self._other_tables = tables[0], tables[1:]
        self._tier_blocks, self._resident_first = blocks, resident_first

    def _parts(self) -> tuple[Any, DiskTier, LayerPrefetcher]:
        assert self.pool is not None and self.tier is not None and self.prefetcher is not None
        return self.pool, self.tier, self.prefetcher

    @property
    def tiered_tables(self) -> list[TieredBlockTables]:
        """Every layer group's block tables (their blocks may spill)."""
        return [tables for tables in self.all_tables if isinstance(tables, TieredBlockTables)]

    def _spilled_layout(self, layer: int) -> SpilledLayout | None:
        """Where the batch's live blocks of `layer` live, on its device; None when none of them has spilled."""
        tables = self._tables_of(layer)
        assert self.pool is not None and isinstance(tables, TieredBlockTables)
        return tables.spilled_layout(self.pool.layer_device(layer))

    def _count_spilled(self, blocks: int) -> None:
        """Accounting hook: `blocks` distinct blocks were just written to the tier."""

    # ------------------------------------------------------------------ spilling

    def _spill_cold_blocks(self) -> None:
        """Write the blocks older than the hot window to disk once (not the tree's), then free them here."""
        pool, tier, _ = self._parts()
        keep_resident = self.disk.on_full == "keep_resident"
        private = disk_prefix.private_blocks(self._tier_blocks, disk_prefix.tree_held(self))
        for tables in self.tiered_tables:
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
            self._count_spilled(moved)
            if moved < cold:
                self.stop_reason = f"write budget: max_write_bytes={self.disk.max_write_bytes} reached"

    # ------------------------------------------------------------------ reading back

    def _take_spilled(self, layer: int, handles: list[int], outs: list[torch.Tensor]) -> None:
        """Read this layer's spilled blocks `handles` into `outs`, then start reading the next spilling layer's
        (the next layer whose group has spilled blocks: a sliding group may have none)."""
        prefetcher = self._parts()[2]
        try:
            prefetcher.take(self.layout.position[layer], handles, outs)
        except SpillCorrupted as err:
            raise self._located(err) from err
        for step in range(1, self.num_layers + 1):  # the next layer (cyclically: the next step's) that reads some
            following = (layer + step) % self.num_layers
            if self._tables_of(following) is self._tables_of(layer):  # one group's layers read the same blocks
                prefetcher.request(self.layout.position[following], handles)
                return
            if (spilled := self._spilled_layout(following)) is not None:
                prefetcher.request(self.layout.position[following], spilled.handles)
                return

    def _located(self, err: SpillCorrupted) -> SpillCorrupted:
        """The same error, naming the layer that reads the damaged segment and the tokens its block holds."""
        for tables in self.tiered_tables:
            tokens = tables.tokens_of(err.block)
            if tokens is not None:
                assert tables.group is not None
                layer = tables.group.layers[err.layer]  # the tier numbers a block's segments by position
                return SpillCorrupted(err.block, layer, err.path, err.offset, tokens)
        return err

    def _bring_back(self, first: int, stop: int | None = None) -> None:
        """The spilled blocks at block columns [first, stop) (default: `first` only) come back into memory."""
        pool, tier, prefetcher = self._parts()
        try:
            for tables in self.tiered_tables:
                bring_back(pool, tables, tier, first, self._tier_blocks, stop)
        except SpillCorrupted as err:
            raise self._located(err) from err
        prefetcher.clear()  # the freed disk slots' handles may come back for other blocks

    # ------------------------------------------------------------------ prefix sharing

    def match(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, pad_token_id: int = 0
    ) -> dict[str, torch.Tensor]:
        """As the base cache's `match`; the matched blocks stay in memory for as long as this cache holds them."""
        inputs = super().match(input_ids, attention_mask, pad_token_id)
        for tables in self.tiered_tables:
            disk_prefix.make_rows_tiered(tables)
        return inputs

    def publish(self, sequences: torch.Tensor, attention_mask: torch.Tensor | None = None) -> int:
        """As the base cache's `publish`, after bringing the spilled blocks it offers back into memory.

        If they cannot come back (`PoolExhausted`, a store that cannot grow, `SpillCorrupted`), that error is
        raised and nothing has changed: no block brought back, none published.
        """
        disk_prefix.bring_back_offered(self, sequences, attention_mask, self._bring_back)
        return super().publish(sequences, attention_mask)

    # ------------------------------------------------------------------ lifetime

    def reset(self) -> None:
        """Forget every token: blocks return to memory's free lists, disk slots to the spill file (which stays),
        and the read-ahead rows are freed (the next request's spill sizes them again)."""
        if self.prefetcher is not None:
            self.prefetcher.close()
        super().release()
        self.stop_reason = None

    def release(self) -> None:
        """Forget every token, stop the reader thread, delete the spill file (and a private directory)."""
        self.reset()
        if self.tier is not None:
            self.tier.close()

    def drop_page_cache(self) -> None:
        """Make the next reads of spilled blocks come from the device, not the OS page cache (benchmarks)."""
        if self.tier is not None:
            self.tier.drop_page_cache()
