"""Several threads inserting, matching, locking and evicting on one tree; the books must balance after."""

from __future__ import annotations

import random
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from hf_kvgov.prefix import RadixTree

THREADS = 4
STEPS = 400


@dataclass
class Ledger:
    """What one worker saw: ids the tree adopted or rejected, ids it evicted, errors raised."""

    adopted: list[int] = field(default_factory=list)
    rejected: list[int] = field(default_factory=list)
    evicted: list[int] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)


@pytest.fixture(autouse=True)
def frequent_thread_switches() -> Iterator[None]:
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(previous)


def worker(tree: RadixTree, seed: int, ledger: Ledger) -> None:
    rng = random.Random(seed)
    next_id = seed * 1_000_000  # disjoint id ranges, as a pool would hand out
    try:
        for _ in range(STEPS):
            prompt = [rng.randrange(3) for _ in range(rng.randrange(1, 12))]
            action = rng.random()
            if action < 0.45:
                ids = list(range(next_id, next_id + len(prompt) // 2))
                next_id += len(ids)
                result = tree.insert(prompt, ids, lock=True)
                ledger.adopted.extend(result.adopted)
                ledger.rejected.extend(mine for mine, _ in result.duplicates)
                tree.unlock(result.block_ids)  # the "sequence" finished with its blocks
            elif action < 0.85:
                matched = tree.match(prompt, max_tokens=len(prompt) - 1, lock=True)
                tree.unlock(matched.block_ids)
            else:
                ledger.evicted.extend(tree.evict(rng.randrange(4)))
    except BaseException as error:  # a worker must report, not die silently
        ledger.errors.append(error)


def test_concurrent_use_keeps_tree_consistent() -> None:
    tree = RadixTree(block_size=2)
    ledgers = [Ledger() for _ in range(THREADS)]
    threads = [threading.Thread(target=worker, args=(tree, i + 1, ledgers[i])) for i in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)
    assert [error for ledger in ledgers for error in ledger.errors] == []

    tree.check_invariants()
    adopted = [b for ledger in ledgers for b in ledger.adopted]
    rejected = {b for ledger in ledgers for b in ledger.rejected}
    evicted = [b for ledger in ledgers for b in ledger.evicted]
    stats = tree.stats()
    assert len(adopted) == len(set(adopted)) == stats.inserted_blocks
    assert len(evicted) == len(set(evicted)) == stats.evicted_blocks
    assert set(evicted) <= set(adopted)
    assert not rejected & set(adopted)
    assert stats.locked_blocks == 0
    assert stats.evictable_blocks == stats.cached_blocks == len(adopted) - len(evicted)

    remaining = tree.evict(len(tree))
    assert set(remaining) == set(adopted) - set(evicted)
    assert (len(tree), tree.stats().nodes, tree.stats().namespaces) == (0, 0, 0)
