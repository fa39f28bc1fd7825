"""`PrefixCache`: the radix tree bound to a block pool, so requests share the KV of common prefixes.

The tree's reference keeps a block alive after its sequences finish; the pool's reclaimer evicts unlocked leaves
(LRU) only when an allocation would fail. With layer groups an entry stands for a block per group
(`hf_kvgov.prefix.grouped_blocks`). A remote tier shares prefixes across processes (`hf_kvgov.prefix.remote_fill`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hf_kvgov.prefix import remote_fill, remote_groups
from hf_kvgov.prefix.grouped_blocks import Blocks, GroupedBlocks
from hf_kvgov.prefix.radix_tree import RadixTree
from hf_kvgov.prefix.remote_tier import RemoteTier
from hf_kvgov.prefix.results import PrefixCacheStats
from hf_kvgov.prefix.tree_ids import pool_id, tree_id
from hf_kvgov.stats_repr import rounded_repr
from hf_kvgov.storage.pool import BlockPool
from hf_kvgov.tiers.remote_stats import RemoteStats


def _tree_ids(block_ids: Sequence[int]) -> list[int]:
    return [tree_id(int(b)) for b in block_ids]


def _pool_ids(tree_block_ids: Sequence[int]) -> list[int]:
    return [pool_id(b) for b in tree_block_ids]


@dataclass(frozen=True)
class SharingStats:
    """Prefix-sharing counters: the tree's, plus how much memory sharing saves right now."""

    __repr__ = rounded_repr

    tree: PrefixCacheStats
    hit_tokens: int  # prompt tokens served from the tree, or from the remote tier past the tree's hit
    lookup_tokens: int
    hit_rate: float  # hit_tokens / lookup_tokens: the share of prompt tokens whose KV was not computed here
    cached_blocks: int
    shared_blocks: int  # cached blocks that at least one live sequence is using
    evictions: int
    pool_blocks: int = 0  # pool blocks the tree holds (cached_blocks, or more with layer groups: one per group)
    remote: RemoteStats | None = None  # the remote tier's counters, when there is one


class PrefixCache:
    """A radix tree over full token blocks whose ids live in `pool`.

    ::

        pool ref count of a block = (1 if the tree caches it) + (number of block tables holding it)
        tree lock count of a block = number of caches that matched or published it and are not released

    The tree takes ids >= 0 only, so sealed (negative) ids are folded above every pool id (`tree_id`); a sealed
    leaf frees no full-precision block, so the reclaimer evicts until the allocator has what it asked for. Locks
    nest only pool -> tree (the reclaimer runs under the pool's lock, as do group updates around their tree call)
    and `match` locks what it finds with the lookup, so threads can share one `PrefixCache` and pool.

    Args:
        pool: the block pool whose blocks are shared; its block size is the tree's.
        priority: eviction priority of unreferenced blocks ("lru" or "lfu"; see `hf_kvgov.prefix`).
        remote: a tier shared with other processes (`hf_kvgov.tiers.redis_tier.RedisTier`), or None.
    """

    def __init__(self, pool: BlockPool, priority: str = "lru", remote: RemoteTier | None = None) -> None:
        grouped = len(pool.groups) > 1 or pool.groups[0].window is not None
        if remote is not None:
            remote.bind(pool)
        self.pool = pool
        self.remote = remote
        self.tree = RadixTree(pool.block_size, priority=priority)
        # With layer groups the tree's ids are entries, one per block position (None: the tree's ids are pool ids).
        self.grouped = GroupedBlocks(pool.groups, pool.block_size) if grouped else None
        self._remote_hit_blocks = 0  # block positions the remote tier served past a local hit (under the pool lock)
        pool.add_reclaimer(self._reclaim)

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    def match(self, token_ids: Sequence[int], namespace: str = "", max_tokens: int | None = None) -> list[int]:
        """Longest cached prefix of `token_ids` in whole blocks, as block ids the caller now holds.

        The caller gets one pool reference per block (for its block table) and one tree lock per block;
        it must give both back: `pool.decref` through its table, and `unlock` when it is done.
        """
        self._require_groups(False, "match", "match_groups")
        found = self.tree.match(token_ids, namespace, max_tokens=max_tokens, lock=True)
        ids = _pool_ids(found.block_ids)
        self.pool.incref(ids)
        if self.remote is not None:
            usable = len(token_ids) if max_tokens is None else min(len(token_ids), max_tokens)
            local = len(ids)
            ids = remote_fill.extend(self, self.remote, list(token_ids), namespace, ids, usable // self.block_size)
            self._count_remote_hit(len(ids) - local)
        return ids

    def match_groups(
        self, token_ids: Sequence[int], namespace: str = "", max_tokens: int | None = None
    ) -> tuple[list[int], list[Blocks]]:
        """`match` over a pool with layer groups: the longest cached prefix every group can serve.

        Returns (the entries the caller must `unlock`, and per layer group the pool blocks of the hit, one per
        block position): a full-attention group gets every block, a sliding group those from the one holding
        the first token the next query sees (None before it). The caller holds one pool reference on each.
        """
        grouped = self._require_groups(True, "match_groups", "match")
        with self.pool.lock:  # see the class docstring
            found = self.tree.match(token_ids, namespace, max_tokens=max_tokens, lock=True, servable=grouped.servable)
            entries = list(found.block_ids)
            tables = self.hit_tables(grouped, entries)
            self.pool.incref([block for table in tables for block in table if block is not None])
            grouped.touch(entries)
        if self.remote is not None:
            usable = len(token_ids) if max_tokens is None else min(len(token_ids), max_tokens)
            extended = remote_groups.extend(
                self, self.remote, list(token_ids), namespace, (entries, tables), usable // self.block_size
            )
            self._count_remote_hit(len(extended[0]) - len(entries))
            return extended
        return entries, tables

    def _count_remote_hit(self, blocks: int) -> None:
        with self.pool.lock:
            self._remote_hit_blocks += blocks

    def match_tables(
        self, token_ids: Sequence[int], namespace: str = "", max_tokens: int | None = None
    ) -> tuple[list[int], list[Blocks]]:
        """`match_groups` over any pool (one group without layer groups): (ids to `unlock`, per group the hit)."""
        if self.grouped is not None:
            return self.match_groups(token_ids, namespace, max_tokens)
        ids = self.match(token_ids, namespace, max_tokens)
        return ids, [list(ids)]

    def publish_tables(
        self, token_ids: Sequence[int], tables: list[Blocks], namespace: str = ""
    ) -> tuple[list[Blocks], list[int]]:
        """`publish_groups` over any pool (one group, without None, without layer groups)."""
        if self.grouped is not None:
            return self.publish_groups(token_ids, tables, namespace)
        swapped, locks = self.publish(token_ids, [int(block) for block in tables[0]], namespace)  # type: ignore[arg-type]
        return [list(swapped)], locks

    def hit_tables(self, grouped: GroupedBlocks, entries: Sequence[int]) -> list[Blocks]:
        """Per layer group, the pool blocks a hit on `entries` uses (None before a sliding group's window)."""
        start, size = len(entries) * self.block_size, self.block_size
        tables: list[Blocks] = []
        for g, group in enumerate(self.pool.groups):
            first = group.first_kept(start, size) // size
            tables.append([grouped.blocks(e)[g] if i >= first else None for i, e in enumerate(entries)])
        return tables

    def publish_groups(
        self, token_ids: Sequence[int], tables: list[Blocks], namespace: str = ""
    ) -> tuple[list[Blocks], list[int]]:
        """`publish` over a pool with layer groups; returns (the tables with cached blocks swapped in, the entries
        the caller must unlock later).

        `tables[g][i]` is group g's block at position i (None: a sliding block the caller freed), for every full
        block of `token_ids`. A position already cached keeps its blocks and the caller's copies are swapped
        for them; a sliding block the cached entry lacks is taken from the caller.
        """
        grouped = self._require_groups(True, "publish_groups", "publish")
        with self.pool.lock:  # see the class docstring
            return self._publish_groups(grouped, token_ids, tables, namespace)

    def _publish_groups(
        self, grouped: GroupedBlocks, token_ids: Sequence[int], tables: list[Blocks], namespace: str
    ) -> tuple[list[Blocks], list[int]]:
        full = len(token_ids) // self.block_size
        positions = [[table[i] for table in tables] for i in range(full)]
        offered, fresh = [], {}
        for i, blocks in enumerate(positions):
            entry = grouped.entry_of(blocks)
            if entry is None:
                entry = grouped.new_entry()
                fresh[entry] = i
            offered.append(entry)
        result = self.tree.insert(list(token_ids[: full * self.block_size]), offered, namespace, lock=True)
        changed = {fresh[entry] for entry in result.adopted}  # positions whose entry is new or gained blocks
        for entry in result.adopted:
            self.pool.incref(grouped.add(entry, positions[fresh[entry]]))  # the tree's own references
        swapped = [list(table) for table in tables]
        for i, entry in enumerate(result.block_ids):
            for g, (mine, cached) in enumerate(zip(positions[i], grouped.blocks(entry), strict=True)):
                if mine is None or mine == cached:
                    continue
                if cached is None:
                    if grouped.fill(entry, g, mine):
                        self.pool.incref([mine])
                        changed.add(i)
                    continue
                self.pool.incref([cached])
                self.pool.decref([mine])
                swapped[g][i] = cached
        # The store gets an entry once it has its full-attention blocks (before, it serves no hit anywhere).
        changed = {i for i in changed if grouped.has_full(result.block_ids[i])}
        if self.remote is not None and changed:
            tokens = token_ids[: full * self.block_size]
            entries = list(result.block_ids)
            remote_groups.write_positions(self.pool, grouped, self.remote, tokens, namespace, entries, sorted(changed))
        grouped.touch(result.block_ids)
        return swapped, list(result.block_ids)

    def pool_blocks_of(self, tree_ids: Sequence[int]) -> frozenset[int]:
        """The pool blocks the tree ids a cache locked stand for (entries' blocks with layer groups)."""
        if self.grouped is None:
            return frozenset(tree_ids)
        return frozenset(b for e in tree_ids for b in self.grouped.blocks(e) if b is not None)

    def _require_groups(self, grouped: bool, action: str, other: str) -> GroupedBlocks:
        if (self.grouped is not None) != grouped:
            kind = "has" if self.grouped is not None else "has no"
            raise ValueError(f"{action}() does not apply: the tree's pool {kind} layer groups; use {other}().")
        return self.grouped  # type: ignore[return-value]

    def publish(
        self, token_ids: Sequence[int], block_ids: list[int], namespace: str = ""
    ) -> tuple[list[int], list[int]]:
        """Offer a sequence's full blocks to the tree; returns (its new block ids, ids it must unlock later).

        `block_ids` holds one id per full block of `token_ids` (the caller's table, which keeps its
        references). A block identical to one already cached is replaced by the cached one in the
        returned list: the caller swaps its table entry, so the same KV is stored once.
        """
        self._require_groups(False, "publish", "publish_groups")
        full = len(token_ids) // self.block_size
        offered = _tree_ids(block_ids[:full])
        result = self.tree.insert(list(token_ids[: full * self.block_size]), offered, namespace, lock=True)
        self.pool.incref(_pool_ids(result.adopted))  # the tree's own reference
        if self.remote is not None:
            remote_fill.write_new(self.pool, self.remote, token_ids, namespace, _pool_ids(result.adopted))
        swapped = list(block_ids)
        for caller_id, cached_id in result.duplicates:
            index = offered.index(caller_id)
            self.pool.incref([pool_id(cached_id)])
            self.pool.decref([pool_id(caller_id)])
            swapped[index] = pool_id(cached_id)
        return swapped, _pool_ids(result.block_ids)

    def lock(self, block_ids: Sequence[int]) -> None:
        """Lock cached blocks once more (a copy of a cache that matched them holds them too), as `match` does."""
        if block_ids:
            self.tree.lock(_tree_ids(block_ids))

    def unlock(self, block_ids: Sequence[int]) -> None:
        if block_ids:
            self.tree.unlock(_tree_ids(block_ids))

    def _evict(self, wanted: int) -> int:
        """Evict up to `wanted` unlocked cached blocks (LRU leaves first), give their references back."""
        evicted = self.tree.evict(wanted)
        if self.grouped is None:
            self.pool.decref(_pool_ids(evicted))
        else:
            self.pool.decref([block for entry in evicted for block in self.grouped.remove(entry)])
        return len(evicted)

    def _reclaim(self, wanted: int) -> int:
        """Pool hook: evict until `wanted` more of the pool's allocatable blocks are free; returns how many are.

        Runs with the pool's lock held (see the class docstring), so `num_used` cannot move under it. An
        evicted block may free nothing the allocator hands out (a sealed block, or one a sequence still
        holds), hence the loop rather than one `evict(wanted)`.
        """
        used = self.pool.num_used
        if self.grouped is not None:  # sliding blocks no sequence uses go first: they serve the fewest hits
            self.pool.decref(self.grouped.trim(wanted, lambda block: self.pool.ref_count(block) == 1))
        while used - self.pool.num_used < wanted:
            if not self._evict(wanted - (used - self.pool.num_used)):
                break
        return used - self.pool.num_used

    def clear(self) -> int:
        """Evict every unlocked cached block; returns how many were evicted."""
        with self.pool.lock:
            return self._evict(len(self.tree))

    def reclaimable_blocks(self, held: Iterable[int] = ()) -> int:
        """Blocks evicting unlocked entries could free now, less the cached ones among `held` (pool blocks sequences
        still read without a lock: evicting them frees nothing). An upper bound with layer groups (entries)."""
        with self.pool.lock:
            cached = sum(1 for block in set(held) if tree_id(block) in self.tree) if self.grouped is None else 0
            return max(0, self.tree.evictable_blocks() - cached)

    def check_invariants(self) -> None:
        """Raise an `AssertionError` unless the tree's books balance (and, with layer groups, the entries': each
        entry is a cached block of the tree, each pool block in one entry, with a live pool reference)."""
        self.tree.check_invariants()
        if self.grouped is None:
            return
        with self.pool.lock:
            self.grouped.check(lambda entry: entry in self.tree, len(self.tree), self.pool.ref_count)

    def close(self) -> None:
        """Detach from the pool (cached blocks stay allocated until `clear`); close the remote tier."""
        self.pool.remove_reclaimer(self._reclaim)
        if self.remote is not None:
            self.remote.close()

    def stats(self) -> SharingStats:
        tree = self.tree.stats()
        with self.pool.lock:
            hit_tokens = tree.hit_tokens + self._remote_hit_blocks * self.block_size
        return SharingStats(
            tree=tree,
            hit_tokens=hit_tokens,
            lookup_tokens=tree.lookup_tokens,
            hit_rate=hit_tokens / tree.lookup_tokens if tree.lookup_tokens else 0.0,
            cached_blocks=tree.cached_blocks,
            shared_blocks=tree.locked_blocks,
            evictions=tree.evicted_blocks,
            pool_blocks=tree.cached_blocks if self.grouped is None else self.grouped.pool_blocks,
            remote=None if self.remote is None else self.remote.stats(),
        )
