"""The radix tree against a brute-force reference model, over random operation sequences.

The reference is a flat dict from (namespace, chain of block keys) to a block record, with no nodes, no
splitting, no heap: match walks chains one by one, eviction scans every record for unlocked leaves. The
tree must agree with it on every result, lock count and size.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hf_kvgov.prefix import InsertResult, RadixTree

BLOCK = 2
Chain = tuple[str, tuple[tuple[int, ...], ...]]

# A 3-letter alphabet and short prompts make shared prefixes, splits and divergences frequent.
prompts = st.lists(st.integers(0, 2), max_size=9)
namespaces = st.sampled_from(["", "salt"])


@dataclass
class Record:
    block_id: int
    locks: int
    last_access: int


class Reference:
    """Every cached block under its full chain; the semantics the tree must reproduce."""

    def __init__(self) -> None:
        self.records: dict[Chain, Record] = {}
        self.clock = 0

    def chains(self, tokens: list[int], namespace: str, limit: int) -> list[Chain]:
        keys = [tuple(tokens[i * BLOCK : (i + 1) * BLOCK]) for i in range(limit // BLOCK)]
        return [(namespace, tuple(keys[: i + 1])) for i in range(len(keys))]

    def match(self, tokens: list[int], namespace: str, limit: int) -> list[int]:
        self.clock += 1
        found: list[int] = []
        for chain in self.chains(tokens, namespace, limit):
            record = self.records.get(chain)
            if record is None:
                break
            record.last_access = self.clock
            found.append(record.block_id)
        return found

    def insert(self, tokens: list[int], namespace: str, offered: list[int]) -> InsertResult:
        self.clock += 1
        ids, adopted, duplicates, present = [], [], [], []
        for chain, mine in zip(self.chains(tokens, namespace, len(tokens)), offered, strict=True):
            record = self.records.get(chain)
            if record is None:
                record = self.records[chain] = Record(mine, 0, self.clock)
                adopted.append(mine)
            elif record.block_id == mine:
                present.append(mine)
            else:
                duplicates.append((mine, record.block_id))
            record.last_access = self.clock
            ids.append(record.block_id)
        return InsertResult(tuple(ids), tuple(adopted), tuple(duplicates), tuple(present))

    def has_child(self, chain: Chain) -> bool:
        namespace, keys = chain
        return any(ns == namespace and k[:-1] == keys for ns, k in self.records if len(k) == len(keys) + 1)

    def protected(self, chain: Chain) -> bool:
        """Locked itself or below: some locked record's chain starts with this one."""
        namespace, keys = chain
        return any(ns == namespace and k[: len(keys)] == keys and r.locks for (ns, k), r in self.records.items())

    def evict(self, wanted: int) -> list[int]:
        evicted: list[int] = []
        while len(evicted) < wanted:
            leaves = [c for c, r in self.records.items() if r.locks == 0 and not self.has_child(c)]
            if not leaves:
                break
            oldest = min(leaves, key=lambda c: self.records[c].last_access)
            stamps = [self.records[c].last_access for c in leaves]
            # One operation touches one root-to-node path, so two leaves never share a stamp.
            assert stamps.count(self.records[oldest].last_access) == 1
            evicted.append(self.records.pop(oldest).block_id)
        return evicted

    def by_id(self) -> dict[int, Record]:
        return {r.block_id: r for r in self.records.values()}


class TreeVersusReference(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tree = RadixTree(block_size=BLOCK)
        self.ref = Reference()
        self.next_id = 0
        self.free: list[int] = []  # ids evicted or rejected as duplicates, reused like a pool would

    def fresh_id(self) -> int:
        if self.free:
            return self.free.pop(0)
        self.next_id += 1
        return self.next_id

    @rule(tokens=prompts, namespace=namespaces, data=st.data(), lock=st.booleans())
    def insert(self, tokens: list[int], namespace: str, data: st.DataObject, lock: bool) -> None:
        offered = []
        for chain in self.ref.chains(tokens, namespace, len(tokens)):
            record = self.ref.records.get(chain)
            reuse = record is not None and data.draw(st.booleans(), label="reuse cached id")
            offered.append(record.block_id if reuse and record else self.fresh_id())
        expected = self.ref.insert(tokens, namespace, offered)
        assert self.tree.insert(tokens, offered, namespace, lock=lock) == expected
        self.free.extend(mine for mine, _ in expected.duplicates)
        if lock:
            self.lock_in_ref(expected.block_ids)

    @rule(tokens=prompts, namespace=namespaces, cap=st.none() | st.integers(0, 10), lock=st.booleans())
    def match(self, tokens: list[int], namespace: str, cap: int | None, lock: bool) -> None:
        limit = len(tokens) if cap is None else min(cap, len(tokens))
        expected = self.ref.match(tokens, namespace, limit)
        result = self.tree.match(tokens, namespace, max_tokens=cap, lock=lock)
        assert list(result.block_ids) == expected
        assert result.num_tokens == BLOCK * len(expected)
        if lock:
            self.lock_in_ref(expected)

    def lock_in_ref(self, block_ids: tuple[int, ...] | list[int]) -> None:
        records = self.ref.by_id()
        for block_id in block_ids:
            records[block_id].locks += 1

    @precondition(lambda self: self.ref.records)
    @rule(data=st.data())
    def lock(self, data: st.DataObject) -> None:
        cached = sorted(self.ref.by_id())
        chosen = data.draw(st.lists(st.sampled_from(cached), min_size=1, max_size=4), label="lock")
        self.tree.lock(chosen)
        self.lock_in_ref(chosen)

    @precondition(lambda self: any(r.locks for r in self.ref.records.values()))
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        locked = sorted(b for b, r in self.ref.by_id().items() if r.locks)
        block_id = data.draw(st.sampled_from(locked), label="unlock")
        self.tree.unlock([block_id])
        self.ref.by_id()[block_id].locks -= 1

    @precondition(lambda self: any(r.locks == 0 for r in self.ref.records.values()))
    @rule(data=st.data())
    def unlock_too_often(self, data: st.DataObject) -> None:
        unlocked = sorted(b for b, r in self.ref.by_id().items() if r.locks == 0)
        block_id = data.draw(st.sampled_from(unlocked), label="over-unlock")
        with pytest.raises(ValueError, match="Cannot unlock"):
            self.tree.unlock([block_id])

    @rule(wanted=st.integers(0, 6))
    def evict(self, wanted: int) -> None:
        protected = {r.block_id for c, r in self.ref.records.items() if self.ref.protected(c)}
        expected = self.ref.evict(wanted)
        evicted = self.tree.evict(wanted)
        assert evicted == expected
        assert not protected & set(evicted), "a locked block (or one above it) was evicted"
        self.free.extend(evicted)

    @invariant()
    def same_state(self) -> None:
        records = self.ref.by_id()
        assert len(self.tree) == len(records)
        for block_id, record in records.items():
            assert record.locks >= 0
            assert self.tree.lock_count(block_id) == record.locks
        evictable = sum(not self.ref.protected(c) for c in self.ref.records)
        assert self.tree.evictable_blocks() == evictable
        assert self.tree.stats().locked_blocks == sum(r.locks > 0 for r in records.values())
        self.tree.check_invariants()


TreeVersusReference.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=35,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_tree_matches_reference = TreeVersusReference.TestCase
