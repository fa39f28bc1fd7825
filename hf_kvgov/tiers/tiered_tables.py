"""Block tables whose entries are pool ids or spilled blocks of a `DiskTier`.

An entry `b >= 0` is a pool block, as in `BlockTable`; `b < 0` is the spilled block with handle `-1 - b`. A
quantized pool, whose sealed blocks are negative already, names spilled blocks below -2**62 (`SpilledIds`).
References work the same in both tiers (forking takes one more on each block wherever it lives; truncating or
releasing drops them), so a spilled block shared by beams is one handle whose disk slot goes with the last
reference. A sliding group's tables are tiered too: a block that left the window is freed wherever it lives, and
with a hot window at least the sliding window nothing of a sliding layer is ever written. Only sealed blocks spill
and writes touch only the tail, so a write never lands on a spilled block (a crop brings a block back first).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from hf_kvgov.storage.block_table import BlockTable, BlockTables
from hf_kvgov.storage.layer_groups import LayerGroup
from hf_kvgov.storage.pool import BlockPool
from hf_kvgov.tiers.disk_tier import DiskTier
from hf_kvgov.tiers.kv_segments import RAW_SPILLED_IDS, SpilledIds, SpilledLayout


class TieredBlockTable(BlockTable):
    """One sequence's blocks, each in the pool (id >= 0) or on disk (id < 0, or as `ids` says)."""

    def __init__(
        self, pool: BlockPool, tier: DiskTier, block_ids: Sequence[int] = (), ids: SpilledIds = RAW_SPILLED_IDS
    ) -> None:
        super().__init__(pool, block_ids)
        self.tier = tier
        self.ids = ids

    def fork(self) -> TieredBlockTable:
        live = self.live_ids
        self.pool.incref([b for b in live if not self.ids.is_spilled(b)])
        self.tier.incref([self.ids.handle(b) for b in live if self.ids.is_spilled(b)])
        fork = TieredBlockTable(self.pool, self.tier, self.block_ids, self.ids)
        fork.freed = self.freed
        return fork

    def free_before(self, index: int) -> None:
        index = min(index, len(self.block_ids))
        if index > self.freed:
            dropped = self.block_ids[self.freed : index]
            self.freed = index
            self._drop(dropped)

    def write_plan(self, start: int, end: int, copied_away: dict[int, int]) -> tuple[list[int], int]:
        bs = self.pool.block_size
        touched = self.block_ids[start // bs : -(-end // bs)] if end > start else []
        assert not any(map(self.ids.is_spilled, touched)), "a write reached a spilled block; bring it back first"
        return super().write_plan(start, end, copied_away)

    def truncate(self, num_tokens: int) -> None:
        keep = -(-num_tokens // self.pool.block_size)
        dropped = self.block_ids[max(keep, self.freed) :]
        del self.block_ids[keep:]
        self.freed = min(self.freed, keep)
        self._drop(dropped)

    def release(self) -> None:
        dropped, self.block_ids, self.freed = self.live_ids, [], 0
        self._drop(dropped)

    def _drop(self, block_ids: Iterable[int]) -> None:
        entries = list(block_ids)
        self.pool.decref([b for b in entries if not self.ids.is_spilled(b)])
        self.tier.decref([self.ids.handle(b) for b in entries if self.ids.is_spilled(b)])


class TieredBlockTables(BlockTables):
    """`BlockTables` of `TieredBlockTable` rows, plus the two moves between tiers.

    `group`: the layer group reading these tables (None: every layer of a pool without groups). The moves and
    layouts cover the live blocks only (from `first_block`: a sliding group freed those before).
    """

    def __init__(
        self, pool: BlockPool, tier: DiskTier, ids: SpilledIds = RAW_SPILLED_IDS, group: LayerGroup | None = None
    ) -> None:
        super().__init__(pool, group)
        self.tier = tier
        self.ids = ids
        # Per device: the table tensor a layout was computed from, and the layout (None: nothing spilled).
        self._layouts: dict[torch.device, tuple[torch.Tensor, SpilledLayout | None]] = {}

    def slots_for(self, batch: int, start: int, count: int) -> torch.Tensor:
        if not self.rows:
            self.rows = [TieredBlockTable(self.pool, self.tier, ids=self.ids) for _ in range(batch)]
            self.invalidate_views()
        return super().slots_for(batch, start, count)

    def references(self, first: int, stop: int, spilled: bool) -> dict[int, int]:
        """Entries of block indices [first, stop) of every row (pool ids, or spilled ones) -> references.

        In order of first appearance (row 0's blocks first), so older blocks come first.
        """
        counts: dict[int, int] = {}
        for row in self.rows:
            for block in row.block_ids[max(first, row.freed) : stop]:
                if self.ids.is_spilled(block) == spilled:
                    counts[block] = counts.get(block, 0) + 1
        return counts

    def replace(self, mapping: dict[int, int]) -> None:
        """Swap live entries in every row (a block moved between tiers); references are the caller's business."""
        for row in self.rows:
            row.block_ids[row.freed :] = [mapping.get(b, b) for b in row.live_ids]
        self.invalidate_views()

    def has_spilled(self) -> bool:
        return any(self.ids.is_spilled(b) for row in self.rows for b in row.live_ids)

    def spilled_layout(self, device: torch.device) -> SpilledLayout | None:
        """Where the batch's live blocks live (the table from `first_block`, as `live_tensor`), with tensors on
        `device`; None when nothing has spilled.

        Cached per device until the tables change, so layers split over devices each index on their own.
        """
        table = self.tensor(device)  # the same object until the tables (or `first_block`) change
        cached = self._layouts.get(device)
        if cached is None or cached[0] is not table:
            live = table[:, self.first_block :]
            cached = (table, SpilledLayout.of(live, self.ids) if self.has_spilled() else None)
            self._layouts[device] = cached
        return cached[1]

    def tokens_of(self, handle: int) -> tuple[int, int] | None:
        """Token positions [start, stop) of spilled block `handle` in the first row holding it (None: no row)."""
        entry, block_size = self.ids.entry(handle), self.pool.block_size
        for row in self.rows:
            if entry in row.live_ids:
                index = row.freed + row.live_ids.index(entry)
                return index * block_size, (index + 1) * block_size
        return None
