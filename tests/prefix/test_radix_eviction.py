"""Eviction and locking in the prefix radix tree: exact eviction orders worked out by hand.

Logical time advances by one per match/insert; a comment on each operation gives the time it stamps.
Label ``L`` stands for the block of tokens ``[100 * L, 100 * L + 1]`` (block size 2).
"""

from __future__ import annotations

import pytest

from hf_kvgov.prefix import NodeInfo, PrefixMatch, RadixTree
from hf_kvgov.prefix.priority import Priority


def toks(*labels: int) -> list[int]:
    return [100 * label + offset for label in labels for offset in range(2)]


def three_prompts() -> RadixTree:
    tree = RadixTree(block_size=2)
    tree.insert(toks(1, 2), [1, 2])  # t1: [1 2]
    tree.insert(toks(3, 4), [3, 4])  # t2: [3 4]
    tree.insert(toks(1, 5), [1, 6])  # t3: splits [1 2] into [1] (t3) -> {[2] (t1), [6] (t3)}
    tree.match(toks(3, 4))  # t4: [3 4]
    return tree


def test_lru_order_is_exact() -> None:
    tree = three_prompts()
    assert tree.evict(1) == [2]  # leaves: [2] t1, [6] t3, [3 4] t4
    assert tree.evict(1) == [6]  # [1] is not a leaf yet
    assert tree.evict(1) == [1]  # [1] (t3) became a leaf, older than [3 4] (t4)
    assert tree.evict(5) == [4, 3]  # a run is trimmed from its tail
    assert len(tree) == 0
    assert tree.evict(1) == []
    tree.check_invariants()


def test_parent_competes_with_its_own_recency() -> None:
    tree = three_prompts()
    assert tree.evict(1) == [2]
    tree.match(toks(1))  # t5: [1] is now the most recent node
    assert tree.evict(4) == [6, 4, 3, 1]


def test_evicting_part_of_a_run_keeps_its_head() -> None:
    tree = RadixTree(block_size=2)
    tree.insert(toks(1, 2, 3, 4), [1, 2, 3, 4])
    assert tree.evict(3) == [4, 3, 2]
    assert tree.match(toks(1, 2, 3, 4)) == PrefixMatch((1,), 2)
    assert tree.stats().nodes == 1
    tree.check_invariants()


def test_locked_block_is_never_evicted() -> None:
    tree = RadixTree(block_size=2)
    tree.insert(toks(1, 2, 3), [1, 2, 3])  # t1
    tree.insert(toks(4, 5), [4, 5])  # t2
    tree.lock([2])  # a lock in the middle of a run splits it into [1] -> [2] -> [3]
    assert tree.stats().nodes == 4
    assert tree.evictable_blocks() == 3  # [3], [4 5]; 1 sits above the locked 2
    assert tree.evict(10) == [3, 5, 4]
    assert sorted(tree.evict(10)) == []
    assert (len(tree), tree.lock_count(2), tree.lock_count(1)) == (2, 1, 0)
    assert tree.match(toks(1, 2, 3)).block_ids == (1, 2)
    tree.unlock([2])
    assert tree.evictable_blocks() == 2
    assert tree.evict(10) == [2, 1]
    tree.check_invariants()


def test_lock_counts_nest() -> None:
    tree = RadixTree(block_size=2)
    tree.insert(toks(1, 2), [1, 2])
    tree.lock([1, 2, 2])
    tree.lock([2])
    assert (tree.lock_count(1), tree.lock_count(2)) == (1, 3)
    assert tree.stats().locked_blocks == 2
    tree.unlock([2, 2, 2])
    assert tree.evict(5) == [2]
    tree.unlock([1])
    assert tree.evict(5) == [1]


def test_unlock_below_zero_changes_nothing() -> None:
    tree = RadixTree(block_size=2)
    tree.insert(toks(1, 2), [1, 2])
    tree.lock([1])
    with pytest.raises(ValueError, match="Cannot unlock block 2 1 time"):
        tree.unlock([1, 2])
    with pytest.raises(ValueError, match="Cannot unlock block 1 2 time"):
        tree.unlock([1, 1])
    assert (tree.lock_count(1), tree.lock_count(2)) == (1, 0)
    tree.check_invariants()


def test_unknown_blocks_are_rejected() -> None:
    tree = RadixTree(block_size=2)
    tree.insert(toks(1), [1])
    with pytest.raises(ValueError, match=r"Cannot lock block id\(s\) \[5, 7\]"):
        tree.lock([1, 7, 5])
    with pytest.raises(ValueError, match=r"Cannot unlock block id\(s\) \[9\]"):
        tree.unlock([9])
    with pytest.raises(ValueError, match=r"Cannot read the lock count of block id\(s\) \[3\]"):
        tree.lock_count(3)
    assert tree.lock_count(1) == 0
    tree.evict(1)
    with pytest.raises(ValueError, match="already evicted"):
        tree.lock([1])


def test_evictable_counts_protect_ancestors_only() -> None:
    tree = RadixTree(block_size=2)
    tree.insert(toks(1, 2, 3), [1, 2, 3])
    tree.insert(toks(1, 2, 4), [1, 2, 4])
    tree.insert(toks(5), [5])
    tree.lock([3])
    assert tree.evictable_blocks() == 2  # 4 and 5; 1, 2 are above the locked 3
    tree.lock([4])
    assert tree.evictable_blocks() == 1
    tree.unlock([3])
    assert tree.evictable_blocks() == 2
    tree.unlock([4])
    assert tree.evictable_blocks() == 5 == len(tree)
    tree.check_invariants()


def test_lfu_and_lru_disagree_exactly() -> None:
    def run(priority: str) -> list[int]:
        tree = RadixTree(block_size=2, priority=priority)
        tree.insert(toks(1), [1])  # t1, 1 access
        tree.match(toks(1))  # t2, 2 accesses
        tree.insert(toks(2), [2])  # t3, 1 access
        return tree.evict(2)

    assert run("lru") == [1, 2]
    assert run("lfu") == [2, 1]


class MostRecentFirst:
    def priority(self, node: NodeInfo) -> Priority:
        return -node.last_access


def test_custom_priority_plugs_in() -> None:
    tree = RadixTree(block_size=2, priority=MostRecentFirst())
    tree.insert(toks(1), [1])
    tree.insert(toks(2), [2])
    tree.insert(toks(3), [3])
    tree.match(toks(1))
    assert tree.evict(3) == [1, 3, 2]


def test_many_touches_keep_queue_consistent() -> None:
    tree = RadixTree(block_size=2)
    for label in range(20):
        tree.insert(toks(label), [label])
    for _ in range(50):
        for label in range(19, -1, -1):  # label 0 is the most recent after each round
            tree.match(toks(label))
    tree.check_invariants()
    assert tree.evict(20) == list(range(19, -1, -1))
