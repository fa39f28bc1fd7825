"""What every codec promises: shapes, dtypes, exact constants, finite checks, byte accounting."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hf_kvgov.codecs import Encoded, GroupAxis, KVCodec, available_codecs, get_codec

NAMES = ["int8", "int4", "int2", "fp8_e4m3", "fp8_e5m2"]


def test_registry_holds_the_five_formats() -> None:
    assert sorted(NAMES) == list(available_codecs())


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("lead", [(), (3,), (2, 1)])
def test_layout_shapes(name: str, lead: tuple[int, ...]) -> None:
    codec = get_codec(name, group_size=4)
    x = torch.randn(*lead, 5, 2, 8)
    per_byte = 8 // codec.bits
    keys, values = codec.encode_keys(x), codec.encode_values(x)
    assert keys.codes.shape == values.codes.shape == (*lead, 5, 2, 8 // per_byte)
    assert keys.scale.shape == (*lead, 1, 2, 8)
    assert values.scale.shape == (*lead, 5, 2, 2)
    assert (keys.axis, keys.group_size) == (GroupAxis.CHANNEL, 5)
    assert (values.axis, values.group_size) == (GroupAxis.TOKEN, 4)
    assert keys.shape == values.shape == (*lead, 5, 2, 8)
    # Integer codes carry a zero point on both; fp8 centres keys only (values are symmetric).
    assert keys.zero is not None
    assert (values.zero is not None) == (name in ("int8", "int4", "int2"))
    for enc in (keys, values):
        assert enc.scale.dtype == torch.float16
        assert enc.zero is None or enc.zero.shape == enc.scale.shape


@pytest.mark.parametrize("name", NAMES)
def test_an_empty_batch_of_blocks_round_trips(name: str) -> None:
    codec = get_codec(name)
    x = torch.empty(0, 4, 2, 8)
    assert codec.decode(codec.encode_keys(x), torch.float16).shape == (0, 4, 2, 8)


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
def test_constant_groups_decode_exactly(name: str, scale_dtype: torch.dtype) -> None:
    # Constants a float16 zero point holds exactly; each key channel and each value token is constant.
    per_channel = torch.tensor([0.75, -3.0, 0.0, 1000.5]).expand(6, 2, 4).contiguous()
    per_token = torch.tensor([0.75, -3.0, 0.0, 1000.5, 5.0, -0.125]).reshape(6, 1, 1).expand(6, 2, 4).contiguous()
    codec = get_codec(name, scale_dtype=scale_dtype)
    assert torch.equal(codec.decode(codec.encode_keys(per_channel), torch.float32), per_channel)
    assert torch.equal(codec.decode(codec.encode_values(per_token), torch.float32), per_token)


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
def test_constant_float32_group_decodes_exactly_with_float32_scales(name: str) -> None:
    x = torch.full((4, 1, 4), 0.1)  # 0.1 is not a float16 value, but it is a float32 one
    codec = get_codec(name, scale_dtype=torch.float32)
    assert torch.equal(codec.decode(codec.encode_keys(x), torch.float32), x)


@pytest.mark.parametrize("name", NAMES)
def test_all_zero_block_decodes_to_zeros(name: str) -> None:
    codec = get_codec(name)
    x = torch.zeros(2, 4, 2, 8)
    for enc in (codec.encode_keys(x), codec.encode_values(x)):
        out = codec.decode(enc, torch.float32)
        assert torch.equal(out, x)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_rejected_naming_the_tensor(name: str, bad: float) -> None:
    codec = get_codec(name)
    x = torch.randn(4, 2, 8)
    x[2, 1, 3] = bad
    with pytest.raises(ValueError, match=rf"The keys passed to the {name} codec contain NaN or inf"):
        codec.encode_keys(x)
    with pytest.raises(ValueError, match=rf"The values passed to the {name} codec contain NaN or inf"):
        codec.encode_values(x.half())
    # The opt-out skips the check (the caller vouches for finite K/V).
    get_codec(name, check_finite=False).encode_keys(x)


@pytest.mark.parametrize("name", NAMES)
def test_float16_scales_that_overflow_are_rejected(name: str) -> None:
    # int: the zero point (the min) leaves float16's +-65504; fp8: the scale amax / finfo.max does.
    amax = {"int8": 7e4, "int4": 7e4, "int2": 7e4, "fp8_e4m3": 65504 * 448 * 1.01, "fp8_e5m2": 65504 * 57344 * 1.01}[
        name
    ]
    x = torch.tensor([-amax, amax]).reshape(2, 1, 1).expand(2, 1, 4).contiguous()
    with pytest.raises(ValueError, match=r"scale_dtype=torch\.float32"):
        get_codec(name).encode_keys(x)
    codec = get_codec(name, scale_dtype=torch.float32)
    out = codec.decode(codec.encode_keys(x), torch.float32)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_and_output_dtypes(name: str, dtype: torch.dtype) -> None:
    codec = get_codec(name)
    x = torch.randn(2, 8, 2, 16, generator=torch.Generator().manual_seed(6)).to(dtype)
    enc = codec.encode_values(x)
    full = codec.decode(enc, torch.float32)
    for out_dtype in (torch.float32, torch.float16, torch.bfloat16):
        out = codec.decode(enc, out_dtype)
        assert out.dtype == out_dtype
        assert torch.equal(out, full.to(out_dtype))  # float32 math, one cast at the end
    # Error relative to the group range: int4 is the coarsest (half of 1/15), fp8 e5m2 1/8 of |x|.
    assert (full - x.float()).abs().max() <= 0.6 * x.float().abs().amax()


def test_input_validation_messages() -> None:
    codec = get_codec("int8")
    with pytest.raises(TypeError, match=r"float32, float16 or bfloat16; got torch.int64"):
        codec.encode_keys(torch.zeros(4, 2, 8, dtype=torch.int64))
    with pytest.raises(TypeError, match=r"float32, float16 or bfloat16; got torch.float64"):
        codec.encode_values(torch.zeros(4, 2, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"at least 3 dims\); got shape \(4, 8\)"):
        codec.encode_keys(torch.zeros(4, 8))
    with pytest.raises(ValueError, match="at least one token"):
        codec.encode_keys(torch.zeros(0, 2, 8))
    with pytest.raises(TypeError, match="decode can return"):
        codec.decode(codec.encode_keys(torch.zeros(4, 2, 8)), torch.int8)


def test_group_size_validation() -> None:
    with pytest.raises(
        ValueError, match=r"group_size=48 does not divide head_dim=64; use one of \[1, 2, 4, 8, 16, 32, 64\]"
    ):
        get_codec("int8", group_size=48).encode_values(torch.zeros(4, 2, 64))
    with pytest.raises(ValueError, match="group_size=48 does not divide head_dim=64"):
        get_codec("fp8_e4m3", group_size=48).bytes_per_token(2, 64, 16)
    # Keys ignore group_size: one scale per channel whatever it is.
    assert get_codec("int8", group_size=48).encode_keys(torch.zeros(4, 2, 64)).scale.shape == (1, 2, 64)
    for bad in (0, -4, True, 2.0):
        with pytest.raises(ValueError, match="group_size must be a positive int or None"):
            get_codec("int4", group_size=bad)
    with pytest.raises(
        ValueError, match=r"scale_dtype must be torch\.float16, torch\.float32 or torch\.uint8 \(one logarithmic byte"
    ):
        get_codec("int4", scale_dtype=torch.bfloat16)


def test_decode_refuses_mismatched_encodings() -> None:
    x = torch.randn(4, 2, 8)
    with pytest.raises(ValueError, match="The int4 codec cannot decode data encoded by the int8 codec"):
        get_codec("int4").decode(get_codec("int8").encode_keys(x), torch.float32)
    enc = get_codec("int8").encode_keys(x)
    without_zero = dataclasses.replace(enc, zero=None)
    with pytest.raises(ValueError, match="needs zero points"):
        get_codec("int8").decode(without_zero, torch.float32)
    with pytest.raises(ValueError, match=r"must have shape \(1, 2, 8\); got \(4, 2, 8\)"):
        dataclasses.replace(enc, scale=torch.ones(4, 2, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="group_size must be 4"):
        dataclasses.replace(enc, group_size=2)
    with pytest.raises(ValueError, match="codes must share all but the last dim"):
        dataclasses.replace(enc, codes=enc.codes[:2])


def test_codecs_and_encodings_are_frozen() -> None:
    codec = get_codec("int8")
    enc = codec.encode_keys(torch.randn(4, 2, 8))
    with pytest.raises(dataclasses.FrozenInstanceError):
        codec.group_size = 4  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        enc.codes = enc.codes  # type: ignore[misc]


# Bytes of one full block [16 tokens, 2 heads, 8 channels] with float16 statistics, by hand:
# keys:   codes 16*2*8 * bits/8, scales (and zeros) 2*8 per block, 2 bytes each;
# values: codes as keys, scales (and zeros) 16*2 tokens x heads (one group), 2 bytes each.
HAND_BLOCK_BYTES = {
    "int8": (256 + 2 * 32, 256 + 2 * 64),
    "int4": (128 + 2 * 32, 128 + 2 * 64),
    "int2": (64 + 2 * 32, 64 + 2 * 64),
    # keys: a 2-byte scale and a 1-byte e4m3 zero per channel; values: a scale per token
    "fp8_e4m3": (256 + 2 * 16 + 16, 256 + 64),
    "fp8_e5m2": (256 + 2 * 16 + 16, 256 + 64),
}


@pytest.mark.parametrize("name", NAMES)
def test_nbytes_is_the_real_tensor_bytes(name: str) -> None:
    codec = get_codec(name)
    x = torch.randn(16, 2, 8)
    keys, values = codec.encode_keys(x), codec.encode_values(x)
    assert (codec.nbytes(keys), codec.nbytes(values)) == HAND_BLOCK_BYTES[name]
    for enc in (keys, values):
        tensors = [enc.codes, enc.scale] + ([] if enc.zero is None else [enc.zero])
        assert codec.nbytes(enc) == sum(t.untyped_storage().nbytes() for t in tensors)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
    ("heads", "head_dim", "block_size", "group_size", "scale_dtype"),
    [
        (2, 8, 16, None, torch.float16),
        (4, 64, 32, 16, torch.float32),
        (1, 12, 3, 2, torch.float16),
        (3, 4, 5, None, torch.float16),  # key statistics amortise to a fraction of a byte per token
    ],
)
def test_bytes_per_token_matches_an_encoded_full_block(
    name: str, heads: int, head_dim: int, block_size: int, group_size: int | None, scale_dtype: torch.dtype
) -> None:
    codec = get_codec(name, group_size=group_size, scale_dtype=scale_dtype)
    block = torch.randn(block_size, heads, head_dim)
    total = codec.nbytes(codec.encode_keys(block)) + codec.nbytes(codec.encode_values(block))
    assert codec.bytes_per_token(heads, head_dim, block_size) == pytest.approx(total / block_size, rel=1e-12)


def test_bytes_per_token_for_a_llama_like_layer() -> None:
    # 8 KV heads x 128 channels, blocks of 16, float16 stats. K+V codes: 2*8*128*bits/8 bytes;
    # key stats 8*128 per block / 16 tokens; value stats 8 per token; x2 with a zero point (fp8: keys only).
    expected = {
        "int8": 2048 + 2 * 128 + 2 * 16, "int4": 1024 + 2 * 128 + 2 * 16, "int2": 512 + 2 * 128 + 2 * 16,
        "fp8_e4m3": 2048 + 128 + 64 + 16,  # fp8 key zero points are one e4m3 byte: half a scale's cost
    }  # fmt: skip
    for name, value in expected.items():
        assert get_codec(name).bytes_per_token(num_kv_heads=8, head_dim=128, block_size=16) == value
    with pytest.raises(ValueError, match="block_size must be a positive int; got 0"):
        get_codec("int8").bytes_per_token(8, 128, 0)


def test_codecs_are_stateless() -> None:
    codec: KVCodec = get_codec("int4", group_size=4)
    x = torch.randn(3, 8, 2, 8)
    a, b = codec.encode_values(x), codec.encode_values(x)
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale)
    assert codec == get_codec("int4", group_size=4)
    assert isinstance(a, Encoded)
