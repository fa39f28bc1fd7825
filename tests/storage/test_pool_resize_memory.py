"""What a resize holds at its peak: growth, a shrink that hands bytes to a charge, the sealed store's growth.

The pool replaces its tensors one at a time, so at any moment a resize holds the new tensors and at most one old
one (one position's keys or values, or one sealed piece), not the whole pool twice. The peak is measured from
torch's own allocation records (`torch.profiler` with ``profile_memory``: every allocation and free of the CPU
allocator, in order), from before the pool exists, so the old tensors' frees are seen too. An allocation that
fails part way leaves every tensor as long as before and the data intact.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from hf_kvgov.bench.memory import peak_tensor_bytes
from hf_kvgov.codecs import Int8Codec
from hf_kvgov.storage import pool as pool_module
from hf_kvgov.storage import sealed_store as sealed_store_module
from hf_kvgov.storage.pool import BlockPool, KVGeometry
from hf_kvgov.storage.quantized_pool import QuantizedBlockPool
from hf_kvgov.storage.sealed_formats import CodecFormat

LAYERS = 8
GEOMETRY = KVGeometry(num_layers=LAYERS, num_kv_heads=2, head_dim=64, dtype=torch.float32)
BLOCK = 16


def tensor_bytes(pool: BlockPool) -> int:
    return sum({id(t): t.numel() * t.element_size() for t in (*pool.keys, *pool.values)}.values())


def test_growth_holds_the_new_tensors_and_one_old_one_at_most() -> None:
    held: dict[str, int] = {}

    def grow() -> None:
        pool = BlockPool(GEOMETRY, BLOCK, growth_blocks=64)
        pool.allocate(64)
        held["before"] = tensor_bytes(pool)
        pool.allocate(65)  # one past the capacity: the pool doubles
        held["after"] = tensor_bytes(pool)

    peak = peak_tensor_bytes(grow)
    assert held["after"] == 2 * held["before"]
    one_old = held["before"] // (2 * LAYERS)  # one layer's keys (or values) before the growth
    # Both copies at once would be 1.5x the grown pool; one tensor at a time, 1/16 of the old pool more.
    assert peak <= held["after"] + one_old, (peak, held)


def test_a_shrink_for_a_charge_holds_one_kept_tensor_more_at_most() -> None:
    held: dict[str, int] = {}
    bytes_per_block = GEOMETRY.bytes_per_token * BLOCK

    def shrink() -> None:
        pool = BlockPool(GEOMETRY, BLOCK, max_bytes=64 * bytes_per_block, preallocate=True)
        ids = pool.allocate(64)
        pool.decref(ids[32:])  # the last 32 blocks are free at the end of the tensors
        held["before"] = tensor_bytes(pool)
        pool.charge("holder", 32 * bytes_per_block)  # needs those 32 blocks' bytes back: the tensors shrink
        held["after"] = tensor_bytes(pool)

    peak = peak_tensor_bytes(shrink)
    assert held["after"] == held["before"] // 2
    # Copying every kept block first would hold the old tensors and all the kept ones (1.5x the old pool).
    assert peak <= held["before"] + held["after"] // (2 * LAYERS), (peak, held)


def test_the_sealed_store_grows_one_piece_at_a_time() -> None:
    held: dict[str, int] = {}

    def seal() -> None:
        pool = QuantizedBlockPool(GEOMETRY, [CodecFormat(Int8Codec())] * LAYERS, BLOCK, sealed_growth_blocks=32)
        pool.seal(pool.allocate(32))
        held["fp"] = tensor_bytes(pool)
        held["before"] = pool.sealed.capacity * pool.sealed.bytes_per_block
        pool.seal(pool.allocate(1))  # the store doubles
        held["after"] = pool.sealed.capacity * pool.sealed.bytes_per_block
        pieces = [piece for layer in pool.sealed.pieces for piece in layer.values()]
        held["largest_piece"] = max(piece.numel() * piece.element_size() for piece in pieces)

    peak = peak_tensor_bytes(seal)
    assert held["after"] == 2 * held["before"]
    # Encoding buffers of one block come and go; both copies of the store at once would add all of "before".
    assert peak <= held["fp"] + held["after"] + held["largest_piece"] + held["before"] // 4, (peak, held)


def failing_on_call(count: int, real: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`real`, except that its `count`-th call fails as an allocator out of memory does."""
    calls = [0]

    def allocate(*args: object) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == count:
            raise torch.OutOfMemoryError("simulated: the allocator has no room for this tensor")
        return real(*args)

    return allocate


def test_a_growth_that_fails_part_way_leaves_the_pool_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = BlockPool(GEOMETRY, BLOCK, growth_blocks=4)
    ids = pool.allocate(4)
    for layer in range(LAYERS):
        pool.keys[layer][ids] = float(layer + 1)
        pool.values[layer][ids] = -float(layer + 1)
    monkeypatch.setattr(pool_module, "zero_extended", failing_on_call(5, pool_module.zero_extended))
    with pytest.raises(torch.OutOfMemoryError):
        pool.allocate(1)  # layers 0-3's keys grow, then the fifth tensor fails
    assert pool.capacity == 4 and not pool.free_ids()
    for layer in range(LAYERS):
        assert pool.keys[layer].shape[0] == 4 and pool.values[layer].shape[0] == 4
        assert bool((pool.keys[layer] == layer + 1).all()) and bool((pool.values[layer] == -(layer + 1)).all())
    monkeypatch.undo()
    (new,) = pool.allocate(1)  # the pool grows normally afterwards
    assert new == 4 and all(t.shape[0] == pool.capacity for t in (*pool.keys, *pool.values))


def test_a_sealed_growth_that_fails_part_way_leaves_the_store_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = QuantizedBlockPool(GEOMETRY, [CodecFormat(Int8Codec())] * LAYERS, BLOCK, sealed_growth_blocks=2)
    pool.seal(pool.allocate(2))
    before = [{name: piece.clone() for name, piece in layer.items()} for layer in pool.sealed.pieces]
    monkeypatch.setattr(sealed_store_module, "zero_extended", failing_on_call(3, sealed_store_module.zero_extended))
    with pytest.raises(torch.OutOfMemoryError):
        pool.seal(pool.allocate(1))
    assert pool.sealed.capacity == 2
    for layer, pieces in enumerate(pool.sealed.pieces):
        for name, piece in pieces.items():
            assert torch.equal(piece, before[layer][name])


def test_a_write_during_another_threads_resize_lands_in_the_grown_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """One pool serves a thread per request: a request writing its block while another's allocation grows the pool
    must not write into a tensor the resize already copied and is about to drop. The first copy is held open (the
    resize waits up to 0.5 s for the write); the write waits for the pool's lock instead, and lands in the grown
    tensors."""
    pool = BlockPool(GEOMETRY, BLOCK, growth_blocks=4)
    mine, *_ = pool.allocate(4)  # the pool is full: the next allocation grows it
    copied, written = threading.Event(), threading.Event()
    real = pool_module.zero_extended

    def held_open(old: torch.Tensor, extra: int) -> torch.Tensor:
        grown = real(old, extra)
        if not copied.is_set():  # layer 0's keys are copied, not yet swapped in
            copied.set()
            written.wait(timeout=0.5)
        return grown

    monkeypatch.setattr(pool_module, "zero_extended", held_open)
    grower = threading.Thread(target=pool.allocate, args=(1,))
    grower.start()
    assert copied.wait(timeout=10)
    keys = torch.full((BLOCK, GEOMETRY.num_kv_heads, GEOMETRY.head_dim), 7.0)
    pool.write(0, torch.arange(mine * BLOCK, (mine + 1) * BLOCK), keys, -keys)
    written.set()
    grower.join(timeout=30)
    assert pool.capacity > 4
    assert bool((pool.keys[0][mine] == 7.0).all()) and bool((pool.values[0][mine] == -7.0).all())
