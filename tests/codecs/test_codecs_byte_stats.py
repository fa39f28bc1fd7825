"""One-byte statistics: logarithmic scale bytes and e4m3 zero points (`hf_kvgov.codecs.numerics`)."""

from __future__ import annotations

import pytest
import torch

from hf_kvgov.codecs import get_codec
from hf_kvgov.codecs.numerics import LOG_SCALE, ONE_BYTE_ZERO, log_scale_table, round_down, round_up, stat_to_float


def test_the_scale_byte_spans_2_to_the_minus_12_to_608_in_twelfths_of_an_octave() -> None:
    table = log_scale_table()
    assert table[0] == 2.0**-12 and table[144] == 1.0 and table[156] == 2.0
    assert table[255] == pytest.approx(2.0 ** (111 / 12))
    assert torch.allclose(table[1:] / table[:-1], torch.full((255,), 2 ** (1 / 12)))


def test_rounding_lands_on_the_next_grid_value_in_its_direction() -> None:
    x = torch.tensor([1.0, 1.0001, 2.0**-13, 0.0, 600.0])
    codes = round_up(x, LOG_SCALE)
    assert codes.dtype == torch.uint8 and codes.tolist() == [144, 145, 0, 0, 255]
    assert bool((stat_to_float(codes) >= x).all())
    zeros = round_down(torch.tensor([5.1, -5.1, 5.0, 0.3, 447.0]), ONE_BYTE_ZERO)
    assert zeros.dtype == ONE_BYTE_ZERO and zeros.float().tolist() == [5.0, -5.5, 5.0, 0.28125, 416.0]


def test_values_outside_one_byte_raise_instead_of_clipping() -> None:
    with pytest.raises(
        ValueError, match=r"A scale of 700 lies outside the one-byte range .*scale_dtype=torch\.float16"
    ):
        round_up(torch.tensor([1.0, 700.0]), LOG_SCALE)
    with pytest.raises(ValueError, match=r"A zero point of -449 lies outside the one-byte range \[-448, 448\]"):
        round_down(torch.tensor([-449.0]), ONE_BYTE_ZERO)
    codec = get_codec("int2", scale_dtype=LOG_SCALE)
    with pytest.raises(ValueError, match="zero point of -500"):
        codec.encode_keys(torch.full((16, 1, 4), -500.0))
    # fp16 statistics hold the same keys.
    assert torch.equal(
        get_codec("int2").decode(get_codec("int2").encode_keys(torch.full((16, 1, 4), -500.0)), torch.float32),
        torch.full((16, 1, 4), -500.0),
    )


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
def test_integer_codes_stay_within_half_a_stored_step(name: str) -> None:
    """The bound of the fp16 statistics, with the stored (one-byte) scale, which is at most 2**(1/12) too wide."""
    codec = get_codec(name, scale_dtype=LOG_SCALE, group_size=16)
    generator = torch.Generator().manual_seed(3)
    # Offset channels (as RoPE'd keys have) and small values, where a float byte would lose its precision.
    keys = torch.randn(2, 16, 3, 64, generator=generator) * 2 + torch.linspace(-30, 30, 64)
    values = torch.randn(2, 16, 3, 64, generator=generator) * 0.01
    levels = 2**codec.bits - 1
    for x, enc, dim in ((keys, codec.encode_keys(keys), 1), (values, codec.encode_values(values), -1)):
        assert enc.scale.dtype == LOG_SCALE and enc.zero is not None and enc.zero.dtype == ONE_BYTE_ZERO
        grouped = x if dim == 1 else x.unflatten(-1, (4, 16))
        scale = stat_to_float(enc.scale if dim == 1 else enc.scale.unsqueeze(-1))
        zero = stat_to_float(enc.zero if dim == 1 else enc.zero.unsqueeze(-1))
        decoded = codec.decode(enc, torch.float32)
        error = (decoded - x).abs() if dim == 1 else (decoded - x).abs().unflatten(-1, (4, 16))
        assert bool((error <= scale / 2 * (1 + 1e-5) + 1e-7).all())
        lo, hi = torch.aminmax(grouped, dim=dim, keepdim=True)
        assert bool((zero <= lo).all())
        needed = (hi - zero) / levels
        assert bool((scale >= needed).all())
        # Above the byte's floor (2**-12, which int8's small value groups reach) the scale is at most one twelfth
        # of an octave too wide.
        widest = torch.maximum(needed * 2 ** (1 / 12) * (1 + 1e-6), torch.tensor(2.0**-12))
        assert bool((scale <= widest).all())


def test_a_constant_group_decodes_exactly_and_statistics_cost_one_byte() -> None:
    codec = get_codec("int2", scale_dtype=LOG_SCALE, group_size=32)
    block = torch.full((16, 3, 64), 1.5)
    for enc in (codec.encode_keys(block), codec.encode_values(block)):
        assert torch.equal(codec.decode(enc, torch.float32), block)
    # Per KV head and token: 64 / 4 code bytes each for keys and values, 64 key channels x (scale + zero) / 16
    # tokens, 2 value groups x (scale + zero).
    assert codec.bytes_per_token(3, 64, 16) == 3 * (16 + 16 + 8 + 4) == 3 * 44
    enc = codec.encode_keys(torch.randn(16, 3, 64)), codec.encode_values(torch.randn(16, 3, 64))
    assert sum(e.nbytes for e in enc) == 16 * 3 * 44
    assert get_codec("int2", group_size=32).bytes_per_token(3, 64, 16) == 3 * 56  # fp16 statistics
