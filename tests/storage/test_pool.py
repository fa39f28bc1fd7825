"""Bookkeeping tests of the block pool: exact block ids, reference counts, caps, growth, data layout.

Every expected id below is worked out by hand from two rules of the pool: the free list is FIFO (a freed
block goes to the back, so it is reused last; under a byte cap the lowest free id goes first instead, see
`test_under_a_byte_cap_the_lowest_free_id_goes_first`) and growth appends new ids in increasing order. A comment
on each operation shows the free list after it.
"""

from __future__ import annotations

import pytest
import torch

from hf_kvgov.errors import PoolExhausted
from hf_kvgov.storage.pool import BlockPool, KVGeometry, PoolStats

TINY = KVGeometry(num_layers=1, num_kv_heads=1, head_dim=1)
# 2 (K and V) x 2 layers x 3 heads x 8 dims x 2 bytes (fp16) = 192 bytes per token.
FP16_GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=3, head_dim=8, dtype=torch.float16)


def ref_counts(pool: BlockPool) -> list[int]:
    return [pool.ref_count(block) for block in range(pool.capacity)]


# ---------------------------------------------------------------- exact ids


def test_allocate_hands_out_ids_in_order_and_grows_by_growth_blocks() -> None:
    pool = BlockPool(TINY, block_size=4, growth_blocks=4)
    assert pool.capacity == 0
    assert pool.allocate(3) == [0, 1, 2]  # grows 0..3; free [3]
    assert pool.capacity == 4
    assert pool.free_ids() == (3,)
    assert ref_counts(pool) == [1, 1, 1, 0]


def test_free_list_is_fifo_and_growth_appends() -> None:
    pool = BlockPool(TINY, block_size=4, growth_blocks=4)
    pool.allocate(3)  # free [3]
    pool.decref([1])  # free [3, 1]
    pool.decref([0])  # free [3, 1, 0]
    assert pool.free_ids() == (3, 1, 0)
    assert pool.allocate(2) == [3, 1]  # free [0]
    # One free block, two wanted: grows by max(1 short, 4 growth, 4 capacity) = 4 -> ids 4..7 appended.
    assert pool.allocate(2) == [0, 4]  # free [5, 6, 7]
    assert pool.capacity == 8
    assert pool.free_ids() == (5, 6, 7)
    assert pool.num_used == 5


def test_allocate_zero_and_negative() -> None:
    pool = BlockPool(TINY, block_size=4)
    assert pool.allocate(0) == []
    assert pool.capacity == 0
    with pytest.raises(ValueError, match="negative"):
        pool.allocate(-1)


def test_incref_shares_and_decref_frees_only_at_zero() -> None:
    pool = BlockPool(TINY, block_size=4, growth_blocks=4)
    pool.allocate(2)  # free [2, 3]
    pool.incref([1])  # a fork
    pool.incref([1])  # a second fork
    assert ref_counts(pool) == [1, 3, 0, 0]
    pool.decref([1])
    pool.decref([1])
    assert pool.free_ids() == (2, 3)
    pool.decref([1])  # free [2, 3, 1]
    assert pool.free_ids() == (2, 3, 1)
    assert ref_counts(pool) == [1, 0, 0, 0]


def test_double_free_raises() -> None:
    pool = BlockPool(TINY, block_size=4)
    (block,) = pool.allocate(1)
    pool.decref([block])
    with pytest.raises(ValueError, match="freed twice"):
        pool.decref([block])
    assert pool.free_ids().count(block) == 1


def test_incref_of_a_free_block_raises() -> None:
    pool = BlockPool(TINY, block_size=4, growth_blocks=2)
    pool.allocate(1)  # block 1 exists but is free
    with pytest.raises(ValueError, match="free"):
        pool.incref([1])
    assert ref_counts(pool) == [1, 0]


def test_failed_incref_changes_nothing() -> None:
    pool = BlockPool(TINY, block_size=4, growth_blocks=2)
    pool.allocate(1)  # block 0 in use, block 1 free
    with pytest.raises(ValueError):
        pool.incref([0, 1])
    assert ref_counts(pool) == [1, 0]


# ---------------------------------------------------------------- copy-on-write


def fill_block(pool: BlockPool, block: int, base: float) -> None:
    """Give every layer of `block` distinct K and V values derived from `base`."""
    for layer in range(pool.geometry.num_layers):
        shape = pool.keys[layer][block].shape
        numel = pool.keys[layer][block].numel()
        offset = base + 1000.0 * layer
        pool.keys[layer][block] = torch.arange(numel, dtype=torch.float32).reshape(shape) + offset
        pool.values[layer][block] = -(torch.arange(numel, dtype=torch.float32).reshape(shape) + offset)


def test_copy_on_write_of_unshared_block_returns_it() -> None:
    pool = BlockPool(TINY, block_size=4, growth_blocks=4)
    pool.allocate(2)
    assert pool.copy_on_write(1) == 1
    assert ref_counts(pool) == [1, 1, 0, 0]
    assert pool.free_ids() == (2, 3)


def test_copy_on_write_of_shared_block_copies_every_layer() -> None:
    geometry = KVGeometry(num_layers=3, num_kv_heads=2, head_dim=5)
    pool = BlockPool(geometry, block_size=4, growth_blocks=4)
    pool.allocate(2)  # free [2, 3]
    fill_block(pool, 1, base=10.0)
    pool.incref([1])  # shared by two tables
    originals = [(pool.keys[layer][1].clone(), pool.values[layer][1].clone()) for layer in range(3)]

    assert pool.copy_on_write(1) == 2  # first free block; free [3]
    assert ref_counts(pool) == [1, 1, 1, 0]
    assert pool.free_ids() == (3,)
    for layer, (keys, values) in enumerate(originals):
        torch.testing.assert_close(pool.keys[layer][2], keys, rtol=0, atol=0)
        torch.testing.assert_close(pool.values[layer][2], values, rtol=0, atol=0)
        # The copy is independent: writing it leaves the original intact.
        pool.keys[layer][2].fill_(-7.0)
        pool.values[layer][2].fill_(-7.0)
        torch.testing.assert_close(pool.keys[layer][1], keys, rtol=0, atol=0)
        torch.testing.assert_close(pool.values[layer][1], values, rtol=0, atol=0)


def test_copy_on_write_when_exhausted_keeps_sharing() -> None:
    pool = BlockPool(TINY, block_size=4, max_tokens=8)
    pool.allocate(2)
    pool.incref([0])
    with pytest.raises(PoolExhausted):
        pool.copy_on_write(0)
    assert ref_counts(pool) == [2, 1]


def test_copy_on_write_of_a_free_block_raises_and_allocates_nothing() -> None:
    pool = BlockPool(TINY, block_size=4, growth_blocks=4)
    pool.allocate(2)
    pool.decref([1])  # free [2, 3, 1]
    with pytest.raises(ValueError):
        pool.copy_on_write(1)
    assert pool.num_used == 1


# ---------------------------------------------------------------- caps


def test_geometry_bytes_per_token_matches_llama_13b_by_hand() -> None:
    # 2 x 40 layers x 40 heads x 128 dims x 2 bytes = 819,200 bytes (~0.82 MB) per token.
    llama13b = KVGeometry(num_layers=40, num_kv_heads=40, head_dim=128, dtype=torch.float16)
    assert llama13b.bytes_per_token == 819_200
    assert FP16_GEOMETRY.bytes_per_token == 192
    assert KVGeometry(num_layers=1, num_kv_heads=2, head_dim=4).bytes_per_token == 64  # fp32


class Holder:
    """Holds blocks on behalf of someone other than a sequence (as the prefix cache does)."""

    def __init__(self, pool: BlockPool, blocks: list[int]) -> None:
        self.pool = pool
        self.blocks = blocks
        self.asked: list[int] = []

    def reclaim(self, n: int) -> int:
        self.asked.append(n)
        victims, self.blocks = self.blocks[:n], self.blocks[n:]
        self.pool.decref(victims)
        return len(victims)


def test_reclaimer_frees_blocks_before_exhaustion() -> None:
    pool = BlockPool(TINY, block_size=4, max_tokens=16)  # cap 4 blocks
    holder = Holder(pool, pool.allocate(3))  # [0, 1, 2]; free [3]
    pool.add_reclaimer(holder.reclaim)
    assert pool.allocate(3) == [3, 0, 1]  # short 2: the holder frees 0 and 1 -> free [3, 0, 1]
    assert holder.asked == [2]
    assert holder.blocks == [2]
    assert pool.num_used == 4


def test_reclaimer_is_not_asked_while_the_pool_can_grow() -> None:
    pool = BlockPool(TINY, block_size=4, max_tokens=16, growth_blocks=1)
    holder = Holder(pool, pool.allocate(1))
    pool.add_reclaimer(holder.reclaim)
    assert pool.allocate(3) == [1, 2, 3]
    assert holder.asked == []


def test_reclaimers_asked_in_order_until_enough() -> None:
    pool = BlockPool(TINY, block_size=4, max_tokens=16)
    first = Holder(pool, pool.allocate(1))  # [0]
    second = Holder(pool, pool.allocate(2))  # [1, 2]
    third = Holder(pool, pool.allocate(1))  # [3]
    for holder in (first, second, third):
        pool.add_reclaimer(holder.reclaim)
    assert pool.allocate(3) == [0, 1, 2]  # first frees 1, second frees 2: third never asked
    assert (first.asked, second.asked, third.asked) == ([3], [2], [])


def test_reclaimer_that_cannot_free_enough_leads_to_exhaustion() -> None:
    pool = BlockPool(TINY, block_size=4, max_tokens=12)
    holder = Holder(pool, pool.allocate(1))  # [0]
    pool.allocate(2)  # held by sequences
    pool.add_reclaimer(holder.reclaim)
    with pytest.raises(PoolExhausted) as info:
        pool.allocate(2)
    assert (info.value.requested, info.value.free) == (2, 1)  # block 0 was reclaimed, one short
    assert pool.free_ids() == (0,)
    pool.remove_reclaimer(holder.reclaim)
    with pytest.raises(PoolExhausted):
        pool.allocate(2)
    assert holder.asked == [2]


def test_reclaimer_overstating_its_count_cannot_break_allocate() -> None:
    pool = BlockPool(TINY, block_size=4, max_tokens=8)
    holder = Holder(pool, pool.allocate(2))  # [0, 1]
    pool.incref([0])  # block 0 is also held by a sequence
    pool.add_reclaimer(holder.reclaim)
    with pytest.raises(PoolExhausted):
        pool.allocate(2)  # the holder drops 0 (still referenced) and 1 (freed) and reports 2
    assert pool.num_used == 1
    assert pool.free_ids() == (1,)


# ---------------------------------------------------------------- data


def test_write_then_gather_round_trip() -> None:
    geometry = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=4)
    pool = BlockPool(geometry, block_size=4)
    pool.allocate(6)
    table = torch.tensor([[5, 2], [0, 3]])
    batch, length = 2, 7
    # Slot of token t of row r, by hand: block table[r][t // 4], offset t % 4.
    slots = torch.tensor([int(table[r, t // 4]) * 4 + t % 4 for r in range(batch) for t in range(length)])
    generator = torch.Generator().manual_seed(0)
    untouched = [(pool.keys[layer][[1, 4]].clone(), pool.values[layer][[1, 4]].clone()) for layer in range(2)]
    data = {}
    for layer in range(2):
        keys = torch.randn(batch, 2, length, 4, generator=generator)  # [batch, heads, len, dim]
        values = torch.randn(batch, 2, length, 4, generator=generator)
        flat = (batch * length, 2, 4)
        pool.write(layer, slots, keys.transpose(1, 2).reshape(flat), values.transpose(1, 2).reshape(flat))
        data[layer] = (keys, values)
    for layer, (keys, values) in data.items():
        got_keys, got_values = pool.gather(layer, table, length)
        assert got_keys.shape == (batch, 2, length, 4)
        torch.testing.assert_close(got_keys, keys, rtol=0, atol=0)
        torch.testing.assert_close(got_values, values, rtol=0, atol=0)
        # Physical layout [block, offset, head, dim]: token 5 of row 0 is block 2, offset 1.
        torch.testing.assert_close(pool.keys[layer][2, 1], keys[0, :, 5], rtol=0, atol=0)
        torch.testing.assert_close(pool.values[layer][3, 2], values[1, :, 6], rtol=0, atol=0)
    for layer, (keys, values) in enumerate(untouched):  # blocks outside the table are not written
        torch.testing.assert_close(pool.keys[layer][[1, 4]], keys, rtol=0, atol=0)
        torch.testing.assert_close(pool.values[layer][[1, 4]], values, rtol=0, atol=0)


def test_write_casts_to_pool_dtype() -> None:
    pool = BlockPool(FP16_GEOMETRY, block_size=4)
    pool.allocate(1)
    layer0 = pool.keys[0].clone()
    keys = torch.full((2, 3, 8), 1.5, dtype=torch.float32)
    pool.write(1, torch.tensor([1, 2]), keys, -keys)
    assert pool.keys[1].dtype == torch.float16
    assert torch.all(pool.keys[1][0, 1:3] == 1.5)
    assert torch.all(pool.values[1][0, 1:3] == -1.5)
    assert torch.equal(pool.keys[0], layer0)  # other layers are not touched


# ---------------------------------------------------------------- stats


def test_stats_numbers_exact() -> None:
    # 768 bytes per block (see FP16_GEOMETRY); cap 40 tokens = 10 blocks.
    pool = BlockPool(FP16_GEOMETRY, block_size=4, max_tokens=40, growth_blocks=4)
    pool.allocate(3)
    assert pool.stats() == PoolStats(
        block_size=4,
        capacity_blocks=4,
        max_blocks=10,
        used_blocks=3,
        free_blocks=7,  # one on the free list + 6 the pool may still grow by
        bytes_reserved=4 * 768,
        bytes_used=3 * 768,
        bytes_per_block=768,
        bytes_charged=0,
        bytes_held=4 * 768,
        max_bytes=None,  # a token cap bounds blocks only
    )
    assert pool.cap_bytes == 10 * 768  # a token cap's blocks' worth
    pool.decref([0, 1])
    stats = pool.stats()
    assert (stats.used_blocks, stats.free_blocks, stats.bytes_used) == (1, 9, 768)


def test_stats_of_uncapped_pool() -> None:
    pool = BlockPool(TINY, block_size=2, growth_blocks=8)
    pool.allocate(5)
    stats = pool.stats()
    assert stats.max_blocks is None
    assert (stats.capacity_blocks, stats.used_blocks) == (8, 5)
    assert stats.bytes_per_block == 2 * 2 * 4  # K and V x 2 tokens x 4 bytes
    assert (stats.bytes_reserved, stats.bytes_used) == (8 * 16, 5 * 16)
    assert stats.free_blocks > 2**40  # unbounded room to grow
    assert pool.cap_bytes is None


# ---------------------------------------------------------------- bytes charged beside the blocks


def test_charges_count_against_a_byte_cap_and_shrink_the_room_to_grow() -> None:
    # 768 bytes per block; the cap is 10 blocks' worth.
    pool = BlockPool(FP16_GEOMETRY, block_size=4, max_bytes=10 * 768 + 5, growth_blocks=4)
    assert pool.cap_bytes == 10 * 768 + 5  # the bytes as given, not rounded to blocks
    pool.charge("a", 1000)  # 1000 bytes: two blocks' worth of the cap gone, 8 left (7680 - 1000 = 6680 // 768)
    assert (pool.bytes_charged, pool.charged("a"), pool.num_free) == (1000, 1000, 8)
    assert pool.allocate(8) == list(range(8))
    with pytest.raises(PoolExhausted):
        pool.allocate(1)
    assert pool.bytes_held() == 8 * 768 + 1000 <= 10 * 768
    pool.charge("a", 200)  # a smaller charge always fits
    assert pool.num_free == 1 and pool.stats().bytes_charged == 200 and pool.stats().bytes_held == 8 * 768 + 200


def test_a_charge_takes_the_bytes_of_free_blocks_at_the_end_and_nothing_else() -> None:
    pool = BlockPool(FP16_GEOMETRY, block_size=4, max_bytes=6 * 768, growth_blocks=6)
    pool.allocate(6)
    pool.decref([0, 4, 5])  # free [0, 4, 5]: blocks 4 and 5 are the tensors' end, block 0 is not
    pool.charge("a", 768 + 1)  # two blocks' bytes: the free tail gives them back
    assert pool.capacity == 4 and pool.keys[0].shape[0] == 4 and pool.free_ids() == (0,)
    assert pool.bytes_held() == 4 * 768 + 769
    with pytest.raises(PoolExhausted, match="bytes of slot metadata"):
        pool.charge("b", 768)  # block 0 is free, but not at the end: its bytes cannot be given back
    assert (pool.capacity, pool.charged("b"), pool.bytes_charged) == (4, 0, 769)  # nothing changed
    pool.charge("a", 0)  # ending a charge frees its bytes: the pool may grow again
    assert pool.bytes_charged == 0 and pool.num_free == 3


def test_a_charge_asks_the_reclaimers_when_the_tail_is_live() -> None:
    pool = BlockPool(FP16_GEOMETRY, block_size=4, max_bytes=4 * 768, growth_blocks=4)
    pool.allocate(4)
    pool.add_reclaimer(lambda n: pool.decref([3]) or 1)  # e.g. a prefix tree dropping a cached block
    pool.charge("a", 700)
    assert pool.capacity == 3 and pool.bytes_held() == 3 * 768 + 700


def test_under_a_byte_cap_the_lowest_free_id_goes_first() -> None:
    # The same frees as test_free_list_is_fifo_and_growth_appends, under a byte cap: reuse is lowest first, so the
    # live blocks stay low and free ones gather at the end, whose bytes a charge can take back.
    pool = BlockPool(TINY, block_size=4, growth_blocks=4, max_bytes=8 * 32)  # 32 bytes per block of TINY
    pool.allocate(3)  # free [3]
    pool.decref([1])  # free [1, 3]
    pool.decref([0])  # free [0, 1, 3]
    assert pool.free_ids() == (0, 1, 3)
    assert pool.allocate(2) == [0, 1]  # FIFO would hand out 3 and 1
    pool.decref([2])  # free [2, 3]: the two at the end
    pool.charge("a", 6 * 32)  # 4 blocks held + 6 blocks' worth is 2 over the cap of 8
    assert (pool.capacity, pool.free_ids()) == (2, ())  # blocks 2 and 3 gave their bytes back
    fifo = BlockPool(TINY, block_size=4, growth_blocks=4, max_tokens=32)  # a token cap: blocks only, FIFO
    fifo.allocate(3)
    fifo.decref([1])
    fifo.decref([0])
    assert fifo.allocate(2) == [3, 1]


def test_without_a_byte_cap_charges_are_counted_only() -> None:
    pool = BlockPool(TINY, block_size=2, max_tokens=4)
    pool.charge("a", 10**9)
    assert pool.num_free == 2 and pool.bytes_charged == 10**9 and pool.stats().max_bytes is None
    with pytest.raises(ValueError, match="non-negative int"):
        pool.charge("a", -1)


# ---------------------------------------------------------------- bad arguments


@pytest.mark.parametrize("block_size", [0, -4, 2.5, "16"])
def test_bad_block_size(block_size: object) -> None:
    with pytest.raises(ValueError, match="block_size"):
        BlockPool(TINY, block_size=block_size)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 64, "max_bytes": 4096}, "not both"),
        ({"max_tokens": 15}, "smaller than one block"),
        ({"max_tokens": 0}, "smaller than one block"),
        ({"max_bytes": 16 * 8 - 1}, "smaller than one block"),  # one block is 16 tokens x 8 bytes
        ({"growth_blocks": 0}, "growth_blocks"),
        ({"preallocate": True}, "needs a cap"),
    ],
)
def test_bad_pool_arguments(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BlockPool(TINY, block_size=16, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("field", ["num_layers", "num_kv_heads", "head_dim"])
@pytest.mark.parametrize("value", [0, -1, 2.0])
def test_geometry_rejects_non_positive_ints(field: str, value: object) -> None:
    arguments: dict[str, object] = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, field: value}
    with pytest.raises(ValueError, match=field):
        KVGeometry(**arguments)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.bool])
def test_geometry_rejects_non_float_dtype(dtype: torch.dtype) -> None:
    with pytest.raises(TypeError, match="floating-point"):
        KVGeometry(num_layers=1, num_kv_heads=1, head_dim=8, dtype=dtype)


def test_geometry_is_frozen() -> None:
    from dataclasses import FrozenInstanceError

    with pytest.raises(FrozenInstanceError):
        TINY.num_layers = 3  # type: ignore[misc]
