"""Tree ids for pool block-table entries: the radix tree keys blocks by non-negative ids, and a pool's sealed
blocks are negative entries, so sealed entry e < 0 is tree id ``SEALED_BASE - 1 - e``."""

from __future__ import annotations

# Tree ids at and above this stand for sealed blocks: sealed entry e < 0 is tree id SEALED_BASE - 1 - e.
# No pool reaches 2**62 full-precision blocks, so the two ranges never meet.
SEALED_BASE = 1 << 62


def tree_id(block_id: int) -> int:
    """The tree's (non-negative) id for a pool block-table entry, sealed (< 0) or not."""
    return SEALED_BASE - 1 - block_id if block_id < 0 else block_id


def pool_id(tree_block_id: int) -> int:
    """The pool's block-table entry for a tree id (inverse of `tree_id`)."""
    return SEALED_BASE - 1 - tree_block_id if tree_block_id >= SEALED_BASE else tree_block_id
