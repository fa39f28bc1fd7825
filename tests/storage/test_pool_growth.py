"""How the pool grows and where it stops: caps, PoolExhausted, growth steps and headroom, preallocation,
zeroed new blocks, contents kept."""

from __future__ import annotations

import pytest
import torch

from hf_kvgov.errors import KVGovError, PoolExhausted
from hf_kvgov.storage.pool import BlockPool, KVGeometry
from tests.storage.test_pool import FP16_GEOMETRY, TINY, ref_counts

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)


def test_first_growth_leaves_an_eighth_of_headroom_for_the_decode_steps() -> None:
    # A prefill of 8 rows x 10 blocks, then one block per row per decode step: the 80 + 10 blocks
    # reserved at once serve the next decode step without copying the pool.
    pool = BlockPool(GEOMETRY, block_size=4, growth_blocks=1)
    pool.allocate(80)
    assert pool.capacity == 90
    pool.allocate(8)
    assert pool.capacity == 90
    pool.allocate(8)  # 2 free, 6 short: now it doubles (max(6, 1, 90) = 90 more)
    assert pool.capacity == 180


def test_growth_keeps_written_blocks_and_zeroes_new_ones() -> None:
    pool = BlockPool(GEOMETRY, block_size=4, growth_blocks=1)
    first = pool.allocate(3)
    for layer in range(GEOMETRY.num_layers):
        pool.keys[layer][first] = float(layer + 1)
        pool.values[layer][first] = -float(layer + 1)
    capacity = pool.capacity
    pool.allocate(pool.capacity)  # more than is free: the pool grows
    assert pool.capacity > capacity
    for layer in range(GEOMETRY.num_layers):
        assert bool((pool.keys[layer][first] == layer + 1).all())
        assert bool((pool.values[layer][first] == -(layer + 1)).all())
        assert bool((pool.keys[layer][capacity:] == 0).all()) and bool((pool.values[layer][capacity:] == 0).all())


def test_cap_from_max_tokens_rounds_down_to_whole_blocks() -> None:
    pool = BlockPool(TINY, block_size=4, max_tokens=11)  # 11 tokens hold 2 whole blocks
    assert pool.max_blocks == 2
    assert pool.num_free == 2
    assert pool.allocate(2) == [0, 1]
    assert pool.capacity == 2  # growth stops at the cap, not at growth_blocks
    with pytest.raises(PoolExhausted):
        pool.allocate(1)


def test_cap_from_max_bytes_uses_bytes_per_block() -> None:
    # 192 bytes/token x 4 tokens = 768 bytes/block; 2,303 bytes hold 2 blocks (3 need 2,304).
    pool = BlockPool(FP16_GEOMETRY, block_size=4, max_bytes=2303)
    assert pool.bytes_per_block == 768
    assert pool.max_blocks == 2
    assert BlockPool(FP16_GEOMETRY, block_size=4, max_bytes=2304).max_blocks == 3
    assert BlockPool(FP16_GEOMETRY, block_size=4, max_bytes=768).max_blocks == 1


def test_pool_exhausted_reports_numbers_and_allocates_nothing() -> None:
    pool = BlockPool(TINY, block_size=4, max_tokens=16, growth_blocks=1)  # cap 4 blocks
    assert pool.allocate(1) == [0]  # capacity 1, room for 3 more
    assert pool.num_free == 3
    with pytest.raises(PoolExhausted) as info:
        pool.allocate(5)
    error = info.value
    assert (error.requested, error.free, error.capacity, error.block_size) == (5, 3, 4, 4)
    assert "5 block(s)" in str(error)
    assert "only 3 of its 4 blocks are free" in str(error)
    assert pool.num_free == 3
    assert pool.num_used == 1
    assert ref_counts(pool)[0] == 1
    assert all(count == 0 for count in ref_counts(pool)[1:])
    assert pool.allocate(3) == [1, 2, 3]  # the blocks are still there to be had


def test_pool_exhausted_is_a_kvgov_error() -> None:

    pool = BlockPool(TINY, block_size=4, max_tokens=4)
    with pytest.raises(KVGovError):
        pool.allocate(2)


def test_growth_at_least_doubles_capacity() -> None:
    pool = BlockPool(TINY, block_size=4, growth_blocks=1)
    capacities: list[int] = []
    for _ in range(100):
        pool.allocate(1)
        if not capacities or capacities[-1] != pool.capacity:
            capacities.append(pool.capacity)
    # growth adds max(short, growth_blocks=1, capacity): 1, then doubling.
    assert capacities == [1, 2, 4, 8, 16, 32, 64, 128]
    pool.allocate(200)  # 28 free, 172 short: grows by max(172, 1, 128) = 172
    assert pool.capacity == 300


def test_preallocate_reserves_the_whole_cap() -> None:
    pool = BlockPool(FP16_GEOMETRY, block_size=4, max_tokens=32, preallocate=True)
    assert pool.capacity == 8
    assert pool.free_ids() == tuple(range(8))
    assert pool.num_used == 0
    for layer in range(2):
        assert pool.keys[layer].shape == (8, 4, 3, 8)
        assert pool.values[layer].dtype == torch.float16
    assert pool.allocate(8) == list(range(8))
    assert pool.capacity == 8


# ---------------------------------------------------------------- reclaimers


def test_pool_grown_under_inference_mode_is_writable_outside_it() -> None:
    pool = BlockPool(KVGeometry(num_layers=2, num_kv_heads=1, head_dim=4), block_size=2)
    with torch.inference_mode():
        ids = pool.allocate(3)
    pool.zero_blocks(ids)
    pool.write(1, torch.tensor([0, 5]), torch.ones(2, 1, 4), torch.full((2, 1, 4), 2.0))
    assert pool.keys[1].view(-1, 1, 4)[5].tolist() == [[1.0, 1.0, 1.0, 1.0]]
    assert pool.values[1].view(-1, 1, 4)[0].tolist() == [[2.0, 2.0, 2.0, 2.0]]
