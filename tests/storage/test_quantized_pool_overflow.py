"""Sealing a block whose statistics do not fit its format keeps that block in full precision, counted.

One-byte statistics hold zero points within e4m3's +-448 and scales up to 2**9.25; keys past that (a
channel centred at 1,000) used to raise in the middle of a generation. Geometry: one layer, one KV head,
head_dim 4, float32, blocks of 2 tokens, int2 with one-byte statistics.
"""

from __future__ import annotations

import torch

from hf_kvgov.codecs import Int2Codec
from hf_kvgov.codecs.numerics import LOG_SCALE
from hf_kvgov.storage.pool import KVGeometry
from hf_kvgov.storage.quantized_pool import QuantizedBlockPool, sealed_id_of
from hf_kvgov.storage.sealed_formats import CodecFormat

GEOMETRY = KVGeometry(num_layers=1, num_kv_heads=1, head_dim=4)
ONE_BYTE_INT2 = CodecFormat(Int2Codec(scale_dtype=LOG_SCALE))


def filled_pool(centres: list[float], max_bytes: int | None = None) -> tuple[QuantizedBlockPool, list[torch.Tensor]]:
    """A pool with one block per centre, its keys and values near that centre; returns it and each block's K."""
    pool = QuantizedBlockPool(GEOMETRY, [ONE_BYTE_INT2], block_size=2, max_bytes=max_bytes)
    ids = pool.allocate(len(centres))
    generator = torch.Generator().manual_seed(0)
    keys = []
    for block, centre in zip(ids, centres, strict=True):
        k = centre + torch.randn(2, 1, 4, generator=generator)
        v = torch.randn(2, 1, 4, generator=generator)
        slots = torch.arange(block * 2, block * 2 + 2)
        pool.write(0, slots, k, v)
        keys.append(k)
    return pool, keys


def test_a_block_past_one_byte_statistics_stays_in_full_precision_and_is_counted() -> None:
    pool, keys = filled_pool([0.0, 1000.0, -3.0, -900.0])
    pool.incref([1])  # a second row holds block 1
    entries = pool.seal([0, 1, 2, 3, 1])  # block 1 listed twice: both references stay on it
    assert entries[0] < 0 and entries[2] < 0
    assert entries[1] == entries[4] == 1 and entries[3] == 3
    assert pool.stats().overflow_blocks == 2
    assert pool.ref_count(1) == 2 and pool.ref_count(3) == 1  # unmoved: the caller still holds them
    assert pool.ref_count(entries[0]) == 1 and pool.ref_count(0) == 0  # moved to the sealed copy, 0 freed
    assert pool.sealed.num_used == 2
    torch.testing.assert_close(pool.keys[0][1], keys[1], rtol=0, atol=0)  # read as written, no codes
    # The sealed ones are the codec's round trip, as without the fallback.
    sealed_keys, _ = pool.read_sealed(0, torch.tensor([entries[0], entries[2]]), torch.float32)
    codec = ONE_BYTE_INT2.codec
    for got, k in zip(sealed_keys, (keys[0], keys[2]), strict=True):
        torch.testing.assert_close(got, codec.decode(codec.encode_keys(k), torch.float32), rtol=0, atol=0)
    assert sealed_id_of(entries[0]) != sealed_id_of(entries[2])


def test_a_seal_with_only_overflowing_blocks_allocates_nothing_and_keeps_the_cap() -> None:
    pool, _ = filled_pool([1000.0, 2000.0], max_bytes=2 * 64)  # two full-precision blocks fill the cap
    assert pool.seal([0, 1]) == [0, 1]
    assert pool.sealed.capacity == 0 and pool.bytes_held() <= 128
    assert pool.stats().overflow_blocks == 2


def test_a_fitting_block_beside_an_overflowing_one_still_seals_under_the_cap() -> None:
    pool, _ = filled_pool([1000.0, 0.0], max_bytes=2 * 64)
    entries = pool.seal([0, 1])
    assert entries[0] == 0 and entries[1] < 0  # block 1's bytes at the end of the tensors became its codes
    assert pool.bytes_held() <= 128
    assert pool.stats().overflow_blocks == 1
