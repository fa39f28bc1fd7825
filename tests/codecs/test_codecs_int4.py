"""int4: the nibble layout by hand, packing with odd token/block counts, the half-step bound."""

from __future__ import annotations

import pytest
import torch
from kv_codec_reference import error_bound

from hf_kvgov.codecs import Encoded, GroupAxis, Int4Codec, pack_int4, unpack_int4


def test_hand_made_nibbles_decode_to_known_values() -> None:
    # byte 0x21: low nibble 1 -> d=0, high nibble 2 -> d=1; byte 0xF0: low 0 -> d=2, high 15 -> d=3.
    # With scale 0.5 and zero -1: 1*0.5-1, 2*0.5-1, 0*0.5-1, 15*0.5-1.
    enc = Encoded(
        codes=torch.tensor([[[0x21, 0xF0]]], dtype=torch.uint8),
        scale=torch.tensor([[[0.5]]], dtype=torch.float16),
        zero=torch.tensor([[[-1.0]]], dtype=torch.float16),
        shape=(1, 1, 4),
        axis=GroupAxis.TOKEN,
        group_size=4,
        codec="int4",
    )
    assert Int4Codec().decode(enc, torch.float32).flatten().tolist() == [-0.5, 0.0, -1.0, 6.5]


def test_pack_puts_even_index_in_low_nibble() -> None:
    codes = torch.tensor([1, 2, 0, 15, 7, 9], dtype=torch.uint8)
    assert pack_int4(codes).tolist() == [0x21, 0xF0, 0x97]
    assert unpack_int4(torch.tensor([0x21, 0xF0, 0x97], dtype=torch.uint8)).tolist() == codes.tolist()


def test_encode_ramp_gives_known_bytes() -> None:
    # One token row -2, -1.75, ..., 1.75: 15 steps of 0.25 -> codes 0..15; byte j = 2j | (2j+1) << 4.
    v = (torch.arange(16, dtype=torch.float32) * 0.25 - 2).reshape(1, 1, 16)
    enc = Int4Codec().encode_values(v)
    assert enc.codes.tolist() == [[[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]]]
    assert enc.scale.item() == 0.25 and enc.zero is not None and enc.zero.item() == -2.0
    assert torch.equal(Int4Codec().decode(enc, torch.float32), v)


@pytest.mark.parametrize("shape", [(3, 5, 2, 8), (7, 1, 6), (1, 3, 1, 1, 2), (5, 3, 4)])
def test_pack_unpack_round_trip_with_odd_counts(shape: tuple[int, ...]) -> None:
    codes = torch.randint(0, 16, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    packed = pack_int4(codes)
    assert packed.shape == (*shape[:-1], shape[-1] // 2)
    assert torch.equal(unpack_int4(packed), codes)
    # Each byte against a scalar reference of the documented layout.
    flat_codes, flat_packed = codes.reshape(-1, shape[-1]), packed.reshape(-1, shape[-1] // 2)
    for row in range(flat_codes.shape[0]):
        for j in range(shape[-1] // 2):
            lo, hi = int(flat_codes[row, 2 * j]), int(flat_codes[row, 2 * j + 1])
            assert int(flat_packed[row, j]) == lo + 16 * hi


@pytest.mark.parametrize("shape", [(3, 5, 2, 8), (5, 3, 6), (1, 7, 1, 2)])
def test_odd_tokens_and_blocks_round_trip(shape: tuple[int, ...]) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    codec = Int4Codec()
    for axis, enc in (("keys", codec.encode_keys(x)), ("values", codec.encode_values(x))):
        assert enc.codes.shape == (*shape[:-1], shape[-1] // 2)
        err = (codec.decode(enc, torch.float32) - x).abs().double()
        assert (err <= error_bound("int4", x, axis, shape[-1])).all()


def test_odd_head_dim_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"int4 codec packs 2 codes per byte.*head_dim=7"):
        Int4Codec().encode_keys(torch.zeros(4, 2, 7))
    with pytest.raises(ValueError, match="head_dim=7"):
        Int4Codec().bytes_per_token(num_kv_heads=2, head_dim=7, block_size=16)
    with pytest.raises(ValueError, match="must be even"):
        pack_int4(torch.zeros(3, dtype=torch.uint8))


def test_pack_rejects_non_uint8() -> None:
    with pytest.raises(TypeError, match="uint8"):
        pack_int4(torch.zeros(4, dtype=torch.int32))


@pytest.mark.parametrize("group_size", [None, 4, 2])
def test_random_blocks_within_half_step(group_size: int | None) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 16, 3, 16, generator=gen) * 2 - 1
    codec = Int4Codec(group_size=group_size)
    for axis, enc in (("values", codec.encode_values(x)), ("keys", codec.encode_keys(x))):
        err = (codec.decode(enc, torch.float32) - x).abs().double()
        assert (err <= error_bound("int4", x, axis, group_size or 16)).all()
    # The bound is not vacuous: over 16 tokens per key group the error nears half a step.
    ratio = err / error_bound("int4", x, "keys", 16)
    assert ratio.max() > 0.8
