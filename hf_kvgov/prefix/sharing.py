"""`PrefixCache`: the radix tree bound to a block pool, so requests share the KV of common prefixes.

Reference counts, who holds what::

    pool ref count of a block = (1 if the tree caches it) + (number of block tables holding it)
    tree lock count of a block = number of caches that matched or published it and are not released

The tree's own reference keeps a cached block alive after every sequence using it has finished; the
pool's reclaimer hook evicts unlocked leaves (LRU) when an allocation would otherwise fail, and only
then is a cached block's memory reused.

Sealed blocks (a `QuantizedBlockPool`'s negative ids) are cached like any other. The tree takes ids
>= 0 only, so this class folds the sealed ones above every id a pool can hand out (`tree_id` /
`pool_id`); callers only ever see pool ids. A sealed block is not what the pool's allocator hands out,
and in a quantized path it sits above its full-precision sink (the leaves are sealed, the first block
is not): the reclaimer therefore keeps evicting, sealed leaves included, until the allocator has the
full-precision blocks it asked for, or nothing is left to evict.

Locking: the tree and the pool each have one lock, and they are only ever nested in the order
pool -> tree: the pool calls the reclaimer with its lock held, and the reclaimer takes the tree's lock.
Every other path takes the tree's lock, releases it, and only then takes the pool's. Blocks found by
`match` are locked in the tree atomically with the lookup, so no other thread can evict them before
the caller's pool reference is taken. Several threads (a web server with a worker per request) can
therefore share one `PrefixCache` and one pool; a sequence's own cache is used by one thread at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hf_kvgov.prefix.radix_tree import RadixTree
from hf_kvgov.prefix.results import PrefixCacheStats
from hf_kvgov.storage.pool import BlockPool

# Tree ids at and above this stand for sealed blocks: sealed entry e < 0 is tree id SEALED_BASE - 1 - e.
# No pool reaches 2**62 full-precision blocks, so the two ranges never meet.
SEALED_BASE = 1 << 62


def tree_id(block_id: int) -> int:
    """The tree's (non-negative) id for a pool block-table entry, sealed (< 0) or not."""
    return SEALED_BASE - 1 - block_id if block_id < 0 else block_id


def pool_id(tree_block_id: int) -> int:
    """The pool's block-table entry for a tree id (inverse of `tree_id`)."""
    return SEALED_BASE - 1 - tree_block_id if tree_block_id >= SEALED_BASE else tree_block_id


def _tree_ids(block_ids: Sequence[int]) -> list[int]:
    return [tree_id(int(b)) for b in block_ids]


def _pool_ids(tree_block_ids: Sequence[int]) -> list[int]:
    return [pool_id(b) for b in tree_block_ids]


@dataclass(frozen=True)
class SharingStats:
    """Prefix-sharing counters: the tree's, plus how much memory sharing saves right now."""

    tree: PrefixCacheStats
    hit_tokens: int
    lookup_tokens: int
    hit_rate: float
    cached_blocks: int
    shared_blocks: int  # cached blocks that at least one live sequence is using
    evictions: int


class PrefixCache:
    """A radix tree over full token blocks whose ids live in `pool`.

    Args:
        pool: the block pool whose blocks are shared; its block size is the tree's.
        priority: eviction priority of unreferenced blocks ("lru" or "lfu"; see `hf_kvgov.prefix`).
    """

    def __init__(self, pool: BlockPool, priority: str = "lru") -> None:
        self.pool = pool
        self.tree = RadixTree(pool.block_size, priority=priority)
        pool.add_reclaimer(self._reclaim)

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    def match(self, token_ids: Sequence[int], namespace: str = "", max_tokens: int | None = None) -> list[int]:
        """Longest cached prefix of `token_ids` in whole blocks, as block ids the caller now holds.

        The caller gets one pool reference per block (for its block table) and one tree lock per block;
        it must give both back: `pool.decref` through its table, and `unlock` when it is done.
        """
        found = self.tree.match(token_ids, namespace, max_tokens=max_tokens, lock=True)
        ids = _pool_ids(found.block_ids)
        self.pool.incref(ids)
        return ids

    def publish(
        self, token_ids: Sequence[int], block_ids: list[int], namespace: str = ""
    ) -> tuple[list[int], list[int]]:
        """Offer a sequence's full blocks to the tree; returns (its new block ids, ids it must unlock later).

        `block_ids` holds one id per full block of `token_ids` (the caller's table, which keeps its
        references). A block identical to one already cached is replaced by the cached one in the
        returned list: the caller swaps its table entry, so the same KV is stored once.
        """
        full = len(token_ids) // self.block_size
        offered = _tree_ids(block_ids[:full])
        result = self.tree.insert(list(token_ids[: full * self.block_size]), offered, namespace, lock=True)
        self.pool.incref(_pool_ids(result.adopted))  # the tree's own reference
        swapped = list(block_ids)
        for caller_id, cached_id in result.duplicates:
            index = offered.index(caller_id)
            self.pool.incref([pool_id(cached_id)])
            self.pool.decref([pool_id(caller_id)])
            swapped[index] = pool_id(cached_id)
        return swapped, _pool_ids(result.block_ids)

    def unlock(self, block_ids: Sequence[int]) -> None:
        if block_ids:
            self.tree.unlock(_tree_ids(block_ids))

    def _evict(self, wanted: int) -> int:
        """Evict up to `wanted` unlocked cached blocks (LRU leaves first), give their references back."""
        evicted = _pool_ids(self.tree.evict(wanted))
        self.pool.decref(evicted)
        return len(evicted)

    def _reclaim(self, wanted: int) -> int:
        """Pool hook: evict until `wanted` more of the pool's allocatable blocks are free; returns how many are.

        Runs with the pool's lock held (see the module docstring), so `num_used` cannot move under it. An
        evicted block may free nothing the allocator hands out (a sealed block, or one a sequence still
        holds), hence the loop rather than one `evict(wanted)`.
        """
        used = self.pool.num_used
        while used - self.pool.num_used < wanted:
            if not self._evict(wanted - (used - self.pool.num_used)):
                break
        return used - self.pool.num_used

    def clear(self) -> int:
        """Evict every unlocked cached block; returns how many were evicted."""
        return self._evict(len(self.tree))

    def close(self) -> None:
        """Detach from the pool (cached blocks stay allocated until `clear`)."""
        self.pool.remove_reclaimer(self._reclaim)

    def stats(self) -> SharingStats:
        tree = self.tree.stats()
        return SharingStats(
            tree=tree,
            hit_tokens=tree.hit_tokens,
            lookup_tokens=tree.lookup_tokens,
            hit_rate=tree.hit_rate,
            cached_blocks=tree.cached_blocks,
            shared_blocks=tree.locked_blocks,
            evictions=tree.evicted_blocks,
        )
