"""Per-layer devices in the storage layer: geometry validation, allocation and growth of each layer's blocks
on its own device, refused cross-device writes, placement of unwritten layers, per-device block tables.

Layers put on `torch.device("meta")` only check placement and shapes (meta tensors hold no data); data
checks use the CPU layers. Expected ids follow the pool's two rules (FIFO free list, growth appends ids in
order) and its growth step: max(short + first-growth headroom of short // 8, growth_blocks, capacity).
"""

from __future__ import annotations

import pytest
import torch

from hf_kvgov.storage.block_table import BlockTables
from hf_kvgov.storage.pool import BlockPool, KVGeometry
from hf_kvgov.storage.quantized_pool import QuantizedBlockPool
from hf_kvgov.storage.sealed_formats import RawFormat
from hf_kvgov.storage.sealed_store import SealedBlockStore

CPU, META = torch.device("cpu"), torch.device("meta")
HEADS, DIM, BS = 2, 4, 4


def geometry(*devices: torch.device) -> KVGeometry:
    return KVGeometry(num_layers=len(devices), num_kv_heads=HEADS, head_dim=DIM, layer_devices=devices)


def tokens(n: int, start: float = 1.0) -> torch.Tensor:
    """`[n, HEADS, DIM]` with distinct values start, start + 1, ..."""
    return torch.arange(n * HEADS * DIM, dtype=torch.float32).view(n, HEADS, DIM) + start


def slots(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


# ---------------------------------------------------------------- geometry


def test_geometry_without_layer_devices_puts_every_layer_on_device() -> None:
    g = KVGeometry(num_layers=3, num_kv_heads=1, head_dim=1, device=META)
    assert [g.layer_device(layer) for layer in range(3)] == [META, META, META]
    assert g.devices == (META,)


def test_geometry_normalises_layer_devices_and_takes_device_from_the_first_layer() -> None:
    g = KVGeometry(num_layers=3, num_kv_heads=1, head_dim=1, layer_devices=["meta", "cpu", "meta"])  # type: ignore[arg-type]
    assert g.layer_devices == (META, CPU, META)
    assert g.device == META  # left at its default: the first layer's device
    assert g.devices == (META, CPU)
    assert g.with_layer_device(0, CPU).layer_devices == (CPU, CPU, META)
    assert g.with_layer_device(0, CPU).device == CPU


@pytest.mark.parametrize(
    ("layer_devices", "error", "message"),
    [
        ((CPU, CPU), ValueError, r"one device per layer \(3\); got 2"),
        ("cpu", TypeError, "tuple with one torch.device per layer"),
        ((CPU, 0, CPU), TypeError, "entries must be torch.device or device strings; got int 0"),
        ((CPU, "no-such-device", CPU), ValueError, "'no-such-device', which is not a torch device name"),
    ],
)
def test_geometry_refuses_bad_layer_devices(layer_devices: object, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        KVGeometry(num_layers=3, num_kv_heads=1, head_dim=1, layer_devices=layer_devices)  # type: ignore[arg-type]


def test_geometry_refuses_a_device_that_is_not_the_first_layers() -> None:
    with pytest.raises(ValueError, match=r"KVGeometry.device \(meta\) must be the first layer's device \(cpu\)"):
        KVGeometry(num_layers=2, num_kv_heads=1, head_dim=1, device=META, layer_devices=(CPU, CPU))


# ---------------------------------------------------------------- allocation and growth


def test_each_layer_is_allocated_and_grown_on_its_own_device() -> None:
    pool = BlockPool(geometry(CPU, META, CPU), block_size=BS, growth_blocks=2)
    assert [t.device for t in pool.keys + pool.values] == [CPU, META, CPU] * 2
    assert pool.allocate(1) == [0]  # grows by max(1, 2, 0) = 2: free [1]
    assert [tuple(t.shape) for t in pool.keys] == [(2, BS, HEADS, DIM)] * 3
    pool.write(0, slots(0, 1, 2, 3), tokens(4), -tokens(4))
    pool.write(2, slots(0, 1, 2, 3), tokens(4, 100.0), -tokens(4, 100.0))
    assert pool.allocate(3) == [1, 2, 3]  # 1 free, 2 short: grows by max(2, 2, 2) = 2
    assert pool.capacity == 4
    assert [t.device for t in pool.keys + pool.values] == [CPU, META, CPU] * 2
    assert [tuple(t.shape) for t in pool.keys + pool.values] == [(4, BS, HEADS, DIM)] * 6
    assert torch.equal(pool.keys[0][0], tokens(4)) and torch.equal(pool.values[0][0], -tokens(4))
    assert torch.equal(pool.keys[2][0], tokens(4, 100.0)) and torch.equal(pool.values[2][0], -tokens(4, 100.0))
    assert not pool.keys[0][1:].any() and not pool.keys[2][1:].any()  # grown blocks are zeroed


def test_preallocated_pool_places_each_layer() -> None:
    pool = BlockPool(geometry(META, CPU), block_size=BS, max_tokens=3 * BS, preallocate=True)
    assert (pool.keys[0].device, pool.keys[1].device) == (META, CPU)
    assert [tuple(t.shape) for t in pool.values] == [(3, BS, HEADS, DIM)] * 2


def test_write_refuses_kv_that_arrive_on_another_device() -> None:
    pool = BlockPool(geometry(CPU, META), block_size=BS)
    pool.allocate(1)
    with pytest.raises(ValueError, match="Layer 1's blocks are on meta but its keys arrived on cpu"):
        pool.write(1, slots(0), tokens(1), tokens(1))
    with pytest.raises(ValueError, match="Layer 0's blocks are on cpu but its values arrived on meta"):
        pool.write(0, slots(0), tokens(1), tokens(1).to(META))
    assert not pool.is_written(0) and not pool.is_written(1)
    pool.write(1, slots(0), tokens(1).to(META), tokens(1).to(META))  # slots are copied to the layer's device
    assert pool.is_written(1) and pool.keys[1].device == META


def test_copy_on_write_and_zero_blocks_keep_each_layer_on_its_device() -> None:
    pool = BlockPool(geometry(CPU, META), block_size=BS, growth_blocks=2)
    assert pool.allocate(2) == [0, 1]
    pool.write(0, slots(0, 1, 2, 3), tokens(4), -tokens(4))
    pool.incref([0])
    assert pool.copy_on_write(0) == 2  # shared: a private copy, the pool grows by max(1, 2, 2) = 2
    assert torch.equal(pool.keys[0][2], tokens(4)) and torch.equal(pool.values[0][2], -tokens(4))
    assert pool.keys[1].device == META and tuple(pool.keys[1].shape) == (4, BS, HEADS, DIM)
    pool.zero_blocks([0])
    assert not pool.keys[0][0].any() and torch.equal(pool.keys[0][2], tokens(4))


def test_gather_returns_each_layers_kv_on_its_device() -> None:
    pool = BlockPool(geometry(CPU, META), block_size=BS)
    assert pool.allocate(2) == [0, 1]
    pool.write(0, slots(4, 5, 6, 0, 1, 2), tokens(6), -tokens(6))  # row 0 in block 1, row 1 in block 0
    table = torch.tensor([[1], [0]])
    keys, values = pool.gather(0, table, 3)
    assert torch.equal(keys, torch.stack([tokens(3), tokens(3, 25.0)]).transpose(1, 2))
    assert torch.equal(values, -torch.stack([tokens(3), tokens(3, 25.0)]).transpose(1, 2))
    keys, values = pool.gather(1, table, 3)  # the CPU table is copied to the meta layer's device
    assert (keys.device, tuple(keys.shape)) == (META, (2, HEADS, 3, DIM))


# ---------------------------------------------------------------- placement


def test_a_layer_that_never_stored_can_be_placed_and_a_written_one_cannot() -> None:
    pool = BlockPool(geometry(CPU, CPU), block_size=BS)
    pool.allocate(3)
    pool.place_layer(1, META)
    assert pool.layer_device(1) == META and tuple(pool.keys[1].shape) == (pool.capacity, BS, HEADS, DIM)
    assert pool.geometry.layer_devices == (CPU, META) and pool.geometry.device == CPU
    pool.write(0, slots(0), tokens(1), tokens(1))
    with pytest.raises(ValueError, match=r"Layer 0 already stores K/V on cpu; .* cannot place the layer on meta"):
        pool.place_layer(0, META)
    assert pool.layer_device(0) == CPU and torch.equal(pool.keys[0][0, 0], tokens(1)[0])


def test_placing_the_first_layer_moves_the_geometrys_device() -> None:
    pool = BlockPool(geometry(CPU, CPU), block_size=BS)
    pool.place_layer(0, META)
    assert pool.geometry.device == META and pool.geometry.layer_devices == (META, CPU)


# ---------------------------------------------------------------- block tables


def test_block_tables_keep_one_copy_of_the_table_and_slots_per_device() -> None:
    pool = BlockPool(geometry(CPU, META), block_size=BS, growth_blocks=8)
    tables = BlockTables(pool)
    # Two rows of 5 tokens: row 0 holds blocks 0, 1 and row 1 blocks 2, 3.
    written = tables.slots_for(2, 0, 5)
    assert written.tolist() == [0, 1, 2, 3, 4, 8, 9, 10, 11, 12]
    assert tables.tensor().tolist() == [[0, 1], [2, 3]] and tables.tensor().device == CPU
    on_meta = tables.tensor(META)
    assert (on_meta.device, tuple(on_meta.shape)) == (META, (2, 2))
    assert tables.tensor(META) is on_meta  # cached: every layer on that device reads the same copy
    assert tables.slots_on(CPU) is written
    slots_meta = tables.slots_on(META)
    assert (slots_meta.device, tuple(slots_meta.shape)) == (META, (10,))
    assert tables.slots_on(META) is slots_meta
    assert tables.slots_for(2, 5, 1).tolist() == [5, 13]  # the next step: same blocks, new slots
    assert tables.slots_on(META) is not slots_meta and tables.tensor(META) is on_meta
    tables.slots_for(2, 8, 1)  # a third block per row: the tables change, every copy is rebuilt
    assert tables.tensor().tolist() == [[0, 1, 4], [2, 3, 5]]
    assert tables.tensor(META) is not on_meta and tuple(tables.tensor(META).shape) == (2, 3)


# ---------------------------------------------------------------- quantized pool and sealed store


def test_sealed_store_puts_each_layers_pieces_on_its_device_and_grows_them_there() -> None:
    store = SealedBlockStore([RawFormat(torch.float32)] * 3, BS, HEADS, DIM, [CPU, META, CPU], growth_blocks=2)
    assert store.allocate(3) == [0, 1, 2]  # grows by max(3, 2, 0) = 3
    assert [[t.device for t in pieces.values()] for pieces in store.pieces] == [[CPU, CPU], [META, META], [CPU, CPU]]
    assert all(tuple(t.shape) == (3, BS, HEADS, DIM) for pieces in store.pieces for t in pieces.values())
    with pytest.raises(ValueError, match=r"one device per layer \(3\); got 2"):
        SealedBlockStore([RawFormat(torch.float32)] * 3, BS, HEADS, DIM, [CPU, META])


def test_quantized_pool_seals_and_unseals_each_layer_on_its_device() -> None:
    pool = QuantizedBlockPool(geometry(CPU, META), [RawFormat(torch.float32)] * 2, block_size=BS, growth_blocks=2)
    assert pool.allocate(2) == [0, 1]
    pool.write(0, slots(4, 5, 6, 7), tokens(4), -tokens(4))  # block 1 of the CPU layer
    assert pool.seal([1]) == [-1]
    assert [t.device for t in pool.sealed.pieces[1].values()] == [META, META]
    fresh = pool.unseal(-1)
    assert fresh == 1  # block 1 went back to the free list when sealed: free [1]
    assert torch.equal(pool.keys[0][fresh], tokens(4)) and torch.equal(pool.values[0][fresh], -tokens(4))
    assert pool.keys[1].device == META


def test_quantized_pool_places_a_layers_sealed_pieces_with_its_blocks() -> None:
    pool = QuantizedBlockPool(geometry(CPU, CPU), [RawFormat(torch.float32)] * 2, block_size=BS)
    pool.allocate(1)
    pool.seal(pool.allocate(1))
    pool.place_layer(1, META)
    assert pool.keys[1].device == META and pool.sealed.devices == [CPU, META]
    assert [t.device for t in pool.sealed.pieces[1].values()] == [META, META]
