"""The byte cap of a QuantizedBlockPool, by hand: full-precision blocks and sealed blocks share `max_bytes`.

Geometry: one layer, one KV head, head_dim 4, float32, block_size 2, sealed as int8. A full-precision
block is 2 (K, V) x 2 tokens x 4 dims x 4 bytes = 64 bytes; a sealed one 40 (tests/quantized/
test_sealed_store.py works the int8 layout out). Expected numbers follow the pool's rules: bytes held =
64 x capacity + 40 x sealed capacity <= max_bytes; a part grows by its step (full precision: max(short +
short // 8 on the first growth, growth_blocks, capacity); sealed: max(short, sealed_growth_blocks,
capacity)) clamped to the budget left; when the budget left is short, the other part gives back free
blocks at the end of its tensors, counting those the operation itself frees. A comment shows the bytes
held after each step.
"""

from __future__ import annotations

import pytest
import torch

from hf_kvgov.codecs import Int8Codec
from hf_kvgov.errors import PoolExhausted
from hf_kvgov.storage.pool import KVGeometry
from hf_kvgov.storage.quantized_pool import QuantizedBlockPool, QuantizedPoolStats
from hf_kvgov.storage.sealed_formats import CodecFormat, RawFormat
from hf_kvgov.storage.sealed_store import SealedStats

GEOMETRY = KVGeometry(num_layers=1, num_kv_heads=1, head_dim=4)
INT8 = CodecFormat(Int8Codec())
FULL, SEALED = 64, 40


def make_pool(
    max_bytes: int | None, growth: int = 2, sealed_growth: int = 2, max_tokens: int | None = None
) -> QuantizedBlockPool:
    pool = QuantizedBlockPool(
        GEOMETRY, [INT8], block_size=2, max_tokens=max_tokens, max_bytes=max_bytes, growth_blocks=growth,
        sealed_growth_blocks=sealed_growth,
    )  # fmt: skip
    assert (pool.bytes_per_block, pool.sealed.bytes_per_block) == (FULL, SEALED)
    return pool


def tensor_bytes(pool: QuantizedBlockPool) -> int:
    """Bytes of every distinct tensor the pool holds, measured from the tensors themselves."""
    tensors = [*pool.keys, *pool.values, *(t for layer in pool.sealed.pieces for t in layer.values())]
    distinct = {id(t): t for t in tensors}.values()
    for t in distinct:  # a tensor is its whole storage: no view into a larger one
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return sum(t.numel() * t.element_size() for t in distinct)


def held(pool: QuantizedBlockPool) -> int:
    measured = tensor_bytes(pool)
    assert pool.bytes_held() == pool.stats().bytes_held == measured
    assert pool.max_bytes is None or measured <= pool.max_bytes
    return measured


def fill(pool: QuantizedBlockPool, seed: int = 0) -> None:
    generator = torch.Generator().manual_seed(seed)
    pool.keys[0].copy_(torch.randn(pool.keys[0].shape, generator=generator))
    pool.values[0].copy_(torch.randn(pool.values[0].shape, generator=generator))


def int8_round_trip(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return INT8.decode(INT8.encode(keys, values), torch.float32)


def state(pool: QuantizedBlockPool) -> tuple[object, ...]:
    return (
        pool.free_ids(),
        pool.sealed.free_ids(),
        [pool.ref_count(b) for b in range(pool.capacity)],
        [pool.sealed.ref_count(s) for s in range(pool.sealed.capacity)],
        pool.keys[0].clone(),
        pool.values[0].clone(),
        {name: t.clone() for name, t in pool.sealed.pieces[0].items()},
    )


def assert_same_state(before: tuple[object, ...], after: tuple[object, ...]) -> None:
    for old, new in zip(before, after, strict=True):
        if isinstance(old, torch.Tensor):
            assert isinstance(new, torch.Tensor) and torch.equal(old, new)
        elif isinstance(old, dict):
            assert isinstance(new, dict) and old.keys() == new.keys()
            assert all(torch.equal(old[name], new[name]) for name in old)
        else:
            assert old == new


# ---------------------------------------------------------------- one budget for both parts


def test_max_bytes_bounds_full_precision_and_sealed_blocks_together() -> None:
    pool = make_pool(max_bytes=320)
    assert pool.max_blocks == 5  # the most full-precision blocks ever: 320 // 64
    assert pool.allocate(3) == [0, 1, 2]  # step max(3, 2, 0) = 3: 192
    assert held(pool) == 192
    assert pool.seal([0]) == [-1]  # sealed step max(1, 2, 0) = 2, 128 left hold 3: 192 + 80
    assert held(pool) == 272
    assert pool.seal([1]) == [-2]  # a free sealed slot: no growth
    assert pool.seal([2]) == [-3]  # step max(1, 2, 2) = 2 clamped to the 48 bytes left: 1 block, 312
    assert held(pool) == 312 and pool.sealed.capacity == 3
    assert pool.free_ids() == (0, 1, 2)  # sealing freed them, but their bytes stay held
    assert pool.num_free == 3  # 8 bytes left: no room to grow
    assert pool.stats() == QuantizedPoolStats(
        block_size=2,
        capacity_blocks=3,
        max_blocks=5,
        used_blocks=0,
        free_blocks=3,
        bytes_reserved=192,
        bytes_used=0,
        bytes_per_block=64,
        bytes_charged=0,
        bytes_held=312,
        max_bytes=320,
        sealed=SealedStats(capacity_blocks=3, used_blocks=3, bytes_per_block=40, bytes_used=120, bytes_reserved=120),
        overflow_blocks=0,
    )


def test_exhausted_reports_numbers_and_changes_nothing_until_the_sealed_store_frees_its_end() -> None:
    pool = make_pool(max_bytes=320)
    pool.allocate(3)
    pool.seal([0])
    pool.seal([1])
    pool.seal([2])  # 312 held: full precision 0, 1, 2 free; sealed 0, 1, 2 in use
    before = state(pool)
    with pytest.raises(PoolExhausted) as info:
        pool.allocate(4)  # one more block: 64 bytes, 8 left, nothing the store can give back
    error = info.value
    assert (error.requested, error.free, error.capacity, error.block_size) == (4, 3, 3, 2)
    assert "only 3 of its 3 blocks are free" in str(error)
    assert_same_state(before, state(pool))
    pool.decref([-3])  # sealed 2, the store's last block, is free: 8 + 40 bytes are still short of 64
    with pytest.raises(PoolExhausted):
        pool.allocate(4)
    assert pool.sealed.capacity == 3 and held(pool) == 312
    pool.decref([-2])  # sealed 1 and 2 free at the end: 8 + 80 bytes
    assert pool.num_free == 4
    # The store gives back 2 blocks (56 bytes short, 40 each), then full precision grows by max(1, 2, 3) = 3
    # clamped to the 88 bytes left: 1 block. 4 x 64 + 40.
    assert pool.allocate(4) == [0, 1, 2, 3]
    assert (pool.capacity, pool.sealed.capacity, pool.sealed.free_ids()) == (4, 1, ())
    assert held(pool) == 296
    assert pool.stats().free_blocks == 0  # 24 bytes left


# ---------------------------------------------------------------- sealing counts the blocks it frees


def test_a_seal_takes_the_bytes_of_the_full_precision_blocks_it_frees_at_the_end() -> None:
    pool = make_pool(max_bytes=256, growth=4)
    assert pool.allocate(4) == [0, 1, 2, 3]  # 256: the whole budget
    fill(pool)
    original = [pool.keys[0].clone(), pool.values[0].clone()]
    before = state(pool)
    with pytest.raises(PoolExhausted) as info:
        pool.seal([1])  # block 1 would be freed, but block 3 after it is live: no bytes come back
    assert (info.value.requested, info.value.free, info.value.capacity) == (1, 0, 0)
    assert_same_state(before, state(pool))
    pool.incref([3])  # two rows share block 3
    # Both rows' references to 3 and the one to 2 move: 2 and 3 are free, at the end: 128 bytes, of which
    # the 2 sealed blocks take 80 (step max(2, 2, 0) = 2).
    assert pool.seal([2, 3, 3]) == [-1, -2, -2]
    assert (pool.capacity, pool.sealed.capacity) == (2, 2)
    assert held(pool) == 2 * 64 + 2 * 40
    assert (pool.ref_count(-1), pool.ref_count(-2)) == (1, 2)
    assert pool.free_ids() == ()  # 2 and 3 went with the memory
    keys, values = pool.read_sealed(0, torch.tensor([-1, -2]), torch.float32)
    expected = int8_round_trip(original[0][2:4], original[1][2:4])
    assert torch.equal(keys, expected[0]) and torch.equal(values, expected[1])
    assert torch.equal(pool.keys[0], original[0][:2]) and torch.equal(pool.values[0], original[1][:2])
    # 48 bytes left: the next seal grows the store by max(1, 2, 2) = 2 clamped to 1; block 0 stays held.
    assert pool.seal([0]) == [-3]
    assert held(pool) == 248 and pool.free_ids() == (0,)


def test_an_unseal_takes_the_bytes_of_the_sealed_block_it_frees_at_the_end() -> None:
    pool = make_pool(max_bytes=192)
    assert pool.allocate(2) == [0, 1]  # 128
    fill(pool, seed=1)
    # 2 sealed blocks need 80 bytes, 64 are left: full precision gives back 1 of the 2 it frees (block 1,
    # at the end), and the store grows by 2: 64 + 80.
    assert pool.seal([0, 1]) == [-1, -2]
    assert (pool.capacity, pool.free_ids(), held(pool)) == (1, (0,), 144)
    assert pool.allocate(1) == [0]  # 48 bytes left
    decoded = [pool.read_sealed(0, torch.tensor([entry]), torch.float32) for entry in (-1, -2)]
    # Unsealing -2 frees sealed 1, the store's last block: it gives it back (40 + 48 >= 64).
    assert pool.unseal(-2) == 1
    assert (pool.sealed.capacity, pool.capacity, held(pool)) == (1, 2, 168)
    assert torch.equal(pool.keys[0][1], decoded[1][0][0]) and torch.equal(pool.values[0][1], decoded[1][1][0])
    keys, _ = pool.read_sealed(0, torch.tensor([-1]), torch.float32)
    assert torch.equal(keys, decoded[0][0])  # the sealed block kept survives the store shrinking
    assert pool.copy_on_write(-1) == 2  # the same through copy_on_write: the store is empty, 192 held
    assert (pool.sealed.capacity, pool.capacity, held(pool)) == (0, 3, 192)
    assert torch.equal(pool.keys[0][2], decoded[0][0][0])
    with pytest.raises(PoolExhausted) as info:
        pool.allocate(1)
    assert (info.value.requested, info.value.free, info.value.capacity) == (1, 0, 3)


def test_allocate_sealed_is_capped_too() -> None:
    pool = make_pool(max_bytes=160)
    pool.allocate(2)  # 128
    before = state(pool)
    with pytest.raises(PoolExhausted):
        pool.allocate_sealed(1)  # 40 > 32, and both full-precision blocks are live
    assert_same_state(before, state(pool))
    pool.decref([1])
    assert pool.allocate_sealed(1) == [-1]  # block 1 goes: 64, and the store's step of 2 fits in 96 bytes
    assert held(pool) == 64 + 2 * 40


# ---------------------------------------------------------------- reclaimers


class Cached:
    """A stand-in for a prefix tree: holds references and gives them back, newest first, when asked."""

    def __init__(self, pool: QuantizedBlockPool, entries: list[int]) -> None:
        self.pool, self.entries = pool, entries
        self.asked: list[int] = []

    def __call__(self, wanted: int) -> int:
        self.asked.append(wanted)
        freed = 0
        while self.entries and freed < wanted:
            self.pool.decref([self.entries.pop()])
            freed += 1
        return freed


def test_reclaimers_make_room_for_full_precision_blocks_by_freeing_sealed_ones() -> None:
    pool = make_pool(max_bytes=256)
    pool.allocate(2)  # 128
    cached = Cached(pool, pool.seal([0, 1]))  # the tree holds -1, -2: 128 + 80, full precision 0, 1 free
    pool.add_reclaimer(cached)
    # 3 blocks: 2 free, 1 more needs 64 bytes, 48 left; the store's end is live until the tree lets -2 go.
    assert pool.allocate(3) == [0, 1, 2]
    assert cached.asked == [1] and cached.entries == [-1]
    assert (pool.capacity, pool.sealed.capacity, held(pool)) == (3, 1, 232)
    # A seal whose block is at the end needs no reclaim: full precision gives block 2 back (24 + 64 bytes).
    assert pool.seal([2]) == [-2]
    assert cached.asked == [1] and held(pool) == 2 * 64 + 3 * 40
    with pytest.raises(PoolExhausted):
        pool.allocate(2)  # the tree lets -1 go, but sealed 0 is not at the end: its bytes stay held
    assert cached.asked == [1, 2] and cached.entries == []
    assert pool.sealed.free_ids() == (0, 2) and held(pool) == 248  # under a byte cap, lowest first
    pool.remove_reclaimer(cached)


def test_reclaimers_make_room_for_sealed_blocks() -> None:
    pool = make_pool(max_bytes=208)
    assert pool.allocate(2) == [0, 1]
    cached = Cached(pool, [*pool.seal([0]), *pool.seal([1])])  # 128 + 80: the whole budget
    pool.add_reclaimer(cached)
    assert pool.allocate(2) == [0, 1]
    assert pool.seal([0]) == [-2]  # block 1 after it is live: the tree lets sealed 1 go instead
    assert cached.asked == [1] and cached.entries == [-1]
    assert held(pool) == 208


def test_a_charge_takes_the_sealed_store_s_free_end_too() -> None:
    pool = make_pool(max_bytes=320)
    pool.allocate(3)  # 192
    pool.seal([0])  # sealed step 2: 272
    pool.seal([1])  # full precision 0 and 1 free, 2 live at the end; sealed 0 and 1 in use
    pool.decref([-2])  # sealed 1, the store's end, is free
    pool.charge("a", 80)  # 272 + 80 is 32 over: no full-precision block is free at the end, sealed 1 gives 40
    assert (pool.capacity, pool.sealed.capacity, pool.sealed.free_ids()) == (3, 1, ())
    assert tensor_bytes(pool) == 192 + 40 and pool.bytes_held() == pool.stats().bytes_held == 312
    before = state(pool)
    with pytest.raises(PoolExhausted, match="bytes of slot metadata"):
        pool.charge("b", 40)  # 32 over again, and neither part has a free block at its end
    assert_same_state(before, state(pool))
    assert (pool.charged("b"), pool.bytes_held()) == (0, 312)


# ---------------------------------------------------------------- max_tokens, arguments


def test_max_tokens_caps_the_full_precision_blocks_only() -> None:
    pool = make_pool(max_bytes=None, max_tokens=4)  # 2 full-precision blocks
    for _ in range(3):
        pool.seal(pool.allocate(2))
    assert (pool.capacity, pool.sealed.capacity) == (2, 8)  # the store grew by 2, 2, then 4
    stats = pool.stats()
    assert (stats.max_blocks, stats.max_bytes, stats.bytes_held) == (2, None, 2 * 64 + 8 * 40)
    assert stats.bytes_held == held(pool)
    pool.allocate(2)
    with pytest.raises(PoolExhausted):
        pool.allocate(1)


def test_uncapped_pool_reports_what_it_holds() -> None:
    pool = make_pool(max_bytes=None)
    pool.seal(pool.allocate(3))
    stats = pool.stats()
    assert (stats.bytes_reserved, stats.sealed.bytes_reserved, stats.max_bytes) == (3 * 64, 3 * 40, None)
    assert stats.bytes_held == held(pool) == 3 * 64 + 3 * 40


def test_a_sealed_block_larger_than_a_full_precision_one_takes_two_back() -> None:
    geometry = KVGeometry(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float16)  # 32-byte blocks
    pool = QuantizedBlockPool(geometry, [RawFormat(torch.float32)], block_size=2, max_bytes=128, growth_blocks=1)
    assert (pool.bytes_per_block, pool.sealed.bytes_per_block) == (32, 64)
    assert pool.allocate(3) == [0, 1, 2]  # 96
    assert pool.seal([2]) == [-1]  # 32 left + block 2, freed at the end: 64 + 64
    assert (pool.capacity, held(pool)) == (2, 128)
    before = state(pool)
    with pytest.raises(PoolExhausted):
        pool.seal([0])  # 64 needed, and block 1 after block 0 is live
    assert_same_state(before, state(pool))
    pool.decref([1])
    assert pool.seal([0]) == [-2]  # blocks 0 (freed by this seal) and 1 give back 64 bytes
    assert (pool.capacity, pool.sealed.capacity, held(pool)) == (0, 2, 128)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_bytes": 256, "preallocate": True}, "cannot preallocate"),
        ({"max_bytes": 64, "formats": [RawFormat(torch.float64)]}, "smaller than one sealed block"),
        ({"max_bytes": 63}, "smaller than one block"),
    ],
)
def test_bad_caps(kwargs: dict[str, object], message: str) -> None:
    arguments: dict[str, object] = {"formats": [INT8], "block_size": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        QuantizedBlockPool(GEOMETRY, **arguments)  # type: ignore[arg-type]
