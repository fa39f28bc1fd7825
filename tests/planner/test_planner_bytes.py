"""KV bytes per token and per sequence, against figures worked out by hand."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hf_kvgov.codecs.numerics import LOG_SCALE
from hf_kvgov.codecs.registry import get_codec
from hf_kvgov.planner import CacheSetup, ModelGeometry, codec_format, resolve_model, sequence_bytes
from hf_kvgov.planner.accounting import shared_store_bytes


def test_llama_13b_fp16_bytes_per_token_is_819200() -> None:
    # 2 (K, V) x 40 layers x 40 heads x 128 x 2 B.
    assert resolve_model("LLaMA-13B").kv_bytes_per_token("fp16") == 819_200


def test_llama_13b_2048_token_sequence_is_1_68_gb() -> None:
    geometry = resolve_model("llama-13b")
    paged = sequence_bytes(geometry, CacheSetup(paged=True), 2048)
    static = sequence_bytes(geometry, CacheSetup(paged=False, max_len=2048), 2048)
    assert paged.device == static.device == 1_677_721_600
    assert paged.disk == 0


def test_smollm2_bytes_per_token_by_dtype() -> None:
    geometry = resolve_model("SmolLM2-135M")
    assert geometry.kv_bytes_per_token("fp16") == 2 * 30 * 3 * 64 * 2 == 23_040
    # The CPU runtime keeps the cache in float32.
    assert geometry.kv_bytes_per_token("fp32") == 46_080
    assert geometry.kv_bytes_per_token("bfloat16") == 23_040


def test_block_rounding_holds_whole_blocks(unit: ModelGeometry) -> None:
    setup = CacheSetup(block_size=4)  # a 4-token block of `unit` is 4 x 32 = 128 B
    assert [sequence_bytes(unit, setup, n).device for n in (1, 4, 5, 8, 9)] == [128, 128, 256, 256, 384]


def test_int8_sealed_block_bytes_by_hand() -> None:
    # block 16 x head_dim 128: codes 2 x 16 x 128 = 4096, key scale+zero per channel 128 x 2 x 2 = 512,
    # value scale+zero per token 16 x 2 x 2 = 64.
    assert codec_format("int8").block_bytes(16, 128) == 4672
    # int4 packs two codes per byte: 2 x 16 x 128 / 2 = 2048 codes, same scales.
    assert codec_format("int4").block_bytes(16, 128) == 2048 + 512 + 64
    # fp8: 2 x 16 x 128 codes + keys centred per channel (an fp16 scale and an e4m3 zero, 128 x (2 + 1)) + a
    # symmetric value scale per token (16 x 2).
    assert codec_format("fp8").block_bytes(16, 128) == 4096 + 384 + 32
    # Value groups of 32 channels: 4 scale/zero pairs per token instead of one.
    assert codec_format("int8", group_size=32).block_bytes(16, 128) == 4096 + 512 + 16 * 4 * 2 * 2


def test_int8_sequence_keeps_sink_and_tail_in_fp16(tiny: ModelGeometry) -> None:
    # Per layer and head, block 4 x head_dim 8: fp16 block 2 x 4 x 8 x 2 = 128 B; int8 block codes 64 +
    # key stats 8 x 2 x 2 = 32 + value stats 4 x 2 x 2 = 16 = 112 B. tiny has 2 x 3 = 6 (layer, head) pairs.
    setup = CacheSetup(block_size=4, codec="int8")
    # 13 tokens: blocks 4,4,4,1 -> sink fp16, two sealed int8, partly filled tail fp16.
    assert sequence_bytes(tiny, setup, 13).device == 6 * (128 + 112 + 112 + 128)
    # 12 tokens: blocks 4,4,4 -> sink fp16, two sealed (no partial tail).
    assert sequence_bytes(tiny, setup, 12).device == 6 * (128 + 112 + 112)
    # 3 tokens: the only block is the sink.
    assert sequence_bytes(tiny, setup, 3).device == 6 * 128


def test_the_residual_window_keeps_the_newest_blocks_in_fp16(tiny: ModelGeometry) -> None:
    # As above (fp16 block 128 B, int8 block 112 B), with the newest 5 tokens in full precision: a block is
    # sealed once full and older than them.
    setup = CacheSetup(block_size=4, codec="int8", residual=5)
    # 13 tokens: block 1 (tokens 4-7) is sealed, block 2 (8-11) holds token 8 of the window [8, 13): fp16.
    assert sequence_bytes(tiny, setup, 13).device == 6 * (128 + 112 + 128 + 128)
    # 17 tokens: window [12, 17); blocks 1 and 2 sealed, 3 and the tail in fp16.
    assert sequence_bytes(tiny, setup, 17).device == 6 * (128 + 2 * 112 + 2 * 128)
    # A spilled run ends before the window: with 4 hot tokens blocks 1 and 2 spill, both sealed.
    spilling = CacheSetup(block_size=4, codec="int8", residual=5, spill_hot_tokens=4, spill_pinned_blocks=1)
    assert sequence_bytes(tiny, spilling, 17).disk == 6 * 2 * 112
    # Only sealed blocks spill: with the newest 9 tokens in full precision, block 2 stays (in fp16).
    wide = dataclasses.replace(spilling, residual=9)
    assert sequence_bytes(tiny, wide, 17).disk == 6 * 112
    with pytest.raises(ValueError, match="residual"):
        CacheSetup(block_size=4, codec="int8", residual=-1)


def test_int8_per_token_cost_approaches_codes_plus_scales_for_long_sequences() -> None:
    geometry = resolve_model("llama-13b")
    setup = CacheSetup(codec="int8")
    # 2048 tokens = 128 blocks: 1 fp16 sink block + 127 sealed int8 blocks, for each of 40 x 40 (layer, head).
    expected = 40 * 40 * (1 * 2 * 16 * 128 * 2 + 127 * 4672)
    assert sequence_bytes(geometry, setup, 2048).device == expected


def test_gemma3_sliding_layers_capped_at_window() -> None:
    geometry = resolve_model("Gemma-3-270M")
    assert geometry.sliding_window == 512
    assert [i for i in range(18) if i not in geometry.sliding_layers] == [5, 11, 17]
    per_layer_token = 2 * 1 * 256 * 2  # one KV head of 256 channels in fp16
    setup = CacheSetup(block_size=16)
    # 2048 tokens: 3 full layers hold 2048; 15 sliding layers hold the 32 blocks of the last 512.
    assert sequence_bytes(geometry, setup, 2048).device == (3 * 2048 + 15 * 512) * per_layer_token
    # 2050 tokens: 129 blocks in full layers; the window [1538, 2050) spans blocks 96..128 = 33 blocks.
    assert sequence_bytes(geometry, setup, 2050).device == (3 * 129 * 16 + 15 * 33 * 16) * per_layer_token
    # Shorter than the window: every layer holds every block.
    assert sequence_bytes(geometry, setup, 100).device == 18 * 7 * 16 * per_layer_token
    # A static buffer: max_len in full layers, the window in sliding ones.
    static = CacheSetup(paged=False, max_len=4096)
    assert sequence_bytes(geometry, static, 10).device == (3 * 4096 + 15 * 512) * per_layer_token


def test_prefix_sharing_counts_whole_shared_blocks_once(unit: ModelGeometry) -> None:
    setup = CacheSetup(block_size=4, shared_fraction=0.5)
    own = sequence_bytes(unit, setup, 10)
    # 50% of 10 tokens = 5, rounded down to whole blocks = 4 shared; 6 own tokens = 2 blocks.
    assert own.shared_tokens == 4
    assert own.device == 2 * 128
    assert shared_store_bytes(unit, setup, 4) == 128


def test_h2o_keeps_budget_fraction_but_never_less_than_recent_window(unit: ModelGeometry) -> None:
    # 100 tokens, 20% -> 20 kept = 5 blocks (640 B) + 4 B of attention mass per slot (20 x 4 = 80 B).
    setup = CacheSetup(block_size=4, h2o_budget=0.2, h2o_recent=8)
    assert sequence_bytes(unit, setup, 100).device == 640 + 80
    # 5% would keep 5 tokens, but the 8-token recent window stays: 2 blocks (256 B) + 8 slots x 4 B.
    small = CacheSetup(block_size=4, h2o_budget=0.05, h2o_recent=8)
    assert sequence_bytes(unit, small, 100).device == 256 + 32


def test_spill_keeps_hot_window_on_device_and_the_rest_on_disk(unit: ModelGeometry) -> None:
    setup = CacheSetup(block_size=4, spill_hot_tokens=10)
    result = sequence_bytes(unit, setup, 100)
    # 25 blocks; the last ceil(10 / 4) = 3 stay on the accelerator, 22 go to disk.
    assert (result.device, result.disk) == (3 * 128, 22 * 128)
    # Shorter than the hot window: nothing spills.
    assert sequence_bytes(unit, setup, 9).disk == 0


def test_static_buffer_rejects_longer_sequence(unit: ModelGeometry) -> None:
    with pytest.raises(ValueError, match="does not fit a static buffer of 16"):
        sequence_bytes(unit, CacheSetup(paged=False, max_len=16), 17)


@pytest.mark.parametrize("name", ["int8", "int4", "int2", "fp8"])
@pytest.mark.parametrize(("block", "head_dim"), [(16, 64), (128, 64), (16, 128)])
@pytest.mark.parametrize(("scale_dtype", "scale_bytes"), [(torch.float16, 2), (torch.float32, 4), (LOG_SCALE, 1)])
def test_codec_formats_match_what_the_codecs_store(
    name: str, block: int, head_dim: int, scale_dtype: torch.dtype, scale_bytes: int
) -> None:
    # The planner's arithmetic against the bytes the codec really produces for one block of one head.
    codec = get_codec({"fp8": "fp8_e4m3"}.get(name, name), scale_dtype=scale_dtype, group_size=32)
    x = torch.randn(block, 1, head_dim)  # [tokens, kv_heads, head_dim]
    stored = codec.nbytes(codec.encode_keys(x)) + codec.nbytes(codec.encode_values(x))
    assert codec_format(name, scale_bytes, 32).block_bytes(block, head_dim) == stored
