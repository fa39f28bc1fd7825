"""int8: hand-computed codes, the half-step bound, directed rounding of float16 statistics."""

from __future__ import annotations

import pytest
import torch
from kv_codec_reference import error_bound, group_stats

from hf_kvgov.codecs import Int8Codec


def test_keys_per_channel_hand_computed() -> None:
    # Channel 0 spans [-1, -1 + 255/64]: scale exactly 1/64, zero -1, so the codes are the numerators.
    # Channel 1 is constant 0.5: scale 1, all codes 0, decoded exactly.
    ch0 = torch.tensor([-1.0, -1 + 10 / 64, -1 + 200 / 64, -1 + 255 / 64])
    k = torch.stack([ch0, torch.full((4,), 0.5)], dim=-1).unsqueeze(1)  # [T=4, H=1, D=2]
    enc = Int8Codec().encode_keys(k)
    assert enc.codes.dtype == torch.uint8
    assert enc.codes[:, 0, 0].tolist() == [0, 10, 200, 255]
    assert enc.codes[:, 0, 1].tolist() == [0, 0, 0, 0]
    assert enc.scale.shape == (1, 1, 2)
    assert enc.scale.flatten().tolist() == [1 / 64, 1.0]
    assert enc.zero is not None and enc.zero.flatten().tolist() == [-1.0, 0.5]
    assert torch.equal(Int8Codec().decode(enc, torch.float32), k)


def test_values_per_token_groups_hand_computed() -> None:
    # One token, one head, D=8 in two groups of 4: group 0 spans [0, 255/8], group 1 spans [-4, -4 + 255/2].
    v = torch.tensor([0, 1, 2, 255, -8, -7, 0, 247], dtype=torch.float32)
    v = (v / torch.tensor([8.0] * 4 + [2.0] * 4)).reshape(1, 1, 8)
    enc = Int8Codec(group_size=4).encode_values(v)
    assert enc.scale.shape == (1, 1, 2)
    assert enc.scale.flatten().tolist() == [1 / 8, 1 / 2]
    assert enc.zero is not None and enc.zero.flatten().tolist() == [0.0, -4.0]
    assert enc.codes.flatten().tolist() == [0, 1, 2, 255, 0, 1, 8, 255]
    assert torch.equal(Int8Codec(group_size=4).decode(enc, torch.float32), v)


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("group_size", [None, 8])
def test_random_blocks_within_half_step(scale_dtype: torch.dtype, group_size: int | None) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 16, 2, 32, generator=gen) * 3 + torch.randn(1, 1, 2, 32, generator=gen) * 5
    codec = Int8Codec(group_size=group_size, scale_dtype=scale_dtype)
    for axis, enc in (("keys", codec.encode_keys(x)), ("values", codec.encode_values(x))):
        err = (codec.decode(enc, torch.float32) - x).abs().double()
        assert (err <= error_bound("int8", x, axis, group_size or 32)).all()


def test_stored_scale_is_range_over_255_rounded_up() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(16, 4, 8, generator=gen) * 7 + 3
    enc = Int8Codec().encode_keys(x)
    assert enc.zero is not None
    lo, hi, _ = group_stats(x, "keys", 16)
    lo, hi = lo[:1], hi[:1]  # one statistic per (head, channel): the [1, H, D] stored shape
    zero, scale = enc.zero.double(), enc.scale.double()
    exact = (hi - zero) / 255
    assert (scale >= exact).all()  # rounded up: the group max never clips
    assert (scale <= exact * (1 + 2**-10)).all()
    assert (zero <= lo).all()  # rounded down: the group min never clips
    assert (zero >= lo - 2**-10 * lo.abs()).all()


def test_narrow_range_far_from_zero_keeps_its_resolution() -> None:
    # A code-unit zero point here would be about -1000 / (1 / 255) = -255000, beyond float16.
    x = (1000.3 + torch.linspace(0, 1, 16)).reshape(16, 1, 1)
    codec = Int8Codec()
    err = (codec.decode(codec.encode_keys(x), torch.float32) - x).abs()
    assert err.max() <= (1 + 0.5) / 255 / 2  # range 1, plus the zero sitting up to 0.5 below the min
