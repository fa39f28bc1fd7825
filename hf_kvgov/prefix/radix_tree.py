"""The prefix index: prompts' full token blocks -> KV block ids, with ref locks and leaf eviction.

SGLang's RadixAttention and vLLM's automatic prefix caching, for a pool whose block id holds ``block_size`` tokens
of every layer. Block ``i`` of a prompt is found by walking the token-id tuples of blocks ``0..i`` from the root
(vLLM's chained hash); a partial tail block is never cached, because its KV would still change. Namespaces (vLLM's
``cache_salt``) are separate roots, which never share a block. Nodes hold compressed runs, split where a prompt
diverges, ends, matches or is locked partway, so a node's blocks share one lock count and recency; runs never merge
back, so many partial locks leave more, shorter runs. Only unlocked leaves are evicted (LRU by default), so locking
a prompt's last block protects its ancestors. ``match`` and ``insert`` are O(L + d log h), evicting n blocks
amortised O(n log h), sizes O(1). Every public method holds one re-entrant lock, never around model compute; use
``lock=True`` when another thread may evict between a lookup and the lock.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from hf_kvgov.prefix import inputs
from hf_kvgov.prefix.index import RadixIndex
from hf_kvgov.prefix.priority import EvictionPriority, make_priority
from hf_kvgov.prefix.results import InsertResult, PrefixCacheStats, PrefixMatch


@dataclass
class _Counters:
    lookups: int = 0
    hits: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0
    inserted_blocks: int = 0
    duplicate_blocks: int = 0
    evicted_blocks: int = 0


class RadixTree:
    """Maps full token blocks of prompts to KV block ids; the tree never holds tensors, only ints.

    Args:
        block_size: tokens per KV block (the pool's block size), > 0.
        priority: eviction priority: a name in :data:`hf_kvgov.prefix.priority.PRIORITIES` (``"lru"``,
            ``"lfu"``) or an object with a ``priority(node)`` method (smallest is evicted first).

    Typical use next to a block pool (the tree's reference on a block is one pool reference)::

        hit = tree.match(prompt, max_tokens=len(prompt) - 1, lock=True)  # keep >= 1 token to compute
        table = [*hit.block_ids, *pool.allocate(needed)]                 # prefill the rest into them
        done = tree.insert(prompt, table[: len(prompt) // tree.block_size])
        pool.incref(done.adopted)                                        # the tree's own reference
        tree.unlock(hit.block_ids)                                       # when the sequence finishes
        pool.decref(tree.evict(n))                                       # when the pool needs room
    """

    def __init__(self, block_size: int, priority: str | EvictionPriority = "lru") -> None:
        self._index = RadixIndex(inputs.positive_int(block_size, "block_size"), make_priority(priority))
        self._mutex = threading.RLock()
        self._counters = _Counters()

    @property
    def block_size(self) -> int:
        return self._index.block_size

    @property
    def policy(self) -> EvictionPriority:
        return self._index.queue.policy

    def match(
        self,
        token_ids: Sequence[int],
        namespace: str = "",
        *,
        max_tokens: int | None = None,
        lock: bool = False,
        servable: Callable[[list[int]], int] | None = None,
    ) -> PrefixMatch:
        """Longest cached prefix of ``token_ids`` in whole blocks; refreshes the recency of what matched.

        Args:
            token_ids: the prompt, ``[num_tokens]`` ints.
            namespace: only blocks inserted under the same namespace can match.
            max_tokens: match at most this many tokens (rounded down to whole blocks). Callers pass
                ``len(token_ids) - 1`` so that at least one prompt token is left to compute.
            lock: also lock every matched block once, atomically with the lookup.
            servable: the matched block ids -> how many leading ones the caller can use (the hit is cut there,
                atomically with the lookup; a prefix over layer groups needs its sliding groups' blocks).
        """
        tokens = inputs.token_list(token_ids)
        space = inputs.namespace(namespace)
        usable = len(tokens)
        if max_tokens is not None:
            usable = min(usable, inputs.non_negative_int(max_tokens, "max_tokens"))
        index = self._index
        with self._mutex:
            keys = index.keys(tokens, usable // index.block_size)
            path, used = index.descend(space, keys)
            if servable is not None:
                path, used = index.descend(space, keys[: servable(index.path_ids(path, used))])
            path = index.claim(path, used)
            index.touch(path)
            block_ids = tuple(block_id for node in path for block_id in node.block_ids)
            if lock:
                index.change_locks(dict.fromkeys(block_ids, 1))
            hit_tokens = len(block_ids) * index.block_size
            self._record_lookup(len(tokens), hit_tokens)
            return PrefixMatch(block_ids, hit_tokens)

    def insert(
        self,
        token_ids: Sequence[int],
        block_ids: Iterable[int],
        namespace: str = "",
        *,
        lock: bool = False,
    ) -> InsertResult:
        """Cache the full blocks of ``token_ids``, whose KV the caller wrote into ``block_ids``.

        Args:
            token_ids: the prompt (and any generated tokens), ``[num_tokens]`` ints; a partial tail block
                is ignored.
            block_ids: one block id per full block, ``len(token_ids) // block_size`` of them, in order.
                Each must be either the id the tree already caches at that position or an id the tree
                does not hold at all.
            namespace: the namespace (cache salt) to insert under.
            lock: also lock every block of the result's ``block_ids`` once, atomically with the insert.

        Returns:
            What happened to each offered block; see :class:`InsertResult` for the ref-count contract.
        """
        tokens = inputs.token_list(token_ids)
        offered = inputs.distinct(inputs.block_id_list(block_ids))
        space = inputs.namespace(namespace)
        index = self._index
        num_blocks = len(tokens) // index.block_size
        if len(offered) != num_blocks:
            raise ValueError(
                f"insert needs one block id per full block: {len(tokens)} tokens with block_size "
                f"{index.block_size} make {num_blocks} full block(s), but {len(offered)} block id(s) were "
                "given."
            )
        with self._mutex:
            keys = index.keys(tokens, num_blocks)
            path, used = index.descend(space, keys)
            cached = index.path_ids(path, used)
            self._check_offered(offered, cached)
            if not num_blocks:
                return InsertResult((), (), (), ())
            path = index.claim(path, used)
            if len(cached) < num_blocks:
                parent = path[-1] if path else None
                path.append(index.attach(space, parent, keys[len(cached) :], offered[len(cached) :]))
            index.touch(path)
            result = self._classify(offered, cached)
            if lock:
                index.change_locks(dict.fromkeys(result.block_ids, 1))
            return result

    def lock(self, block_ids: Iterable[int]) -> None:
        """Take one in-use reference on each listed block (an id listed twice is locked twice)."""
        deltas = Counter(inputs.block_id_list(block_ids))
        with self._mutex:
            self._check_known(deltas, "lock")
            self._index.change_locks(deltas)

    def unlock(self, block_ids: Iterable[int]) -> None:
        """Drop one in-use reference on each listed block; nothing changes if any would go below zero."""
        deltas = Counter(inputs.block_id_list(block_ids))
        with self._mutex:
            self._check_known(deltas, "unlock")
            for block_id, count in deltas.items():
                held = self._index.owner[block_id].lock_count
                if count > held:
                    raise ValueError(
                        f"Cannot unlock block {block_id} {count} time(s): it holds {held} lock(s). Every "
                        "unlock must pair with an earlier lock (or a match/insert with lock=True)."
                    )
            self._index.change_locks({block_id: -count for block_id, count in deltas.items()})

    def lock_count(self, block_id: int) -> int:
        """In-use references currently held on ``block_id``."""
        with self._mutex:
            self._check_known({block_id: 1}, "read the lock count of")
            return self._index.owner[block_id].lock_count

    def evict(self, num_blocks: int) -> list[int]:
        """Remove up to ``num_blocks`` unlocked leaf blocks, lowest priority first; return their ids.

        The tree drops its reference on each returned id: the caller gives them back to the pool.
        Fewer ids come back when fewer blocks are evictable (see :meth:`evictable_blocks`).
        """
        wanted = inputs.non_negative_int(num_blocks, "num_blocks")
        with self._mutex:
            evicted = self._index.evict(wanted)
            self._counters.evicted_blocks += len(evicted)
            return evicted

    def evictable_blocks(self) -> int:
        """Blocks that repeated eviction could free now: neither locked nor above a locked block."""
        with self._mutex:
            return self._index.evictable_blocks

    def __len__(self) -> int:
        with self._mutex:
            return len(self._index.owner)

    def __contains__(self, block_id: object) -> bool:
        with self._mutex:
            return block_id in self._index.owner

    def stats(self) -> PrefixCacheStats:
        """A consistent snapshot of sizes and counters."""
        with self._mutex:
            index, counters = self._index, self._counters
            return PrefixCacheStats(
                block_size=index.block_size,
                cached_blocks=len(index.owner),
                locked_blocks=index.locked_blocks,
                evictable_blocks=index.evictable_blocks,
                nodes=index.num_nodes,
                namespaces=len(index.roots),
                lookups=counters.lookups,
                hits=counters.hits,
                lookup_tokens=counters.lookup_tokens,
                hit_tokens=counters.hit_tokens,
                inserted_blocks=counters.inserted_blocks,
                duplicate_blocks=counters.duplicate_blocks,
                evicted_blocks=counters.evicted_blocks,
            )

    def check_invariants(self) -> None:
        """Re-derive every index and counter from the nodes (O(n)); raise AssertionError on a mismatch."""
        with self._mutex:
            self._index.audit()

    def __repr__(self) -> str:
        with self._mutex:
            index = self._index
            return (
                f"RadixTree(block_size={index.block_size}, cached_blocks={len(index.owner)}, "
                f"nodes={index.num_nodes}, namespaces={len(index.roots)}, policy={self.policy!r})"
            )

    # ------------------------------------------------------------------ internals

    def _record_lookup(self, lookup_tokens: int, hit_tokens: int) -> None:
        counters = self._counters
        counters.lookups += 1
        counters.hits += hit_tokens > 0
        counters.lookup_tokens += lookup_tokens
        counters.hit_tokens += hit_tokens

    def _check_known(self, block_ids: Iterable[int], action: str) -> None:
        unknown = sorted(block_id for block_id in block_ids if block_id not in self._index.owner)
        if unknown:
            raise ValueError(
                f"Cannot {action} block id(s) {unknown}: the prefix tree does not cache them (never "
                "inserted, or already evicted). Only ids returned by match/insert can be locked."
            )

    def _check_offered(self, offered: list[int], cached: list[int]) -> None:
        """Reject offered ids the tree caches at another position: adopting them would alias two blocks."""
        for position, block_id in enumerate(offered):
            same_place = position < len(cached) and cached[position] == block_id
            if not same_place and block_id in self._index.owner:
                raise ValueError(
                    f"block_ids[{position}] = {block_id} is already cached by the prefix tree for a "
                    "different block (another position, prompt or namespace). Pass freshly written blocks, "
                    "or the id the tree holds at this position."
                )

    def _classify(self, offered: list[int], cached: list[int]) -> InsertResult:
        """Split the offered ids into adopted / duplicate / present, and count them."""
        pairs = list(zip(offered[: len(cached)], cached, strict=True))
        duplicates = tuple((mine, theirs) for mine, theirs in pairs if mine != theirs)
        present = tuple(mine for mine, theirs in pairs if mine == theirs)
        adopted = tuple(offered[len(cached) :])
        self._counters.inserted_blocks += len(adopted)
        self._counters.duplicate_blocks += len(duplicates)
        return InsertResult(tuple(cached) + adopted, adopted, duplicates, present)
