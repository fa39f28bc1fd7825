"""Tree entries over a pool with layer groups: one entry per block position, one pool block per group.

A pool with layer groups (`hf_kvgov.storage.layer_groups`) stores a block position in one pool block per group;
the radix tree caches one id per position, so `PrefixCache` gives it entry ids and `GroupedBlocks` maps them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from hf_kvgov.storage.layer_groups import LayerGroup

Blocks = list[int | None]  # one pool block per layer group (None: a sliding group's block the entry lacks)


class GroupedBlocks:
    """Entry id -> its pool blocks per layer group, and each pool block -> its entry.

    ::

        tokens:   [ block 0 ][ block 1 ] ... [ block 40 ][ block 41 ]  ...
        entry:        e0         e1              e40        e41
        full:         f0         f1              f40        f41          every block, once published
        sliding:      -          -               s40        s41          only while the tree keeps them

    A hit needs every full-attention block before it, and a sliding block only if its window covers it. An entry
    lacks a full block until its request publishes it (`hf_kvgov.engine.prefix_groups`), a sliding block once its
    request freed it or the tree let it go (`trim`); `servable` says whether every group can serve a hit. Each pool
    block is in at most one entry, and the tree holds one pool reference on each.
    """

    def __init__(self, groups: Sequence[LayerGroup], block_size: int) -> None:
        self.groups = tuple(groups)
        self.block_size = block_size
        self._blocks: dict[int, Blocks] = {}
        self._entry_of: dict[int, int] = {}
        self._next = 0
        # Entries with a sliding block, least recently used first: the order `trim` lets them go in.
        self._trimmable: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def pool_blocks(self) -> int:
        """Pool blocks the entries hold (one tree reference each)."""
        return len(self._entry_of)

    def blocks(self, entry: int) -> Blocks:
        return list(self._blocks[entry])

    def has_full(self, entry: int) -> bool:
        """Whether the entry holds every full-attention group's block (a hit through it needs them all)."""
        slots = self._blocks[entry]
        return all(block is not None for group, block in zip(self.groups, slots, strict=True) if group.window is None)

    def entry_of(self, blocks: Blocks) -> int | None:
        """The entry holding any of `blocks` (one position's), or None when none is cached."""
        return next((self._entry_of[b] for b in blocks if b is not None and b in self._entry_of), None)

    def new_entry(self) -> int:
        """A fresh entry id, not registered until `add`."""
        self._next += 1
        return self._next - 1

    def add(self, entry: int, blocks: Blocks) -> list[int]:
        """Register `entry` with `blocks`; returns the pool blocks the tree now holds a reference on."""
        self._blocks[entry] = [None] * len(self.groups)
        return [block for group, block in enumerate(blocks) if block is not None and self.fill(entry, group, block)]

    def fill(self, entry: int, group: int, block: int) -> bool:
        """Put `block` in the entry's slot for `group` if it is empty; True when it was taken."""
        slots = self._blocks[entry]
        if slots[group] is not None or block in self._entry_of:
            return False
        slots[group] = block
        self._entry_of[block] = entry
        if self.groups[group].window is not None:
            self._trimmable[entry] = None
        return True

    def remove(self, entry: int) -> list[int]:
        """Forget an evicted entry; returns its pool blocks (the tree's references to give back)."""
        blocks = [block for block in self._blocks.pop(entry) if block is not None]
        for block in blocks:
            del self._entry_of[block]
        self._trimmable.pop(entry, None)
        return blocks

    def touch(self, entries: Sequence[int]) -> None:
        """A hit or publish used these entries: their sliding blocks are the last to be trimmed."""
        for entry in entries:
            if entry in self._trimmable:
                self._trimmable.move_to_end(entry)

    def trim(self, wanted: int, only_tree_holds: Callable[[int], bool]) -> list[int]:
        """Let go of up to `wanted` sliding blocks no sequence uses (`only_tree_holds(block)`), least recently
        used entries first; returns them (the tree's references to give back). Full-attention blocks stay."""
        dropped: list[int] = []
        for entry in list(self._trimmable):
            if len(dropped) >= wanted:
                break
            slots = self._blocks[entry]
            for group, block in enumerate(slots):
                if block is not None and self.groups[group].window is not None and only_tree_holds(block):
                    slots[group] = None
                    del self._entry_of[block]
                    dropped.append(block)
            if not any(b is not None and self.groups[g].window is not None for g, b in enumerate(slots)):
                del self._trimmable[entry]
        return dropped

    def servable(self, entries: Sequence[int]) -> int:
        """How many leading `entries` (a path from the root) a hit may use: the most, `p`, for which every group
        has its blocks from the one holding the first token a query at `p * block_size` sees (block 0 for a
        full-attention group)."""
        for hit in range(len(entries), 0, -1):
            start = hit * self.block_size
            if all(
                self._blocks[entries[i]][g] is not None
                for g, group in enumerate(self.groups)
                for i in range(group.first_kept(start, self.block_size) // self.block_size, hit)
            ):
                return hit
        return 0

    def check(self, cached: Callable[[int], bool], tree_blocks: int, ref_count: Callable[[int], int]) -> None:
        """Raise an `AssertionError` unless the entries are the tree's `tree_blocks` cached blocks (`cached`) and
        hold, in their group slots, pool blocks that are in no other entry and hold a reference (`ref_count`)."""
        assert len(self._blocks) == tree_blocks, f"{len(self._blocks)} entries for {tree_blocks} cached blocks"
        owners: dict[int, int] = {}
        for entry, slots in self._blocks.items():
            assert cached(entry), f"entry {entry} is not in the tree"
            for block in slots:
                if block is not None:
                    assert block not in owners, f"pool block {block} is in entries {owners.get(block)} and {entry}"
                    owners[block] = entry
                    assert ref_count(block) >= 1, f"pool block {block} of entry {entry} has no reference"
        assert owners == self._entry_of, "the block -> entry index differs from the entries"
        for entry in self._trimmable:
            assert entry in self._blocks, f"trimmable entry {entry} is not an entry"
