"""QuantizedCache through generate on a tiny random Llama, against an independent fake-quantizing
DynamicCache (quant_fake_reference): same tokens and scores, on both attention paths."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from quant_fake_reference import FakeQuantCache

from hf_kvgov import PagedCache, paged_attention
from hf_kvgov.hf.quantized_cache import QuantizedCache
from hf_kvgov.storage.pool import BlockPool
from hf_kvgov.storage.quantized_pool import QuantizedBlockPool
from tests.conftest import tiny_llama

MODELS = {"gqa": tiny_llama(num_kv_heads=2), "mha": tiny_llama(num_kv_heads=4, seed=1)}
PATHS = ("contiguous", "paged")
FORMATS = {
    "int8": (8, "int"),
    "int4": (4, "int"),
    "int2": (2, "int"),
    "fp8_e4m3": (8, "fp8"),
    "fp8_e5m2": (8, "fp8_e5m2"),
}


def prompts(batch: int = 1, length: int = 11, pad_first: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(batch * 100 + length)
    ids = torch.randint(3, 96, (batch, length), generator=generator)
    mask = torch.ones_like(ids)
    if pad_first:
        ids[0, :pad_first] = 0
        mask[0, :pad_first] = 0
    return {"input_ids": ids, "attention_mask": mask}


def run(model, cache, inputs, seed: int = 0, **kwargs):  # type: ignore[no-untyped-def]
    torch.manual_seed(seed)
    kwargs.setdefault("max_new_tokens", 12)
    return model.generate(**inputs, cache=cache, return_dict_in_generate=True, output_scores=True, **kwargs)


def assert_matches_fake_quant(
    model: Any, path: str, codec: str, inputs: dict[str, torch.Tensor], options: dict[str, Any], **kwargs: Any
) -> QuantizedCache:
    bits, fmt = FORMATS[codec]
    reference_options = {k: v for k, v in options.items() if k != "group_size"}
    expected = run(model, FakeQuantCache(model.config, codec, **reference_options), inputs, **kwargs)
    generic = {"residual": 0, "scale_bytes": 2}  # the reference's settings, not int2's KIVI defaults
    cache = QuantizedCache(model, bits=bits, fmt=fmt, attention=path, **(generic | options))  # type: ignore[arg-type]
    with paged_attention(model) if path == "paged" else contextlib.nullcontext():
        got = run(model, cache, inputs, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    for got_step, expected_step in zip(got.scores, expected.scores, strict=True):
        finite = torch.isfinite(expected_step)
        assert torch.equal(finite, torch.isfinite(got_step))
        torch.testing.assert_close(got_step[finite], expected_step[finite], atol=1e-5, rtol=1e-5)
    return cache


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("codec", sorted(FORMATS))
def test_greedy_matches_fake_quantization(codec: str, path: str) -> None:
    cache = assert_matches_fake_quant(MODELS["gqa"], path, codec, prompts(length=13), {"block_size": 4})
    stats = cache.stats()
    # 24 tokens = 6 full blocks of 4: the sink stays in full precision, blocks 1-5 are sealed (the last one
    # at the end of the final step).
    assert (stats.tokens, stats.full_precision_blocks, stats.sealed_blocks) == (24, 1, 5)


@pytest.mark.parametrize("path", PATHS)
def test_left_padded_batch(path: str) -> None:
    inputs = prompts(batch=3, length=9, pad_first=4)
    assert_matches_fake_quant(MODELS["gqa"], path, "int4", inputs, {"block_size": 4})


@pytest.mark.parametrize("path", PATHS)
def test_beam_search_shares_sealed_blocks(path: str) -> None:
    inputs = prompts(batch=2, length=7, pad_first=2)
    cache = assert_matches_fake_quant(MODELS["gqa"], path, "int8", inputs, {"block_size": 3}, num_beams=3)
    pool = cache.pool
    assert isinstance(pool, QuantizedBlockPool)
    held = {b for row in cache.tables.rows for b in row.block_ids if b < 0}  # type: ignore[union-attr]
    assert pool.sealed.num_used == len(held)  # nothing leaked by reorder / fork
    cache.release()
    assert pool.num_used == 0 and pool.sealed.num_used == 0


@pytest.mark.parametrize("path", PATHS)
def test_sampling_with_several_return_sequences(path: str) -> None:
    kwargs = {"do_sample": True, "top_k": 20, "num_return_sequences": 2}
    assert_matches_fake_quant(MODELS["mha"], path, "fp8_e4m3", prompts(batch=2, length=6), {"block_size": 2}, **kwargs)


def test_prompt_lookup_decoding_crops_into_sealed_blocks() -> None:
    repetitive = {"input_ids": torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]])}
    options = {"block_size": 2}
    assert_matches_fake_quant(MODELS["gqa"], "contiguous", "int8", repetitive, options, prompt_lookup_num_tokens=3)


def test_chunked_prefill_keeps_few_full_precision_blocks() -> None:
    prompt = {"input_ids": prompts(length=60)["input_ids"]}
    cache = assert_matches_fake_quant(
        MODELS["gqa"], "contiguous", "int8", prompt, {"block_size": 4}, prefill_chunk_size=8, max_new_tokens=6
    )
    pool = cache.pool
    assert isinstance(pool, QuantizedBlockPool)
    # 65 tokens: sink + tail in full precision, 15 blocks sealed. Each prefill step held at most the sink
    # and its own 2 blocks in full precision, so the pool never grew past its first 8 blocks.
    assert (pool.num_used, pool.capacity, pool.sealed.num_used) == (2, 8, 15)


@pytest.mark.parametrize(
    "options",
    [
        {"block_size": 4, "residual": 6},
        {"block_size": 4, "sink_blocks": 0},
        {"block_size": 4, "sink_blocks": 2, "full_precision_layers": (1,)},
    ],
    ids=["residual", "no-sink", "two-sinks-layer-1-full"],
)
def test_residual_sinks_and_layer_overrides(options: dict[str, Any]) -> None:
    assert_matches_fake_quant(MODELS["mha"], "paged", "int4", prompts(length=10), options)


def test_crop_into_a_sealed_block_unseals_it() -> None:
    model = MODELS["gqa"]
    ids = prompts(length=14)["input_ids"]
    cache = QuantizedCache(model, bits=4, block_size=4)
    reference = FakeQuantCache(model.config, "int4", block_size=4)
    with torch.inference_mode():
        for c in (cache, reference):
            model(ids, cache=c)
            c.crop(-5)
    pool = cache.pool
    assert isinstance(pool, QuantizedBlockPool)
    # 14 tokens: blocks 1 and 2 sealed; crop to 9 tokens keeps token 8 in block 2, which must take writes.
    assert [b < 0 for b in cache.tables.rows[0].block_ids] == [False, True, False]  # type: ignore[union-attr]
    assert (pool.num_used, pool.sealed.num_used) == (2, 1)
    with torch.inference_mode():
        got = model(ids[:, 9:], cache=cache).logits
        expected = model(ids[:, 9:], cache=reference).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert cache.get_seq_length() == 14 and pool.sealed.num_used == 2


def test_int8_stays_close_to_the_full_cache() -> None:
    model = MODELS["gqa"]
    ids = prompts(length=40)["input_ids"]
    with torch.inference_mode():
        full = model(ids, cache=PagedCache(model)).logits
        cache = QuantizedCache(model, bits=8, block_size=4)
        model(ids[:, :20], cache=cache)
        quantized = model(ids[:, 20:], cache=cache).logits
    torch.testing.assert_close(quantized, full[:, 20:], atol=2e-3, rtol=0)
    assert not torch.equal(quantized, full[:, 20:])  # the sealed blocks really were quantized


def test_caches_can_share_one_quantized_pool() -> None:
    model = MODELS["gqa"]
    first = QuantizedCache(model, bits=8, block_size=4)
    second = QuantizedCache(model, bits=8, pool=first.pool)
    with torch.inference_mode():
        model(prompts(length=10)["input_ids"], cache=first)
        model(prompts(length=13)["input_ids"], cache=second)
    pool = first.pool
    assert isinstance(pool, QuantizedBlockPool)
    assert pool.sealed.num_used == 1 + 2 and pool.num_used == 2 + 2
    first.release()
    assert pool.sealed.num_used == 2 and pool.num_used == 2


def test_bad_arguments_are_explained() -> None:
    model = MODELS["gqa"]
    with pytest.raises(ValueError, match="No KV format for fmt='int' with bits=3"):
        QuantizedCache(model, bits=3)
    with pytest.raises(ValueError, match="bits=4"):
        QuantizedCache(model, bits=4, fmt="fp8")
    with pytest.raises(ValueError, match=r"full_precision_layers \[2\] are not layers"):
        QuantizedCache(model, full_precision_layers=(0, 2))
    with pytest.raises(ValueError, match="residual must be a non-negative int"):
        QuantizedCache(model, residual=-1)
    with pytest.raises(ValueError, match="group_size=5 does not divide head_dim=16"):
        QuantizedCache(model, group_size=5)
    plain = BlockPool(PagedCache(model).pool.geometry)  # type: ignore[union-attr]
    with pytest.raises(TypeError, match="QuantizedBlockPool"):
        QuantizedCache(model, pool=plain)
    int8 = QuantizedCache(model, bits=8)
    with pytest.raises(ValueError, match="configured alike"):
        QuantizedCache(model, bits=4, pool=int8.pool)
