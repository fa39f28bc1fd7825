"""How the pool grows: headroom after the first allocation, zeroed new blocks, contents kept."""

from __future__ import annotations

import torch

from hf_kvgov.storage.pool import BlockPool, KVGeometry

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
