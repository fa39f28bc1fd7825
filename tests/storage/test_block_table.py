"""Bookkeeping tests of block tables: exact block ids and slots, copy-on-write, truncation, no leaks.

Expected ids are worked out by hand: the pool hands out ids in increasing order and reuses freed ids
last (FIFO). Block size is 4 throughout, so token t lives in block `t // 4` of its table, offset `t % 4`.
"""

from __future__ import annotations

import pytest
import torch

from hf_kvgov.errors import PoolExhausted
from hf_kvgov.storage.block_table import BlockTable, BlockTables
from hf_kvgov.storage.pool import BlockPool, KVGeometry

TINY = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=1)


def make_pool(max_tokens: int | None = None, growth_blocks: int = 64) -> BlockPool:
    return BlockPool(TINY, block_size=4, max_tokens=max_tokens, growth_blocks=growth_blocks)


def ref_counts(pool: BlockPool) -> list[int]:
    return [pool.ref_count(block) for block in range(pool.capacity)]


def write_tokens(pool: BlockPool, slots: torch.Tensor, values: list[float]) -> None:
    """Write one scalar per slot into K (and its negative into V) of every layer."""
    data = torch.tensor(values).reshape(-1, 1, 1)
    for layer in range(pool.geometry.num_layers):
        pool.write(layer, slots, data + layer, -(data + layer))


def read_tokens(pool: BlockPool, block_ids: list[int], length: int, layer: int = 0) -> list[float]:
    keys, values = pool.gather(layer, torch.tensor([block_ids]), length)
    assert torch.equal(values, -keys)
    return (keys.reshape(-1) - layer).tolist()


def table_slots(table: BlockTable, start: int, end: int) -> torch.Tensor:
    return torch.tensor([table.block_ids[t // 4] * 4 + t % 4 for t in range(start, end)])


# ---------------------------------------------------------------- BlockTable


@pytest.mark.parametrize(("end", "blocks"), [(0, 0), (1, 1), (4, 1), (5, 2), (8, 2), (9, 3), (16, 4)])
def test_prepare_write_allocates_ceil_end_over_block_size(end: int, blocks: int) -> None:
    pool = make_pool()
    table = BlockTable(pool)
    assert table.prepare_write(0, end) is (blocks > 0)
    assert table.block_ids == list(range(blocks))
    assert pool.num_used == blocks


def test_prepare_write_reports_change_only_when_ids_change() -> None:
    pool = make_pool()
    table = BlockTable(pool)
    assert table.prepare_write(0, 9) is True  # [0, 1, 2]
    assert table.prepare_write(9, 12) is False  # block 2 already holds tokens 8..11
    assert table.prepare_write(12, 13) is True  # [0, 1, 2, 3]
    assert table.block_ids == [0, 1, 2, 3]


def test_fork_shares_every_block() -> None:
    pool = make_pool()
    table = BlockTable(pool)
    table.prepare_write(0, 10)  # [0, 1, 2]
    fork = table.fork()
    assert fork.block_ids == [0, 1, 2]
    assert fork.block_ids is not table.block_ids
    assert ref_counts(pool)[:3] == [2, 2, 2]
    assert pool.num_used == 3


def test_write_into_forked_partial_block_copies_only_that_block() -> None:
    pool = make_pool(growth_blocks=8)
    table = BlockTable(pool)
    table.prepare_write(0, 10)  # [0, 1, 2]: block 2 holds tokens 8, 9 and has room for 2 more
    write_tokens(pool, table_slots(table, 0, 10), [float(t) for t in range(10)])
    fork = table.fork()

    assert fork.prepare_write(10, 11) is True
    assert fork.block_ids == [0, 1, 3]  # block 2 copied into the first free block, 3
    assert table.block_ids == [0, 1, 2]
    assert ref_counts(pool)[:4] == [2, 2, 1, 1]  # full blocks 0 and 1 stay shared
    write_tokens(pool, table_slots(fork, 10, 11), [100.0])
    for layer in range(2):
        assert read_tokens(pool, fork.block_ids, 11, layer) == [*range(10), 100.0]
        assert read_tokens(pool, table.block_ids, 10, layer) == list(range(10))

    # The original is now the only holder of block 2: it writes in place, no copy.
    assert table.prepare_write(10, 11) is False
    assert table.block_ids == [0, 1, 2]
    assert pool.num_used == 4


def test_write_across_forked_partial_block_copies_it_and_appends() -> None:
    pool = make_pool(growth_blocks=8)
    table = BlockTable(pool)
    table.prepare_write(0, 6)  # [0, 1]
    fork = table.fork()
    assert fork.prepare_write(6, 13) is True  # copy block 1 -> 2, then new blocks 3 and 4
    assert fork.block_ids == [0, 2, 3, 4]
    assert table.block_ids == [0, 1]
    assert ref_counts(pool)[:5] == [2, 1, 1, 1, 1]


def test_appending_after_a_full_shared_block_copies_nothing() -> None:
    pool = make_pool(growth_blocks=8)
    table = BlockTable(pool)
    table.prepare_write(0, 8)  # [0, 1], both full
    fork = table.fork()
    assert fork.prepare_write(8, 9) is True
    assert fork.block_ids == [0, 1, 2]
    assert ref_counts(pool)[:3] == [2, 2, 1]


def test_rewriting_a_shared_full_block_copies_it() -> None:
    pool = make_pool(growth_blocks=8)
    table = BlockTable(pool)
    table.prepare_write(0, 12)  # [0, 1, 2]
    fork = table.fork()
    fork.prepare_write(5, 6)  # rewrite token 5 (block 1), e.g. a rolled-back speculative token
    assert fork.block_ids == [0, 3, 2]
    assert ref_counts(pool)[:4] == [2, 1, 2, 1]


def test_truncate_frees_exactly_the_blocks_past_the_new_length() -> None:
    pool = make_pool(growth_blocks=8)
    table = BlockTable(pool)
    table.prepare_write(0, 16)  # [0, 1, 2, 3]; free [4 .. 7]
    table.truncate(9)  # tokens 0..8 need 3 blocks
    assert table.block_ids == [0, 1, 2]
    assert pool.free_ids() == (4, 5, 6, 7, 3)
    table.truncate(8)
    assert table.block_ids == [0, 1]
    assert pool.free_ids() == (4, 5, 6, 7, 3, 2)
    table.truncate(8)  # no-op
    table.truncate(100)  # longer than the table: no-op
    assert table.block_ids == [0, 1]
    table.truncate(0)
    assert table.block_ids == []
    assert pool.num_used == 0


def test_truncate_of_shared_blocks_only_drops_a_reference() -> None:
    pool = make_pool()
    table = BlockTable(pool)
    table.prepare_write(0, 12)
    fork = table.fork()
    fork.truncate(4)
    assert fork.block_ids == [0]
    assert ref_counts(pool)[:3] == [2, 1, 1]
    assert pool.num_used == 3


def test_release_returns_everything() -> None:
    pool = make_pool()
    table = BlockTable(pool)
    table.prepare_write(0, 10)
    fork = table.fork()
    fork.prepare_write(10, 20)  # [0, 1, 3, 4, 5]: block 2 copied into 3, then new blocks 4 and 5
    table.release()  # frees block 2; 0 and 1 are still the fork's
    assert table.block_ids == []
    assert pool.num_used == 5
    fork.release()
    assert pool.num_used == 0
    assert sorted(pool.free_ids()) == list(range(pool.capacity))


# ---------------------------------------------------------------- BlockTables


def test_slots_for_hand_worked_example() -> None:
    pool = make_pool()
    tables = BlockTables(pool)
    # Row 0 gets blocks 0, 1; row 1 gets 2, 3. Slot = block * 4 + offset.
    assert tables.slots_for(2, 0, 6).tolist() == [0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 12, 13]
    assert tables.num_tokens == 6
    # Tokens 6, 7 finish blocks 1 and 3; token 8 opens block 4 (row 0) and 5 (row 1).
    assert tables.slots_for(2, 6, 3).tolist() == [6, 7, 16, 14, 15, 20]
    assert tables.tensor().tolist() == [[0, 1, 4], [2, 3, 5]]
    assert tables.num_tokens == 9
    assert tables.batch_size == 2
    assert tables.blocks_held() == 6
    # Asking again for the same range (the next layer) returns the same slots and allocates nothing.
    assert tables.slots_for(2, 6, 3).tolist() == [6, 7, 16, 14, 15, 20]
    assert pool.num_used == 6


def test_tensor_pads_short_rows_and_lives_on_pool_device() -> None:
    pool = make_pool()
    tables = BlockTables(pool)
    tables.rows = [BlockTable(pool, pool.allocate(2)), BlockTable(pool, pool.allocate(1))]
    tensor = tables.tensor()
    assert tensor.dtype == torch.long
    assert tensor.device == TINY.device
    assert tensor.tolist() == [[0, 1], [2, 0]]


def test_reorder_like_beam_search_then_write_copies_on_write() -> None:
    pool = make_pool()
    tables = BlockTables(pool)
    slots = tables.slots_for(2, 0, 9)
    assert tables.tensor().tolist() == [[0, 1, 2], [3, 4, 5]]
    write_tokens(pool, slots, [float(t) for t in range(9)] + [float(100 + t) for t in range(9)])

    tables.reorder([0, 0, 1])
    assert [row.block_ids for row in tables.rows] == [[0, 1, 2], [0, 1, 2], [3, 4, 5]]
    assert ref_counts(pool)[:6] == [2, 2, 2, 1, 1, 1]
    assert tables.num_tokens == 9
    assert tables.blocks_held() == 6

    # Token 9 lands in block index 2, offset 1. Row 0 copies shared block 2 into 6; row 1 is then the
    # only holder of block 2 and writes in place; row 2 owns block 5.
    slots = tables.slots_for(3, 9, 1)
    assert slots.tolist() == [6 * 4 + 1, 2 * 4 + 1, 5 * 4 + 1]
    assert tables.tensor().tolist() == [[0, 1, 6], [0, 1, 2], [3, 4, 5]]
    assert ref_counts(pool)[:7] == [2, 2, 1, 1, 1, 1, 1]
    write_tokens(pool, slots, [9.0, 9.5, 109.0])
    assert read_tokens(pool, tables.rows[0].block_ids, 10) == [*range(9), 9.0]
    assert read_tokens(pool, tables.rows[1].block_ids, 10) == [*range(9), 9.5]
    assert read_tokens(pool, tables.rows[2].block_ids, 10) == [*range(100, 109), 109.0]

    tables.release()
    assert tables.batch_size == 0
    assert tables.num_tokens == 0
    assert pool.num_used == 0


def test_reorder_that_drops_rows_frees_their_blocks() -> None:
    pool = make_pool()
    tables = BlockTables(pool)
    tables.slots_for(3, 0, 5)  # rows [0, 1], [2, 3], [4, 5]
    tables.reorder([2, 2])
    assert [row.block_ids for row in tables.rows] == [[4, 5], [4, 5]]
    assert pool.num_used == 2
    assert ref_counts(pool)[4:6] == [2, 2]
    tables.release()
    assert pool.num_used == 0


def test_batch_truncate_then_write_reuses_freed_blocks_last() -> None:
    pool = make_pool(growth_blocks=8)
    tables = BlockTables(pool)
    tables.slots_for(2, 0, 9)  # [[0, 1, 2], [3, 4, 5]]; free [6, 7]
    tables.truncate(5)  # free [6, 7, 2, 5]
    assert [row.block_ids for row in tables.rows] == [[0, 1], [3, 4]]
    assert tables.num_tokens == 5
    assert pool.free_ids() == (6, 7, 2, 5)
    assert tables.slots_for(2, 5, 4).tolist() == [5, 6, 7, 6 * 4, 17, 18, 19, 7 * 4]


def test_batch_size_mismatch_raises() -> None:
    pool = make_pool()
    tables = BlockTables(pool)
    tables.slots_for(2, 0, 3)
    with pytest.raises(ValueError, match="holds 2 sequences but received a batch of 3"):
        tables.slots_for(3, 3, 1)
    assert pool.num_used == 2
    tables.release()  # free list [2 .. 63, 0, 1]: the freed blocks are reused last
    assert tables.slots_for(3, 0, 1).tolist() == [2 * 4, 3 * 4, 4 * 4]  # a fresh batch after release


# ---------------------------------------------------------------- known defects


def test_prepare_write_is_all_or_nothing_on_exhaustion() -> None:
    pool = make_pool(max_tokens=12)  # cap 3 blocks
    table = BlockTable(pool)
    table.prepare_write(0, 6)  # [0, 1]
    fork = table.fork()
    with pytest.raises(PoolExhausted):
        fork.prepare_write(6, 10)  # needs a copy of block 1 and one new block: 2 of the 1 left
    assert fork.block_ids == [0, 1]
    assert pool.num_used == 2


def test_slots_for_is_all_or_nothing_on_exhaustion() -> None:
    pool = make_pool(max_tokens=12)  # cap 3 blocks
    tables = BlockTables(pool)
    tables.slots_for(2, 0, 4)  # [[0], [1]]
    with pytest.raises(PoolExhausted):
        tables.slots_for(2, 4, 1)  # each row needs a block; only one is left
    assert pool.num_used == 2
    assert [row.block_ids for row in tables.rows] == [[0], [1]]


def test_slots_after_exhaustion_use_current_block_ids() -> None:
    pool = make_pool(max_tokens=12)  # cap 3 blocks
    tables = BlockTables(pool)
    tables.slots_for(1, 0, 6)  # [[0, 1]]
    tables.reorder([0, 0])  # [[0, 1], [0, 1]]; one free block left
    tables.tensor()  # the attention path reads the table, caching it
    with pytest.raises(PoolExhausted):
        tables.slots_for(2, 6, 4)  # row 0 copies block 1 -> 2, then cannot get a 3rd block
    # A shorter retry fits in the blocks the rows now hold: row 0 writes its copy 2, row 1 block 1.
    assert tables.slots_for(2, 6, 1).tolist() == [2 * 4 + 2, 1 * 4 + 2]


def test_reorder_with_a_bad_index_leaks_nothing() -> None:
    pool = make_pool()
    tables = BlockTables(pool)
    tables.slots_for(2, 0, 4)  # [[0], [1]]
    with pytest.raises((ValueError, IndexError)):
        tables.reorder([0, 5])
    assert ref_counts(pool)[:2] == [1, 1]
