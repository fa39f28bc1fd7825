"""QuantizedCache with one-byte statistics (``scale_bytes=1``: a logarithmic scale byte and an e4m3 zero).

The same cache as with fp16 statistics, on every path that stores sealed blocks: generate against the
independent fake-quantizing DynamicCache, the sealed pieces' dtypes and bytes by hand and as the planner
counts them, the disk tier, the prefix namespace, and the refusals where slots keep fp16 statistics.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from quant_fake_reference import FakeQuantCache
from test_quant_cache_tiny import FORMATS, prompts, run
from transformers import DynamicCache

from hf_kvgov import GovernedCache, HeavyHitterCache, paged_attention
from hf_kvgov.bench.plan_setups import planner_geometry, planner_setup
from hf_kvgov.chain import Disk, Paging
from hf_kvgov.codecs.numerics import LOG_SCALE, ONE_BYTE_ZERO
from hf_kvgov.engine.quant_config import QuantConfig
from hf_kvgov.hf.quantized_cache import QuantizedCache
from hf_kvgov.hf.quantized_disk_cache import QuantizedDiskCache
from hf_kvgov.planner import sequence_bytes
from hf_kvgov.registry import get_cache_spec
from tests.conftest import tiny_llama

MODEL = tiny_llama()  # 2 layers, 2 KV heads, head_dim 16, float32


@pytest.mark.parametrize("path", ["contiguous", "paged"])
@pytest.mark.parametrize("codec", ["int2", "int4", "int8", "fp8_e4m3"])
def test_greedy_matches_fake_quantization_with_one_byte_statistics(codec: str, path: str) -> None:
    bits, fmt = FORMATS[codec]
    inputs = prompts(length=13)
    expected = run(MODEL, FakeQuantCache(MODEL.config, codec, block_size=4, scale_dtype=LOG_SCALE), inputs)
    cache = QuantizedCache(MODEL, bits=bits, fmt=fmt, block_size=4, residual=0, scale_bytes=1, attention=path)  # type: ignore[arg-type]
    with paged_attention(MODEL) if path == "paged" else torch.no_grad():
        got = run(MODEL, cache, inputs)
    assert torch.equal(got.sequences, expected.sequences)
    for got_step, expected_step in zip(got.scores, expected.scores, strict=True):
        torch.testing.assert_close(got_step, expected_step, atol=1e-5, rtol=1e-5)
    # And the statistics really are one byte: fp16 ones give other scores.
    fp16 = run(MODEL, FakeQuantCache(MODEL.config, codec, block_size=4), inputs)
    assert not all(torch.equal(a, b) for a, b in zip(got.scores, fp16.scores, strict=True))


def test_sealed_pieces_are_bytes_and_cost_what_the_planner_counts() -> None:
    cache = QuantizedCache(MODEL, bits=2, block_size=16, residual=16, group_size=8, scale_bytes=1)
    ids = torch.randint(3, 96, (1, 80), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        MODEL(ids[:, :-1], cache=cache)
        MODEL(ids[:, -1:], cache=cache)
    layout = cache._quantized_pool.sealed.layout(0)
    assert layout["key_scale"][1] == layout["value_scale"][1] == LOG_SCALE
    assert layout["key_zero"][1] == layout["value_zero"][1] == ONE_BYTE_ZERO
    stats = cache.stats()
    # 80 tokens, blocks of 16, the newest 16 in full precision: sink block 0 and block 4 stay float32, 1-3 sealed.
    assert (stats.full_precision_blocks, stats.sealed_blocks) == (2, 3)
    # One sealed block, per layer and KV head: codes 2 x 16 x 16 / 4, key statistics 16 channels x 2 bytes,
    # value statistics 16 tokens x 2 groups x 2 bytes; x 2 heads x 2 layers.
    sealed_block = 2 * 2 * (2 * 16 * 16 // 4 + 16 * 2 + 16 * 2 * 2)
    full_block = 2 * 2 * 2 * 16 * 16 * 4
    assert stats.sealed_bytes == 3 * sealed_block and stats.full_precision_bytes == 2 * full_block
    setup = planner_setup(cache, "fp32")
    assert setup is not None and (setup.scale_bytes, setup.residual) == (1, 16)
    assert sequence_bytes(planner_geometry(MODEL), setup, 80).device == stats.bytes_used
    fp16 = QuantizedCache(MODEL, bits=2, block_size=16, residual=0, group_size=8, scale_bytes=2)
    with torch.inference_mode():
        MODEL(ids[:, :-1], cache=fp16)
        MODEL(ids[:, -1:], cache=fp16)
    assert fp16.stats().sealed_bytes == 4 * 2 * 2 * (2 * 16 * 16 // 4 + 16 * 4 + 16 * 2 * 4)


def test_the_disk_tier_keeps_one_byte_statistics_losslessly(tmp_path: Path) -> None:
    codec = QuantConfig(bits=2, scale_bytes=1, group_size=8)
    inputs = prompts(length=40)
    resident = run(MODEL, GovernedCache(MODEL, pool=Paging(4), codec=codec), inputs)
    spilling = GovernedCache(MODEL, pool=Paging(4), codec=codec, spill=Disk(path=str(tmp_path), hot_tokens=8))
    spilled = run(MODEL, spilling, inputs)
    assert spilling.blocks_spilled > 0
    assert torch.equal(spilled.sequences, resident.sequences)
    for a, b in zip(spilled.scores, resident.scores, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_configuration_is_validated_saved_and_kept_apart() -> None:
    for bad in (0, 3, True, "1"):
        with pytest.raises(ValueError, match=r"scale_bytes must be 2 \(float16\), 1 \(one byte.*got"):
            QuantConfig(bits=2, scale_bytes=bad)
    config = QuantConfig(bits=2, residual=32, group_size=32, scale_bytes=1)
    assert (
        config.describe() == "int2 (value groups of 32), one-byte scales and zeros, newest 32 tokens in full precision"
    )
    assert QuantConfig(**config.to_json() | {"layer_formats": {}}) == config
    assert json.loads(json.dumps(config.to_json()))["scale_bytes"] == 1
    one = QuantizedCache(MODEL, bits=2, scale_bytes=1)
    two = QuantizedCache(MODEL, bits=2, scale_bytes=2)
    assert one.sharing_namespace != two.sharing_namespace  # sealed blocks of the two never mix in a tree
    assert two.sharing_namespace.endswith("sealed:int2:g=None:fp=[]:sink=1")  # the fp16 namespace is unchanged


def test_eviction_slots_refuse_one_byte_statistics() -> None:
    with pytest.raises(ValueError, match=r"cannot honour QuantConfig\(scale_bytes=1\): its slots keep float16"):
        HeavyHitterCache(MODEL, budget=8, recent=4, codec=QuantConfig(bits=2, scale_bytes=1))


def test_keys_past_one_byte_statistics_keep_their_blocks_in_full_precision_mid_generate() -> None:
    """Key channels planted at 10,000x (queries divided alike, so logits are unchanged) lie far outside e4m3's
    +-448 in every block: each block stays in full precision instead of raising, is counted, and the cache then
    holds exactly what DynamicCache holds, so its scores equal DynamicCache's."""
    model = tiny_llama(seed=3)
    half, group = 8, model.config.num_attention_heads // model.config.num_key_value_heads
    with torch.no_grad():
        for layer in model.model.layers:
            for kv_head in range(model.config.num_key_value_heads):
                for channel in (3, 3 + half):  # a RoPE pair: scaling both alike commutes with the rotation
                    layer.self_attn.k_proj.weight[kv_head * 16 + channel] *= 1e4
                    for q_head in range(kv_head * group, (kv_head + 1) * group):
                        layer.self_attn.q_proj.weight[q_head * 16 + channel] /= 1e4
    inputs = prompts(length=21)
    expected = run(model, DynamicCache(config=model.config), inputs)
    cache = QuantizedCache(model, bits=2, block_size=4, residual=0, scale_bytes=1)
    got = run(model, cache, inputs)
    stats = cache.stats()
    # 21 + 11 cached tokens fill 8 blocks of 4: the sink block 0 stays anyway, blocks 1-7 overflowed.
    assert (stats.overflow_blocks, stats.sealed_blocks, stats.full_precision_blocks) == (7, 0, 8)
    assert torch.equal(got.sequences, expected.sequences)
    for a, b in zip(got.scores, expected.scores, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    # Unplanted, the same blocks seal: the fallback is per block, not a cache gone to full precision.
    plain = QuantizedCache(MODEL, bits=2, block_size=4, residual=0, scale_bytes=1)
    run(MODEL, plain, inputs)
    assert plain.stats().overflow_blocks == 0 and plain.stats().sealed_blocks == 7


def test_bits_2_as_users_type_it_gets_the_measured_int2_settings() -> None:
    """`QuantizedCache(model, bits=2)` is the `int2` name's configuration (KIVI's window and value groups, fp16
    statistics: RESULTS.md, int2 defaults on unseen text); each setting given still wins, other formats keep theirs."""
    smollm2_like = tiny_llama()
    smollm2_like.config.head_dim = 64  # only the geometry is read: value groups of 32 channels
    for model, group in ((smollm2_like, 32), (MODEL, None)):  # head_dim 16: one value group per head
        quant = QuantizedCache(model, bits=2).quant
        assert (quant.residual, quant.group_size, quant.scale_bytes) == (32, group, 2)
        assert quant == get_cache_spec("int2").build(model).quant
    given = QuantizedCache(MODEL, bits=2, residual=0, group_size=None, scale_bytes=1).quant
    assert (given.residual, given.group_size, given.scale_bytes) == (0, None, 1)
    for bits, fmt in ((8, "int"), (4, "int"), (8, "fp8")):
        quant = QuantizedCache(MODEL, bits=bits, fmt=fmt).quant
        assert (quant.residual, quant.group_size, quant.scale_bytes) == (0, None, 2)
    disk = QuantizedDiskCache(smollm2_like, bits=2).quant
    assert disk == QuantizedCache(smollm2_like, bits=2).quant
    chained = GovernedCache(smollm2_like, codec="int2")  # a codec by name in the chain means the same
    assert isinstance(chained, QuantizedCache) and chained.quant == disk
    assert GovernedCache(MODEL, codec="int8").quant == QuantizedCache(MODEL).quant  # the others as before
