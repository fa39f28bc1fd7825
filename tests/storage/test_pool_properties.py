"""Random sequences of block-table operations over a small capped pool, checked after every step.

A model holds, for every live table (stand-alone `BlockTable`s and the rows of `BlockTables` batches),
the value written at each of its token positions. After every step:

- each block's reference count equals the number of tables that reference it;
- the free list and the referenced blocks partition the capacity, with no id twice in the free list;
- each table holds exactly ceil(tokens / block_size) distinct blocks;
- reading each table back through the pool gives exactly the model's values (copy-on-write isolates
  forks; a write never reaches a block another table reads).

`PoolExhausted` must leave the state unchanged. Two known defects, pinned by strict xfail tests in
test_block_table.py, limit how much of that is checked: a write that copies a shared block and then runs
out keeps the copy, and `BlockTables.slots_for` keeps the blocks it gave the rows before the one that ran
out (and its cached block-id tensor goes stale). So a failed write that needed no copy must change nothing
when it concerns one table or a one-row batch; a failed batch write is rolled back with
`truncate(num_tokens)`, which must restore the state exactly when no copy was needed; writes that copied
are checked against the invariants only.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hf_kvgov.errors import PoolExhausted
from hf_kvgov.storage.block_table import BlockTable, BlockTables
from hf_kvgov.storage.pool import BlockPool, KVGeometry

BLOCK = 3
CAP_BLOCKS = 12


@dataclass
class Single:
    table: BlockTable
    values: list[float] = field(default_factory=list)


@dataclass
class Batch:
    tables: BlockTables
    values: list[list[float]] = field(default_factory=list)


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        geometry = KVGeometry(num_layers=1, num_kv_heads=1, head_dim=1)
        self.pool = BlockPool(geometry, block_size=BLOCK, max_tokens=BLOCK * CAP_BLOCKS, growth_blocks=3)
        self.singles: list[Single] = []
        self.batches: list[Batch] = []
        self.counter = 0.0

    # ------------------------------------------------------------ helpers

    def fresh(self, n: int) -> list[float]:
        values = [self.counter + i + 1 for i in range(n)]
        self.counter += n
        return values

    def all_rows(self) -> list[tuple[BlockTable, list[float]]]:
        rows = [(single.table, single.values) for single in self.singles]
        for batch in self.batches:
            rows.extend(zip(batch.tables.rows, batch.values, strict=True))
        return rows

    def snapshot(self) -> tuple[object, ...]:
        tables = tuple(tuple(table.block_ids) for table, _ in self.all_rows())
        # Growth without allocation is allowed: compare referenced blocks only, and the count still free.
        refs = tuple((b, self.pool.ref_count(b)) for b in range(self.pool.capacity) if self.pool.ref_count(b))
        return tables, refs, self.pool.num_used, self.pool.num_free

    def needs_copy(self, table: BlockTable, start: int, end: int) -> bool:
        touched = table.block_ids[start // BLOCK : -(-end // BLOCK)]
        return any(self.pool.ref_count(block) > 1 for block in touched)

    def store(self, slots: torch.Tensor, values: list[float]) -> None:
        data = torch.tensor(values).reshape(-1, 1, 1)
        self.pool.write(0, slots, data, -data)

    def write_single(self, single: Single, start: int, count: int) -> None:
        table, end = single.table, start + count
        copies, before = self.needs_copy(table, start, end), self.snapshot()
        try:
            table.prepare_write(start, end)
        except PoolExhausted:
            event("table write exhausted the pool" + (" after a copy" if copies else ""))
            if not copies:
                assert self.snapshot() == before
            return
        event("table write" + (" copied a shared block" if copies else ""))
        values = self.fresh(count)
        slots = torch.tensor(
            [table.block_ids[t // BLOCK] * BLOCK + t % BLOCK for t in range(start, end)], dtype=torch.long
        )
        self.store(slots, values)
        single.values[start:end] = values

    def write_batch(self, batch: Batch, count: int) -> None:
        tables, start = batch.tables, batch.tables.num_tokens
        copies = any(self.needs_copy(row, start, start + count) for row in tables.rows)
        before = self.snapshot()
        try:
            slots = tables.slots_for(len(batch.values), start, count)
        except PoolExhausted:
            event("batch write exhausted the pool" + (" after a copy" if copies else ""))
            if len(batch.values) == 1 and not copies:
                assert self.snapshot() == before
            tables.truncate(start)  # roll back to the committed length, as a caller must (see above)
            if not copies:
                assert self.snapshot() == before
            return
        expected = [
            row.block_ids[t // BLOCK] * BLOCK + t % BLOCK for row in tables.rows for t in range(start, start + count)
        ]
        assert slots.tolist() == expected
        event("batch write" + (" copied a shared block" if copies else ""))
        values = self.fresh(count * len(batch.values))
        self.store(slots, values)
        for i, row_values in enumerate(batch.values):
            row_values.extend(values[i * count : (i + 1) * count])

    # ------------------------------------------------------------ stand-alone tables

    @rule(n=st.integers(0, 7))
    def create_table(self, n: int) -> None:
        single = Single(BlockTable(self.pool))
        self.write_single(single, 0, n)
        if len(single.values) == n:
            self.singles.append(single)

    @precondition(lambda self: self.singles)
    @rule(data=st.data(), count=st.integers(1, 5))
    def write_table(self, data: st.DataObject, count: int) -> None:
        single = data.draw(st.sampled_from(self.singles))
        start = data.draw(st.integers(0, len(single.values)), label="start")
        self.write_single(single, start, count)

    @precondition(lambda self: self.singles)
    @rule(data=st.data(), count=st.integers(0, 3))
    def fork_table(self, data: st.DataObject, count: int) -> None:
        """Fork a table, then (as a diverging beam or sample does) write `count` tokens into the fork."""
        single = data.draw(st.sampled_from(self.singles))
        fork = Single(single.table.fork(), list(single.values))
        self.singles.append(fork)
        if count:
            start = data.draw(st.integers(max(0, len(fork.values) - 2), len(fork.values)), label="start")
            self.write_single(fork, start, count)

    @precondition(lambda self: self.singles)
    @rule(data=st.data())
    def truncate_table(self, data: st.DataObject) -> None:
        single = data.draw(st.sampled_from(self.singles))
        n = data.draw(st.integers(0, len(single.values)), label="keep")
        single.table.truncate(n)
        del single.values[n:]

    @precondition(lambda self: self.singles)
    @rule(data=st.data())
    def release_table(self, data: st.DataObject) -> None:
        single = data.draw(st.sampled_from(self.singles))
        single.table.release()
        self.singles.remove(single)

    # ------------------------------------------------------------ batches

    @rule(rows=st.integers(1, 3), n=st.integers(0, 5))
    def create_batch(self, rows: int, n: int) -> None:
        tables = BlockTables(self.pool)
        assert tables.slots_for(rows, 0, 0).numel() == 0  # sets the batch size, allocates nothing
        batch = Batch(tables, [[] for _ in range(rows)])
        self.batches.append(batch)
        if n:
            self.write_batch(batch, n)

    @precondition(lambda self: self.batches)
    @rule(data=st.data(), count=st.integers(1, 3))
    def extend_batch(self, data: st.DataObject, count: int) -> None:
        self.write_batch(data.draw(st.sampled_from(self.batches)), count)

    @precondition(lambda self: self.batches)
    @rule(data=st.data(), count=st.integers(0, 2))
    def reorder_batch(self, data: st.DataObject, count: int) -> None:
        """A beam-search step: rows become `rows[i] for i in indices`, then `count` tokens are appended."""
        batch = data.draw(st.sampled_from(self.batches))
        rows = len(batch.values)
        indices = data.draw(st.lists(st.integers(0, rows - 1), min_size=1, max_size=3), label="indices")
        batch.tables.reorder(indices)
        batch.values = [list(batch.values[i]) for i in indices]
        if count:
            self.write_batch(batch, count)

    @precondition(lambda self: self.batches)
    @rule(data=st.data())
    def truncate_batch(self, data: st.DataObject) -> None:
        batch = data.draw(st.sampled_from(self.batches))
        n = data.draw(st.integers(0, batch.tables.num_tokens), label="keep")
        batch.tables.truncate(n)
        for row_values in batch.values:
            del row_values[n:]

    @precondition(lambda self: self.batches)
    @rule(data=st.data())
    def release_batch(self, data: st.DataObject) -> None:
        batch = data.draw(st.sampled_from(self.batches))
        batch.tables.release()
        self.batches.remove(batch)

    # ------------------------------------------------------------ invariants

    @invariant()
    def ref_counts_match_references(self) -> None:
        references = Counter(block for table, _ in self.all_rows() for block in table.block_ids)
        assert self.pool.capacity <= CAP_BLOCKS
        for block in range(self.pool.capacity):
            assert self.pool.ref_count(block) == references[block], block
        assert set(references) <= set(range(self.pool.capacity))

    @invariant()
    def free_list_and_used_blocks_partition_capacity(self) -> None:
        free = self.pool.free_ids()
        assert len(free) == len(set(free))
        used = {block for table, _ in self.all_rows() for block in table.block_ids}
        assert set(free).isdisjoint(used)
        assert set(free) | used == set(range(self.pool.capacity))
        assert self.pool.num_used == len(used)
        assert self.pool.num_free == CAP_BLOCKS - len(used)

    @invariant()
    def tables_hold_exactly_their_tokens(self) -> None:
        for batch in self.batches:
            assert all(len(row_values) == batch.tables.num_tokens for row_values in batch.values)
        for table, values in self.all_rows():
            assert len(table.block_ids) == -(-len(values) // BLOCK)
            assert len(set(table.block_ids)) == len(table.block_ids)
            if values:
                keys, _ = self.pool.gather(0, torch.tensor([table.block_ids]), len(values))
                assert keys.reshape(-1).tolist() == values

    def teardown(self) -> None:
        for single in self.singles:
            single.table.release()
        for batch in self.batches:
            batch.tables.release()
        assert self.pool.num_used == 0
        assert sorted(self.pool.free_ids()) == list(range(self.pool.capacity))


PoolMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPoolMachine = PoolMachine.TestCase
