"""Bookkeeping tests of the prefix radix tree: exact block ids, split structure, namespaces, stats.

Expected values are worked out by hand from the operations in each test. Prompts are built from block
labels: label ``L`` stands for the block of tokens ``[100 * L, 100 * L + 1, ...]``.
"""

from __future__ import annotations

import pytest

from hf_kvgov.prefix import InsertResult, PrefixCacheStats, PrefixMatch, RadixTree


def toks(*labels: int, block_size: int = 4) -> list[int]:
    return [100 * label + offset for label in labels for offset in range(block_size)]


@pytest.fixture
def tree() -> RadixTree:
    tree = RadixTree(block_size=4)
    tree.insert(toks(1, 2, 3), [7, 8, 9])
    return tree


# ---------------------------------------------------------------- match lengths


def test_full_prompt_matches_every_block(tree: RadixTree) -> None:
    assert tree.match(toks(1, 2, 3)) == PrefixMatch((7, 8, 9), 12)


def test_longer_prompt_matches_cached_part(tree: RadixTree) -> None:
    assert tree.match([*toks(1, 2, 3), 5, 6]) == PrefixMatch((7, 8, 9), 12)


def test_prefix_ending_mid_block_rounds_down(tree: RadixTree) -> None:
    # 10 tokens = 2 full blocks + 2 tokens of block 3: only 8 tokens can be served.
    assert tree.match(toks(1, 2, 3)[:10]) == PrefixMatch((7, 8), 8)


def test_divergent_block_stops_match(tree: RadixTree) -> None:
    assert tree.match(toks(1, 2, 4)) == PrefixMatch((7, 8), 8)
    one_token_off = toks(1, 2, 3)
    one_token_off[5] = 999  # inside block 2
    assert tree.match(one_token_off) == PrefixMatch((7,), 4)


def test_miss_and_empty_prompt(tree: RadixTree) -> None:
    assert tree.match(toks(2, 3)) == PrefixMatch((), 0)
    assert tree.match([]) == PrefixMatch((), 0)
    assert tree.match(toks(1)[:3]) == PrefixMatch((), 0)


@pytest.mark.parametrize(
    ("max_tokens", "expected"),
    [(12, (7, 8, 9)), (11, (7, 8)), (8, (7, 8)), (7, (7,)), (4, (7,)), (3, ()), (0, ()), (100, (7, 8, 9))],
)
def test_max_tokens_limits_match(tree: RadixTree, max_tokens: int, expected: tuple[int, ...]) -> None:
    assert tree.match(toks(1, 2, 3), max_tokens=max_tokens) == PrefixMatch(expected, 4 * len(expected))


def test_partial_tail_is_not_cached() -> None:
    tree = RadixTree(block_size=4)
    result = tree.insert([*toks(1, 2), 1, 2, 3], [5, 6])
    assert result.adopted == (5, 6)
    assert len(tree) == 2
    assert tree.match([*toks(1, 2), 1, 2, 3, 4]) == PrefixMatch((5, 6), 8)


def test_tokens_from_other_int_types_match_lists() -> None:
    tree = RadixTree(block_size=2)
    tree.insert((1, 2, 3, 4), range(10, 12))
    assert tree.match(range(1, 5)) == PrefixMatch((10, 11), 4)


# ---------------------------------------------------------------- node splitting


def test_insert_diverging_in_run_splits_node() -> None:
    tree = RadixTree(block_size=4)
    tree.insert(toks(1, 2, 3, 4), [10, 11, 12, 13])
    assert tree.stats().nodes == 1
    result = tree.insert(toks(1, 2, 5, 6), [20, 21, 22, 23])
    assert result == InsertResult(
        block_ids=(10, 11, 22, 23), adopted=(22, 23), duplicates=((20, 10), (21, 11)), present=()
    )
    assert len(tree) == 6
    assert tree.stats().nodes == 3  # [10 11] -> {[12 13], [22 23]}
    assert tree.match(toks(1, 2, 3, 4)).block_ids == (10, 11, 12, 13)
    assert tree.match(toks(1, 2, 5, 6)).block_ids == (10, 11, 22, 23)
    assert tree.match(toks(1, 2, 7)).block_ids == (10, 11)
    tree.check_invariants()


def test_match_ending_inside_run_splits_node() -> None:
    tree = RadixTree(block_size=4)
    tree.insert(toks(1, 2, 3, 4), [10, 11, 12, 13])
    assert tree.match(toks(1, 2, 3)).block_ids == (10, 11, 12)
    assert tree.stats().nodes == 2  # [10 11 12] -> [13]
    assert tree.match(toks(1)).block_ids == (10,)
    assert tree.stats().nodes == 3
    assert len(tree) == 4
    assert tree.match(toks(1, 2, 3, 4, 5)).block_ids == (10, 11, 12, 13)
    tree.check_invariants()


def test_insert_shorter_prefix_splits_and_adds_nothing() -> None:
    tree = RadixTree(block_size=2)
    tree.insert(toks(1, 2, 3, block_size=2), [1, 2, 3])
    result = tree.insert(toks(1, block_size=2), [1])
    assert result == InsertResult(block_ids=(1,), adopted=(), duplicates=(), present=(1,))
    assert (len(tree), tree.stats().nodes) == (3, 2)
    tree.check_invariants()


def test_extending_a_cached_prompt_reuses_its_blocks() -> None:
    tree = RadixTree(block_size=4)
    tree.insert(toks(1, 2), [10, 11])
    result = tree.insert(toks(1, 2, 3, 4, 5), [10, 11, 40, 41, 42])
    assert result == InsertResult((10, 11, 40, 41, 42), (40, 41, 42), (), (10, 11))
    assert tree.match(toks(1, 2, 3, 4, 5)).block_ids == (10, 11, 40, 41, 42)
    tree.check_invariants()


# ---------------------------------------------------------------- duplicates and namespaces


def test_reinsert_reports_duplicates_and_present() -> None:
    tree = RadixTree(block_size=4)
    tree.insert(toks(1, 2, 3, 4), [10, 11, 12, 13])
    again = tree.insert(toks(1, 2, 3, 4), [30, 31, 32, 33])
    assert again.duplicates == ((30, 10), (31, 11), (32, 12), (33, 13))
    assert (again.adopted, again.present, again.block_ids) == ((), (), (10, 11, 12, 13))
    assert 30 not in tree and len(tree) == 4
    mixed = tree.insert(toks(1, 2, 3, 4, 5), [10, 11, 40, 41, 42])
    assert mixed == InsertResult((10, 11, 12, 13, 42), (42,), ((40, 12), (41, 13)), (10, 11))
    assert len(tree) == 5


def test_namespaces_are_isolated() -> None:
    tree = RadixTree(block_size=4)
    tree.insert(toks(1, 2), [1, 2], namespace="tenant-a")
    assert tree.match(toks(1, 2)) == PrefixMatch((), 0)
    assert tree.match(toks(1, 2), namespace="tenant-b") == PrefixMatch((), 0)
    result = tree.insert(toks(1, 2), [3, 4], namespace="tenant-b")
    assert (result.adopted, result.duplicates) == ((3, 4), ())
    assert tree.match(toks(1, 2), namespace="tenant-a").block_ids == (1, 2)
    assert tree.match(toks(1, 2), namespace="tenant-b").block_ids == (3, 4)
    assert tree.stats().namespaces == 2
    with pytest.raises(ValueError, match="already cached"):
        tree.insert(toks(1, 2), [1, 9], namespace="tenant-c")
    assert sorted(tree.evict(10)) == [1, 2, 3, 4]
    assert tree.stats().namespaces == 0


def test_lock_flags_lock_atomically() -> None:
    tree = RadixTree(block_size=4)
    inserted = tree.insert(toks(1, 2), [10, 11])
    duplicate = tree.insert(toks(1, 2, 3), [20, 21, 22], lock=True)
    assert duplicate.block_ids == (10, 11, 22)
    assert [tree.lock_count(b) for b in (10, 11, 22)] == [1, 1, 1]
    assert inserted.adopted == (10, 11)
    assert tree.match(toks(1, 5), lock=True).block_ids == (10,)
    assert [tree.lock_count(b) for b in (10, 11, 22)] == [2, 1, 1]
    assert tree.evict(10) == []


# ---------------------------------------------------------------- stats


def test_stats_counters_are_exact() -> None:
    tree = RadixTree(block_size=4)
    tree.insert(toks(1, 2, 3), [1, 2, 3])
    tree.match([*toks(1, 2, 3), 0, 0])  # 14 tokens, 12 hit
    tree.match(toks(9))  # 4 tokens, miss
    tree.match([*toks(1, 2), 5], max_tokens=8)  # 9 tokens, 8 hit
    tree.insert(toks(1, 2, 3, 4), [50, 2, 3, 4])  # 50 duplicates 1; 2, 3 present; 4 adopted
    tree.lock([4])
    assert tree.evict(2) == []
    stats = tree.stats()
    assert stats == PrefixCacheStats(
        block_size=4,
        cached_blocks=4,
        locked_blocks=1,
        evictable_blocks=0,
        nodes=3,  # [1 2] -> [3] -> [4]: the max_tokens match split [1 2 3]
        namespaces=1,
        lookups=3,
        hits=2,
        lookup_tokens=27,
        hit_tokens=20,
        inserted_blocks=4,
        duplicate_blocks=1,
        evicted_blocks=0,
    )
    assert stats.hit_rate == pytest.approx(20 / 27)
    assert stats.as_dict()["hit_rate"] == pytest.approx(20 / 27)
    tree.unlock([4])
    assert tree.evict(2) == [4, 3]
    after = tree.stats()
    assert (after.cached_blocks, after.evictable_blocks, after.evicted_blocks) == (2, 2, 2)


def test_stats_before_any_lookup() -> None:
    assert RadixTree(block_size=16).stats().hit_rate == 0.0


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("block_size", [0, -4])
def test_block_size_must_be_positive(block_size: int) -> None:
    with pytest.raises(ValueError, match="block_size must be an int > 0"):
        RadixTree(block_size)


@pytest.mark.parametrize("block_size", [2.0, True, "4"])
def test_block_size_must_be_int(block_size: object) -> None:
    with pytest.raises(TypeError, match="block_size"):
        RadixTree(block_size)  # type: ignore[arg-type]


def test_unknown_priority_is_rejected() -> None:
    with pytest.raises(ValueError, match="Unknown eviction priority 'fifo'"):
        RadixTree(4, priority="fifo")
    with pytest.raises(TypeError, match="priority"):
        RadixTree(4, priority=3)  # type: ignore[arg-type]


def test_insert_rejects_bad_block_ids(tree: RadixTree) -> None:
    before = tree.stats()
    with pytest.raises(ValueError, match="12 tokens with block_size 4 make 3 full block"):
        tree.insert(toks(4, 5, 6), [1, 2])
    with pytest.raises(ValueError, match="must not repeat"):
        tree.insert(toks(4, 5), [1, 1])
    with pytest.raises(ValueError, match=">= 0"):
        tree.insert(toks(4), [-1])
    with pytest.raises(TypeError, match="int block ids"):
        tree.insert(toks(4), [1.5])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"block_ids\[1\] = 7 is already cached"):
        tree.insert(toks(4, 5), [1, 7])
    with pytest.raises(ValueError, match=r"block_ids\[0\] = 8 is already cached"):
        tree.insert(toks(1, 2), [8, 7])  # both cached, but at each other's position
    assert tree.stats() == before
    tree.check_invariants()


def test_other_bad_arguments(tree: RadixTree) -> None:
    with pytest.raises(ValueError, match="max_tokens must be an int >= 0"):
        tree.match(toks(1), max_tokens=-1)
    with pytest.raises(TypeError, match="namespace must be a str"):
        tree.match(toks(1), namespace=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="got a string"):
        tree.match("hello")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not an int"):
        tree.match([1.0, 2.0])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="num_blocks must be an int >= 0"):
        tree.evict(-1)


def test_stats_record_validates() -> None:
    with pytest.raises(ValueError, match="cached_blocks must be an int >= 0"):
        PrefixCacheStats(4, -1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="hits cannot exceed lookups"):
        PrefixCacheStats(4, 0, 0, 0, 0, 0, 1, 1, 4, 8, 0, 0, 0)
