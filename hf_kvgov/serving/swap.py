"""Preemption by swap: a preempted request's blocks go to the disk tier and come back, instead of being computed again.

`ServingEngine(spill=Disk(path))` gives the scheduler a `SwapSpace`. A victim's blocks are written once (full-precision
blocks as raw K/V, sealed ones as their codes, each to a checksummed tier file of its kind) and freed; when it is
admitted again they are read back into fresh blocks, verified, and its decoding goes on where it stopped. Swapping is
a saving, never a risk: a disk that refuses the write (full, over its write budget, gone) or a damaged block on the
way back leaves the request to be computed again from its tokens, as without a tier, and the fallback is counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from hf_kvgov.errors import PoolExhausted, SpillCorrupted, SpillFileLost, SpillSpaceExhausted
from hf_kvgov.storage.block_table import SequenceTables
from hf_kvgov.storage.pool import BlockPool
from hf_kvgov.storage.quantized_pool import QuantizedBlockPool, is_sealed
from hf_kvgov.tiers.disk_tier import DiskTier, TierLayout
from hf_kvgov.tiers.kv_segments import raw_part_bytes
from hf_kvgov.tiers.moves import TierBlocks, raw_blocks
from hf_kvgov.tiers.sealed_segments import sealed_blocks, sealed_tier_layout
from hf_kvgov.tiers.spill_config import Disk


@dataclass(frozen=True)
class Swapped:
    """Where a swapped-out request's blocks are: per kind (sealed or not), their places among its live blocks
    (`SequenceTables.live_ids`) and their tier handles; `shape` rebuilds its tables around them."""

    columns: int  # live blocks swapped
    parts: dict[bool, tuple[list[int], list[int]]]
    shape: tuple[tuple[int, int, int], ...]


@dataclass
class SwapCounters:
    blocks_out: int = 0  # blocks written by preemptions
    blocks_in: int = 0  # blocks read back
    fallbacks: int = 0  # preemptions computed again instead: the disk refused, or a block came back damaged


class _Kind:
    """One kind of block (full precision or sealed) with the tier file it swaps to."""

    def __init__(self, tier: DiskTier, blocks: TierBlocks) -> None:
        self.tier, self.blocks = tier, blocks


class SwapSpace:
    """The disk tier a serving engine swaps preempted requests to (see the module docstring)."""

    def __init__(self, pool: BlockPool, disk: Disk) -> None:
        self.pool = pool
        extent = disk.extent_blocks
        raw_layout = TierLayout(pool.layers_per_block, raw_part_bytes(pool.geometry, pool.block_size), extent)
        self._kinds = {False: _Kind(DiskTier(raw_layout, disk.path, disk.max_write_bytes), raw_blocks(pool))}
        if isinstance(pool, QuantizedBlockPool):
            sealed_tier = DiskTier(sealed_tier_layout(pool, extent), disk.path, disk.max_write_bytes)
            self._kinds[True] = _Kind(sealed_tier, sealed_blocks(pool))
        self.counters = SwapCounters()

    def swap_out(self, tables: SequenceTables) -> Swapped | None:
        """Write the blocks of one request's tables; None when the disk refuses (nothing is left written). The caller
        then drops its references."""
        block_ids = tables.live_ids()
        columns: dict[bool, list[int]] = {}
        for column, block in enumerate(block_ids):
            columns.setdefault(is_sealed(block), []).append(column)
        written: dict[bool, tuple[list[int], list[int]]] = {}
        try:
            for sealed, where in columns.items():
                kind = self._kinds[sealed]
                ids = [block_ids[c] for c in where]
                written[sealed] = (where, kind.tier.put(len(ids), [1] * len(ids), kind.blocks.segments(ids)))
        except (SpillSpaceExhausted, SpillFileLost):
            self.discard(Swapped(len(block_ids), written, tables.shape()))
            self.counters.fallbacks += 1
            return None
        self.counters.blocks_out += len(block_ids)
        return Swapped(len(block_ids), written, tables.shape())

    def swap_in(self, swapped: Swapped) -> SequenceTables | None:
        """Tables over fresh blocks (one reference each) holding what was swapped out; None when they do not fit now
        (nothing allocated, the disk copies kept). Raises `SpillCorrupted` for a damaged block (nothing held)."""
        block_ids = [0] * swapped.columns
        restored: list[int] = []
        try:
            for sealed, (columns, handles) in swapped.parts.items():
                kind = self._kinds[sealed]
                fresh = kind.blocks.restore(kind.tier, handles)
                restored += fresh
                for column, block in zip(columns, fresh, strict=True):
                    block_ids[column] = block
        except (PoolExhausted, SpillCorrupted) as err:
            self.pool.decref(restored)
            if isinstance(err, PoolExhausted):
                return None
            self.counters.fallbacks += 1
            raise
        return SequenceTables.from_live(self.pool, swapped.shape, block_ids)

    def returned(self, swapped: Swapped) -> None:
        """The request is running again on the blocks `swap_in` gave: free the disk copies, count the blocks."""
        self.discard(swapped)
        self.counters.blocks_in += swapped.columns

    def discard(self, swapped: Swapped) -> None:
        """Free the disk copies (the request ended while swapped out, or a block came back damaged)."""
        for sealed, (_, handles) in swapped.parts.items():
            if handles:
                self._kinds[sealed].tier.decref(handles)

    def locations(self, swapped: Swapped) -> list[tuple[str, int]]:
        """(file, byte offset) of the first layer of each swapped block, for tools that inspect the files."""
        return [
            self._kinds[sealed].tier.location(handle, 0)
            for sealed, (_, handles) in swapped.parts.items()
            for handle in handles
        ]

    def close(self) -> None:
        for kind in self._kinds.values():
            kind.tier.close()
