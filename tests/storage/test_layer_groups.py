"""Layer groups: how layers are grouped, the pool's shared memory per group position, and sliding tables that
free what left their window. Expected ids follow the pool's FIFO free list and in-order growth (test_pool.py)."""

from __future__ import annotations

import pytest
import torch

from hf_kvgov.errors import PoolExhausted
from hf_kvgov.storage.block_table import BlockTables
from hf_kvgov.storage.layer_groups import LayerGroup, check_groups, layer_groups, single_group
from hf_kvgov.storage.pool import BlockPool, KVGeometry

GEMMA3_270M = [None if layer % 6 == 5 else 512 for layer in range(18)]  # layer_types: 5 sliding, then 1 full


def test_gemma3_layers_make_six_groups_of_three() -> None:
    groups = layer_groups(GEMMA3_270M)
    assert [group.layers for group in groups] == [
        (0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13), (14, 15, 16), (5, 11, 17),
    ]  # fmt: skip
    assert [group.window for group in groups] == [512] * 5 + [None]


def test_group_size_is_the_gcd_of_the_kinds_counts() -> None:
    assert layer_groups([None] * 4) == single_group(4)
    assert layer_groups([128] * 3) == (LayerGroup((0, 1, 2), 128),)
    # gpt-oss alternates sliding (128) and full layers: 12 of each in 24 layers -> two groups of 12.
    alternating = [128 if layer % 2 == 0 else None for layer in range(24)]
    assert [len(group.layers) for group in layer_groups(alternating)] == [12, 12]
    # 3 sliding and 2 full: gcd 1, a group per layer.
    assert len(layer_groups([64, 64, None, 64, None])) == 5


def test_bad_windows_and_groups_are_refused() -> None:
    with pytest.raises(ValueError, match="Layer 1's sliding window must be a positive int"):
        layer_groups([None, 0])
    with pytest.raises(ValueError, match="cover each of the 3 layers exactly once, in groups of one size"):
        check_groups([LayerGroup((0, 1)), LayerGroup((2,))], 3)
    with pytest.raises(ValueError, match="cover each of the 2 layers"):
        check_groups([LayerGroup((0,)), LayerGroup((0,))], 2)


def test_first_needed_follows_the_window() -> None:
    assert LayerGroup((0,), 4).first_needed(10) == 7  # a query at 10 sees 7, 8, 9, 10
    assert LayerGroup((0,), 4).first_needed(2) == 0
    assert LayerGroup((0,), None).first_needed(10) == 0


# ---------------------------------------------------------------- the pool

GEOMETRY = KVGeometry(num_layers=4, num_kv_heads=1, head_dim=2, dtype=torch.float16)
GROUPS = (LayerGroup((0, 2), 6), LayerGroup((1, 3), None))  # layers 0 and 1 share position 0, 2 and 3 position 1


def test_a_block_holds_one_groups_layers_and_positions_share_tensors() -> None:
    pool = BlockPool(GEOMETRY, block_size=4, groups=GROUPS)
    # 2 (K, V) x 2 layers of a group x 1 head x 2 dims x 2 bytes x 4 tokens: half the all-layer block.
    assert pool.bytes_per_block == 64 == BlockPool(GEOMETRY, block_size=4).bytes_per_block // 2
    pool.allocate(1)
    assert pool.keys[0] is pool.keys[1] and pool.keys[2] is pool.keys[3] and pool.keys[0] is not pool.keys[2]
    assert [pool.group_of(layer) for layer in range(4)] == [0, 1, 0, 1]
    pool.allocate(70)  # growth replaces the tensors: the aliases follow
    assert pool.keys[0] is pool.keys[1] and pool.keys[0].shape[0] == pool.capacity


def test_copy_on_write_copies_every_position_once() -> None:
    pool = BlockPool(GEOMETRY, block_size=2, groups=GROUPS)
    (block,) = pool.allocate(1)
    for layer in range(4):  # layers 0 and 1 write the same memory: the later write wins, as for any block id
        pool.write(layer, torch.tensor([2 * block]), torch.full((1, 1, 2), float(layer)), torch.zeros(1, 1, 2))
    pool.incref([block])
    copy = pool.copy_on_write(block)
    assert copy != block
    assert pool.keys[0][copy, 0].tolist() == [[1.0, 1.0]] and pool.keys[2][copy, 0].tolist() == [[3.0, 3.0]]


def test_the_cap_counts_the_blocks_of_every_group() -> None:
    pool = BlockPool(GEOMETRY, block_size=4, groups=GROUPS, max_bytes=3 * 64)
    sliding, full = BlockTables(pool, GROUPS[0]), BlockTables(pool, GROUPS[1])
    full.slots_for(1, 0, 8)  # two blocks
    with pytest.raises(PoolExhausted, match="2 block"):
        sliding.slots_for(1, 0, 8)
    assert pool.num_used == 2 and sliding.rows[0].block_ids == []


def test_groups_of_one_position_must_share_a_device() -> None:
    split = KVGeometry(4, 1, 2, layer_devices=("cpu", "meta", "cpu", "meta"))
    with pytest.raises(ValueError, match="Layers 0 and 1 share block memory"):
        BlockPool(split, block_size=4, groups=GROUPS)


# ---------------------------------------------------------------- sliding tables

WINDOW_GROUP = LayerGroup((0, 1), 6)


def sliding_tables(block_size: int = 4) -> tuple[BlockPool, BlockTables]:
    pool = BlockPool(KVGeometry(2, 1, 2), block_size=block_size, growth_blocks=16, groups=(WINDOW_GROUP,))
    return pool, BlockTables(pool, WINDOW_GROUP)


def test_blocks_that_left_the_window_go_back_to_the_pool() -> None:
    pool, tables = sliding_tables()
    tables.slots_for(2, 0, 12)  # rows: [0 1 2] [3 4 5]
    assert [row.block_ids for row in tables.rows] == [[0, 1, 2], [3, 4, 5]]
    # Queries at 12.. see keys from 12 - 6 + 1 = 7 on: block 1 (tokens 4-7) stays, block 0 goes.
    tables.slots_for(2, 12, 1)  # new blocks 6 and 7
    assert tables.first_block == 1 and tables.live_tensor()[1] == 4
    assert [row.live_ids for row in tables.rows] == [[1, 2, 6], [4, 5, 7]]
    assert pool.free_ids()[-2:] == (0, 3) and tables.blocks_held() == 6
    assert tables.live_tensor()[0].tolist() == [[1, 2, 6], [4, 5, 7]]
    # At 14 the window starts at 9: block 1 (4-7) goes too.
    tables.slots_for(2, 14, 1)
    assert [row.live_ids for row in tables.rows] == [[2, 6], [5, 7]] and tables.first_block == 2


def test_a_sliding_row_holds_at_most_window_plus_a_block() -> None:
    pool, tables = sliding_tables()
    for position in range(200):
        tables.slots_for(1, position, 1)
        live = len(tables.rows[0].live_ids) * pool.block_size
        assert live <= WINDOW_GROUP.window + 2 * pool.block_size - 1  # w - 1 seen + the query + block rounding
    assert pool.num_used == len(tables.rows[0].live_ids) <= 3


def test_forks_share_only_live_blocks_and_release_frees_everything() -> None:
    pool, tables = sliding_tables()
    tables.slots_for(1, 0, 16)
    tables.slots_for(1, 16, 1)  # window from 11: block 0 and 1 (0-7) freed
    tables.reorder([0, 0])
    assert [row.live_ids for row in tables.rows] == [[2, 3, 4]] * 2
    assert [pool.ref_count(block) for block in (2, 3, 4)] == [2, 2, 2]
    tables.release()
    assert pool.num_used == 0 and tables.first_block == 0


def test_crop_keeps_what_the_window_kept_and_refuses_to_go_further_back() -> None:
    _, tables = sliding_tables()
    tables.slots_for(1, 0, 20)
    tables.slots_for(1, 20, 4)  # a step of 4 candidates; window from 15: blocks 0-2 (0-11) freed
    assert tables.first_block == 3
    tables.truncate(21)  # dropping 3 candidates of the latest step needs nothing freed (window from 16)
    assert tables.rows[0].live_ids == [3, 4, 5]
    with pytest.raises(ValueError, match="already freed the tokens before 12"):
        tables.truncate(15)  # queries at 15 would see token 10 again
    assert tables.rows[0].live_ids == [3, 4, 5] and tables.num_tokens == 21
