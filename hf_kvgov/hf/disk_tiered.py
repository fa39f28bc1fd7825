"""What every cache with a disk tier does the same way, whatever its blocks hold.

`DiskOffloadCache` spills full-precision pool blocks and `QuantizedDiskCache` spills sealed codes; both
keep the same bookkeeping around the tier, which lives here once: the tier and its read-ahead, spilling
the blocks that left the hot window at the start of a step (never the ones a prefix tree holds),
bringing blocks back (a crop into a spilled block, a `publish`), naming the tokens of a damaged block,
and resetting or releasing the file.

A subclass says what differs when it attaches the tier (`_attach_tier`): its blocks' kind (which entries
the tier can take and how their bytes are read and written), how many leading blocks of a row never move
(the sink every query reads), and how spilled entries are numbered; and how it counts what it spilled
(`_count_spilled`).
"""

from __future__ import annotations

from typing import Any

import torch

from hf_kvgov.errors import SpillCorrupted, SpillSpaceExhausted
from hf_kvgov.hf import disk_prefix
from hf_kvgov.hf.paged_cache import PagedCache
from hf_kvgov.hf.quant_config import QuantConfig
from hf_kvgov.storage.pool import BlockPool, KVGeometry
from hf_kvgov.tiers.block_table import TieredBlockTables
from hf_kvgov.tiers.disk_tier import DiskTier, TierLayout
from hf_kvgov.tiers.kv_segments import SpilledIds
from hf_kvgov.tiers.moves import TierBlocks, bring_back, spill
from hf_kvgov.tiers.prefetch import LayerPrefetcher
from hf_kvgov.tiers.spill_config import DiskCacheConfig


class DiskTieredCache(PagedCache):
    """A `PagedCache` (or subclass) whose cold blocks live in a `DiskTier`; see the module docstring."""

    disk: DiskCacheConfig
    groups_layers = False  # the tier's tables cover every layer: a sliding layer's cold blocks still spill

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
        needed = blocks * geometry.bytes_per_token * block_size
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
        """With the pool: the tier file, its read-ahead and tiered block tables.

        Args:
            layout: the tier's segments per (block, layer). blocks: what can move, and how.
            resident_first: leading blocks of each row that never move. ids: how spilled entries are numbered.
        """
        self.tier = DiskTier(layout, self.disk.path, self.disk.max_write_bytes)
        self.prefetcher = LayerPrefetcher(self.tier, self.disk.buffer_bytes, pool.layer_device)
        self.tables = TieredBlockTables(pool, self.tier, ids)
        self._tier_blocks, self._resident_first = blocks, resident_first

    def _parts(self) -> tuple[Any, TieredBlockTables, DiskTier, LayerPrefetcher]:
        assert self.pool is not None and isinstance(self.tables, TieredBlockTables)
        assert self.tier is not None and self.prefetcher is not None
        return self.pool, self.tables, self.tier, self.prefetcher

    def _count_spilled(self, blocks: int) -> None:
        """Accounting hook: `blocks` distinct blocks were just written to the tier."""

    # ------------------------------------------------------------------ spilling

    def _spill_cold_blocks(self) -> None:
        """Write the blocks older than the hot window to disk once (not the tree's), then free them here."""
        pool, tables, tier, _ = self._parts()
        if self.stop_reason is not None or not tables.rows:
            return
        stop = (tables.num_tokens - self.disk.hot_tokens) // pool.block_size
        keep_resident = self.disk.on_full == "keep_resident"
        private = disk_prefix.private_blocks(self._tier_blocks, disk_prefix.tree_held(self))
        try:
            moved, cold = spill(pool, tables, tier, self._resident_first, stop, keep_resident, private)
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
        """Read this layer's spilled blocks `handles` into `outs`, then start reading the next layer's."""
        prefetcher = self._parts()[3]
        try:
            prefetcher.take(layer, handles, outs)
        except SpillCorrupted as err:
            raise self._located(err) from err
        prefetcher.request((layer + 1) % self.num_layers, handles)

    def _located(self, err: SpillCorrupted) -> SpillCorrupted:
        """The same error, naming the token positions the damaged block holds."""
        tokens = self._parts()[1].tokens_of(err.block)
        return err if tokens is None else SpillCorrupted(err.block, err.layer, err.path, err.offset, tokens)

    def _bring_back(self, first: int, stop: int | None = None) -> None:
        """The spilled blocks at block columns [first, stop) (default: `first` only) come back into memory."""
        pool, tables, tier, prefetcher = self._parts()
        try:
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
        disk_prefix.make_rows_tiered(self._parts()[1])
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
