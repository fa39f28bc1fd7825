"""QuantizedBlockPool bookkeeping with exact ids and bytes, no model: seal, share, unseal, free."""

from __future__ import annotations

import pytest
import torch

from hf_kvgov.codecs import Fp8E4M3Codec, Int4Codec, Int8Codec
from hf_kvgov.storage.pool import KVGeometry
from hf_kvgov.storage.quantized_pool import QuantizedBlockPool
from hf_kvgov.storage.sealed_formats import CodecFormat, RawFormat
from hf_kvgov.storage.sealed_store import SealedBlockStore

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=4)  # fp32, block_size 2 below


def make_pool() -> QuantizedBlockPool:
    """Layer 0 int8, layer 1 kept in full precision; blocks 0..7 filled with distinct values."""
    pool = QuantizedBlockPool(GEOMETRY, [CodecFormat(Int8Codec()), RawFormat(torch.float32)], block_size=2)
    generator = torch.Generator().manual_seed(0)
    assert pool.allocate(3) == [0, 1, 2]
    for layer in range(2):
        pool.keys[layer].copy_(torch.randn(pool.keys[layer].shape, generator=generator))
        pool.values[layer].copy_(torch.randn(pool.values[layer].shape, generator=generator))
    return pool


def test_bytes_per_sealed_block_by_hand() -> None:
    # Per layer, block_size 2, 1 head, head_dim 4, float16 scales and zero points:
    #   int8: key codes 2*4 = 8, key scale + zero 2 * 4 ch * 2 B = 16,
    #         value codes 8, value scale + zero 2 * 2 tokens * 2 B = 8
    #   int4: key codes 2*2 = 4, 16, value codes 4, 8;  raw fp32: 2 * 2*4*4 = 64
    #   fp8: 8 + 12 (keys centred: a 2-byte scale and a 1-byte e4m3 zero per channel) + 8 + 4 (values: a scale)
    expected = {"int8": 40, "int4": 32, "fp8": 32, "raw": 64}
    formats = {
        "int8": CodecFormat(Int8Codec()),
        "int4": CodecFormat(Int4Codec()),
        "fp8": CodecFormat(Fp8E4M3Codec()),
        "raw": RawFormat(torch.float32),
    }
    for name, fmt in formats.items():
        store = SealedBlockStore([fmt], block_size=2, num_kv_heads=1, head_dim=4, device=torch.device("cpu"))
        assert store.bytes_per_block == expected[name], name
    assert make_pool().sealed.bytes_per_block == 40 + 64


def test_seal_encodes_a_shared_block_once_and_frees_full_precision_memory() -> None:
    pool = make_pool()
    original_k = [pool.keys[layer][[1, 2]].clone() for layer in range(2)]
    original_v = [pool.values[layer][[1, 2]].clone() for layer in range(2)]
    pool.incref([1])  # two rows hold block 1
    version = pool.version
    assert pool.seal([1, 1, 2]) == [-1, -1, -2]
    assert (pool.ref_count(-1), pool.ref_count(-2)) == (2, 1)
    assert pool.num_used == 1 and pool.sealed.num_used == 2  # only block 0 is still full precision
    assert pool.free_ids() == (3, 4, 5, 6, 7, 1, 2)  # FIFO: freed blocks are reused last
    assert pool.version != version
    # Layer 0 decodes to the int8 round trip of the original blocks; layer 1 was stored raw.
    keys, values = pool.read_sealed(0, torch.tensor([-1, -2]), torch.float32)
    codec = Int8Codec()
    assert torch.equal(keys, codec.decode(codec.encode_keys(original_k[0]), torch.float32))
    assert torch.equal(values, codec.decode(codec.encode_values(original_v[0]), torch.float32))
    keys, values = pool.read_sealed(1, torch.tensor([-2, -1]), torch.float32)
    assert torch.equal(keys, original_k[1].flip(0)) and torch.equal(values, original_v[1].flip(0))


def test_unseal_and_copy_on_write_decode_into_a_fresh_block() -> None:
    pool = make_pool()
    pool.seal([1, 2])
    pool.incref([-1])
    decoded_k, decoded_v = pool.read_sealed(0, torch.tensor([-1]), torch.float32)
    fresh = pool.unseal(-1)
    assert fresh == 3 and pool.ref_count(-1) == 1  # one reference moved to the writable copy
    assert torch.equal(pool.keys[0][3], decoded_k[0]) and torch.equal(pool.values[0][3], decoded_v[0])
    # A sealed block is never written in place, even when unshared.
    assert pool.copy_on_write(-2) == 4
    assert pool.sealed.free_ids()[-1] == 1 and pool.sealed.ref_count(1) == 0
    pool.decref([0, 3, 4, -1])
    assert pool.num_used == 0 and pool.sealed.num_used == 0


def test_forks_share_sealed_blocks_and_free_them_at_zero() -> None:
    pool = make_pool()
    (sealed,) = pool.seal([2])
    pool.incref([0, sealed, sealed])
    assert (pool.ref_count(0), pool.ref_count(sealed)) == (2, 3)
    pool.decref([sealed, sealed])
    assert pool.sealed.num_used == 1
    pool.decref([sealed])
    assert pool.sealed.num_used == 0 and pool.sealed.free_ids()[-1] == 0


def test_bad_ids_change_nothing() -> None:
    pool = make_pool()
    (sealed,) = pool.seal([2])
    pool.decref([sealed])
    with pytest.raises(ValueError, match="freed twice or never sealed"):
        pool.decref([0, sealed])  # block 0 is valid, the sealed one is free: neither count changes
    assert pool.ref_count(0) == 1
    with pytest.raises(ValueError, match="sealed ids are ints"):
        pool.incref([-500])
    with pytest.raises(ValueError, match="already sealed"):
        pool.seal([-1])
    with pytest.raises(ValueError, match="freed twice or never allocated"):
        pool.seal([5])  # on the free list


def test_failed_encoding_leaves_both_tiers_unchanged() -> None:
    pool = make_pool()
    pool.keys[0][1, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        pool.seal([0, 1])
    assert pool.num_used == 3 and pool.sealed.num_used == 0
    assert pool.ref_count(0) == pool.ref_count(1) == 1


def test_sealed_store_grows_and_keeps_earlier_blocks() -> None:
    geometry = KVGeometry(num_layers=1, num_kv_heads=1, head_dim=4)
    pool = QuantizedBlockPool(geometry, [RawFormat(torch.float32)], block_size=2, sealed_growth_blocks=2)
    first = pool.allocate(1)
    pool.keys[0][first[0]] = 7.0
    (kept,) = pool.seal(first)
    for _ in range(5):
        pool.seal(pool.allocate(1))
    assert pool.sealed.capacity == 8  # 2, then doubled twice
    keys, _ = pool.read_sealed(0, torch.tensor([kept]), torch.float32)
    assert torch.equal(keys, torch.full((1, 2, 1, 4), 7.0))


def test_one_format_per_layer_is_required() -> None:
    with pytest.raises(ValueError, match="one SealedFormat per layer"):
        QuantizedBlockPool(GEOMETRY, [RawFormat(torch.float32)])


def test_sealed_store_grown_under_inference_mode_takes_seals_outside_it() -> None:
    # A prefill run under torch.inference_mode() grows the store; a later generate (outside it) seals into
    # the same tensors, which fails for tensors created in inference mode.
    pool = make_pool()
    with torch.inference_mode():
        first = pool.seal([1])
    assert not any(piece.is_inference() for layer in pool.sealed.pieces for piece in layer.values())
    second = pool.seal([2])
    assert first != second
    assert pool.sealed_stats().used_blocks == 2
