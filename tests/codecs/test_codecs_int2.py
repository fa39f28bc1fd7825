"""int2: the 2-bit layout by hand, packing with odd token/block counts, the half-step bound."""

from __future__ import annotations

import pytest
import torch
from kv_codec_reference import error_bound

from hf_kvgov.codecs import Encoded, GroupAxis, Int2Codec, pack_int2, unpack_int2


def test_hand_made_bytes_decode_to_known_values() -> None:
    # byte 0b11_10_01_00 = 0xE4: d=0 code 0, d=1 code 1, d=2 code 2, d=3 code 3 (lowest bits first).
    # byte 0b00_00_11_01 = 0x0D: d=4 code 1, d=5 code 3, d=6 code 0, d=7 code 0. Scale 0.5, zero -1.
    enc = Encoded(
        codes=torch.tensor([[[0xE4, 0x0D]]], dtype=torch.uint8),
        scale=torch.tensor([[[0.5]]], dtype=torch.float16),
        zero=torch.tensor([[[-1.0]]], dtype=torch.float16),
        shape=(1, 1, 8),
        axis=GroupAxis.TOKEN,
        group_size=8,
        codec="int2",
    )
    assert Int2Codec().decode(enc, torch.float32).flatten().tolist() == [-1.0, -0.5, 0.0, 0.5, -0.5, 0.5, -1.0, -1.0]


def test_pack_puts_lower_indices_in_lower_bits() -> None:
    codes = torch.tensor([0, 1, 2, 3, 1, 3, 0, 0], dtype=torch.uint8)
    assert pack_int2(codes).tolist() == [0xE4, 0x0D]
    assert unpack_int2(torch.tensor([0xE4, 0x0D], dtype=torch.uint8)).tolist() == codes.tolist()


def test_encode_ramp_gives_known_bytes() -> None:
    # One token row -1, 0, 1, 2 (repeated): 3 steps of 1 -> codes 0..3 -> byte 0xE4 each.
    v = torch.tensor([-1.0, 0.0, 1.0, 2.0] * 2).reshape(1, 1, 8)
    enc = Int2Codec().encode_values(v)
    assert enc.codes.tolist() == [[[0xE4, 0xE4]]]
    assert enc.scale.item() == 1.0 and enc.zero is not None and enc.zero.item() == -1.0
    assert torch.equal(Int2Codec().decode(enc, torch.float32), v)


@pytest.mark.parametrize("shape", [(3, 5, 2, 8), (7, 1, 12), (1, 3, 1, 1, 4), (5, 3, 16)])
def test_pack_unpack_round_trip_with_odd_counts(shape: tuple[int, ...]) -> None:
    codes = torch.randint(0, 4, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    packed = pack_int2(codes)
    assert packed.shape == (*shape[:-1], shape[-1] // 4)
    assert torch.equal(unpack_int2(packed), codes)
    flat_codes, flat_packed = codes.reshape(-1, shape[-1]), packed.reshape(-1, shape[-1] // 4)
    for row in range(flat_codes.shape[0]):
        for j in range(shape[-1] // 4):
            expected = sum(int(flat_codes[row, 4 * j + i]) << (2 * i) for i in range(4))
            assert int(flat_packed[row, j]) == expected


@pytest.mark.parametrize("group_size", [None, 8, 4])
def test_random_blocks_within_half_step(group_size: int | None) -> None:
    x = torch.randn(2, 16, 3, 16, generator=torch.Generator().manual_seed(3)) * 2 - 1
    codec = Int2Codec(group_size=group_size)
    for axis, enc in (("values", codec.encode_values(x)), ("keys", codec.encode_keys(x))):
        assert enc.codes.shape == (2, 16, 3, 4)
        err = (codec.decode(enc, torch.float32) - x).abs().double()
        assert (err <= error_bound("int2", x, axis, group_size or 16)).all()
    # The bound is not vacuous: over 16 tokens per key group the error nears half a step.
    assert (err / error_bound("int2", x, "keys", 16)).max() > 0.8


def test_head_dim_not_a_multiple_of_four_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"int2 codec packs 4 codes per byte.*head_dim=6"):
        Int2Codec().encode_keys(torch.zeros(4, 2, 6))
    with pytest.raises(ValueError, match="head_dim=6"):
        Int2Codec().bytes_per_token(num_kv_heads=2, head_dim=6, block_size=16)
    with pytest.raises(ValueError, match="multiple of 4"):
        pack_int2(torch.zeros(6, dtype=torch.uint8))
    with pytest.raises(TypeError, match="uint8"):
        pack_int2(torch.zeros(4, dtype=torch.int32))


def test_a_quarter_of_int8s_code_bytes() -> None:
    # 8 KV heads x 128 channels, blocks of 16: codes 2 x 8 x 128 / 4 = 512 bytes a token, the statistics as int8's.
    assert Int2Codec().bytes_per_token(8, 128, 16) == 512 + 2 * 128 + 2 * 16
