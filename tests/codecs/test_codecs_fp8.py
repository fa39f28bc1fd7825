"""fp8 e4m3 / e5m2: hand-made bytes, round-to-nearest-even on the format grid, relative bounds."""

from __future__ import annotations

import pytest
import torch
from kv_codec_reference import FP8_FORMATS, error_bound

from hf_kvgov.codecs import Encoded, Fp8E4M3Codec, Fp8E5M2Codec, GroupAxis, get_codec

# Bytes written by hand from the bit layouts (sign | exponent | mantissa) and what they mean.
# e4m3fn, bias 7:  0x38 = 0 0111 000 = 1.0    0x7E = 0 1111 110 = 1.75 * 2**8 = 448
#                  0x01 = 0 0000 001 = 2**-9 (smallest subnormal)    0xB8 = -1.0
# e5m2, bias 15:   0x3C = 0 01111 00 = 1.0    0x7B = 0 11110 11 = 1.75 * 2**15 = 57344
#                  0x01 = 0 00000 01 = 2**-16 (smallest subnormal)   0xBC = -1.0
HAND_BYTES = {
    "fp8_e4m3": ([0x38, 0x7E, 0x01, 0xB8], [1.0, 448.0, 2.0**-9, -1.0]),
    "fp8_e5m2": ([0x3C, 0x7B, 0x01, 0xBC], [1.0, 57344.0, 2.0**-16, -1.0]),
}


@pytest.mark.parametrize("name", sorted(HAND_BYTES))
def test_hand_made_bytes_decode_to_known_values(name: str) -> None:
    codec = get_codec(name, scale_dtype=torch.float32)
    raw, meaning = HAND_BYTES[name]
    enc = Encoded(
        codes=torch.tensor(raw, dtype=torch.uint8).view(codec.codes_dtype).reshape(1, 1, 4),
        scale=torch.tensor([[[0.25]]]),
        zero=None,
        shape=(1, 1, 4),
        axis=GroupAxis.TOKEN,
        group_size=4,
        codec=name,
    )
    assert codec.decode(enc, torch.float32).flatten().tolist() == [0.25 * m for m in meaning]


def test_e4m3_scale_maps_amax_to_448_and_rounds_to_nearest_even() -> None:
    # amax 448 -> scale exactly 1, so codes are the values on the e4m3 grid (step 1/8 in [1, 2)).
    # 1.0625 is halfway between 1.0 and 1.125: ties go to the even mantissa, 1.0.
    # 1.1875 is halfway between 1.125 and 1.25: ties go to 1.25. 3.3 -> nearest grid point 3.25.
    v = torch.tensor([448.0, 1.0625, 1.1875, -3.3, 2.0**-4, 0.0]).reshape(1, 1, 6)
    enc = Fp8E4M3Codec().encode_values(v)
    assert enc.codes.dtype == torch.float8_e4m3fn and enc.zero is None
    assert enc.scale.item() == 1.0
    expected = [448.0, 1.0, 1.25, -3.25, 2.0**-4, 0.0]
    assert Fp8E4M3Codec().decode(enc, torch.float32).flatten().tolist() == expected
    assert enc.codes.view(torch.uint8).flatten().tolist()[:2] == [0x7E, 0x38]


def test_e5m2_scales_amax_onto_57344() -> None:
    v = torch.tensor([3.5, -7.0, 1.0]).reshape(1, 1, 3)  # one token's values: symmetric, amax 7
    enc = Fp8E5M2Codec(scale_dtype=torch.float32).encode_values(v)
    assert enc.zero is None
    assert enc.scale.item() == pytest.approx(7.0 / 57344, rel=2**-23)
    assert Fp8E5M2Codec().decode(enc, torch.float32).flatten().tolist() == pytest.approx([3.5, -7.0, 1.0])


def test_keys_are_centred_so_a_steady_channel_offset_costs_no_precision() -> None:
    # One key channel at 15 +- 2 over four tokens. Centred: zero 15, deviations -2, 0, 2, -0.5 on the scale
    # 2 / 448, i.e. codes -448, 0, 448, -112, all on the e4m3 grid, so the channel decodes exactly.
    k = torch.tensor([13.0, 15.0, 17.0, 14.5]).reshape(4, 1, 1)
    enc = Fp8E4M3Codec(scale_dtype=torch.float32).encode_keys(k)
    assert enc.zero is not None and enc.zero.item() == 15.0
    assert enc.scale.item() == pytest.approx(2.0 / 448, rel=2**-23)
    assert enc.codes.float().flatten().tolist() == [-448.0, 0.0, 448.0, -112.0]
    assert Fp8E4M3Codec().decode(enc, torch.float32).flatten().tolist() == pytest.approx([13, 15, 17, 14.5], rel=1e-6)
    # Scaled symmetrically (as a value), 14.5 lands on the grid step of 17: 14.5 * 448 / 17 = 382.1 -> 384.
    as_value = Fp8E4M3Codec(scale_dtype=torch.float32).encode_values(k.reshape(1, 1, 4))
    decoded = Fp8E4M3Codec().decode(as_value, torch.float32).flatten()
    assert decoded[3].item() == pytest.approx(384 * 17 / 448, rel=1e-6)


@pytest.mark.parametrize("name", sorted(FP8_FORMATS))
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
def test_relative_error_bound(name: str, scale_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(4)
    # Log-uniform magnitudes across five decades, so normal and subnormal codes both occur.
    x = torch.randn(2, 16, 2, 32, generator=gen).sign() * 10 ** (torch.rand(2, 16, 2, 32, generator=gen) * 5 - 3)
    codec = get_codec(name, scale_dtype=scale_dtype)
    mantissa = FP8_FORMATS[name][0]
    for axis, enc in (("keys", codec.encode_keys(x)), ("values", codec.encode_values(x))):
        err = (codec.decode(enc, torch.float32) - x).abs().double()
        assert (err <= error_bound(name, x, axis, 32)).all()
        # Half an ulp of relative error is actually reached on the large values.
        big = x.abs() > x.abs().amax() / 16
        assert (err[big] / x.abs()[big]).max() > 0.6 * 2.0 ** -(mantissa + 1)


def test_e4m3_is_tighter_than_e5m2() -> None:
    x = torch.randn(16, 4, 32, generator=torch.Generator().manual_seed(5))
    errs = {n: (get_codec(n).decode(get_codec(n).encode_keys(x), torch.float32) - x).abs().mean() for n in FP8_FORMATS}
    assert errs["fp8_e4m3"] < errs["fp8_e5m2"] / 1.5


@pytest.mark.parametrize("name", sorted(FP8_FORMATS))
def test_constant_nonzero_group_stays_finite_and_close(name: str) -> None:
    k = torch.full((8, 2, 4), -0.3)
    codec = get_codec(name)
    out = codec.decode(codec.encode_keys(k), torch.float32)
    assert torch.isfinite(out).all()
    assert ((out - k).abs() <= 0.3 * 2.0 ** -(FP8_FORMATS[name][0] + 1)).all()
