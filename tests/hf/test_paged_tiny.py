"""PagedCache against DynamicCache on a tiny random Llama: every generate mode, block size and path."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import DynamicCache

from hf_kvgov import (
    BlockPool,
    HeavyHitterCache,
    PagedCache,
    PoolExhausted,
    QuantizedCache,
    eviction_attention,
    paged_attention,
)
from hf_kvgov.kernels import dispatch
from tests.conftest import tiny_gemma3, tiny_llama

MODELS = {"gqa": tiny_llama(num_kv_heads=2), "mha": tiny_llama(num_kv_heads=4, seed=1)}
PATHS = ("contiguous", "paged")


def prompts(batch: int = 1, length: int = 11, pad_first: int = 0) -> dict[str, torch.Tensor]:
    """Random prompts; row 0 is left-padded by `pad_first` tokens when batch > 1."""
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


def attention_context(model, path: str):  # type: ignore[no-untyped-def]
    return paged_attention(model) if path == "paged" else contextlib.nullcontext()


def assert_same_generation(model, path: str, block_size: int, inputs, **kwargs) -> PagedCache:  # type: ignore[no-untyped-def]
    expected = run(model, DynamicCache(), inputs, **kwargs)
    cache = PagedCache(model, block_size=block_size, attention=path)  # type: ignore[arg-type]
    with attention_context(model, path):
        got = run(model, cache, inputs, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    for got_step, expected_step in zip(got.scores, expected.scores, strict=True):
        finite = torch.isfinite(expected_step)
        assert torch.equal(finite, torch.isfinite(got_step))
        torch.testing.assert_close(got_step[finite], expected_step[finite], atol=1e-5, rtol=1e-5)
    return cache


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("arch", sorted(MODELS))
def test_greedy_matches_dynamic_cache(arch: str, block_size: int, path: str) -> None:
    cache = assert_same_generation(MODELS[arch], path, block_size, prompts(length=13))
    assert cache.get_seq_length() == 13 + 12 - 1  # the last generated token is never fed back
    if path == "paged":
        assert dispatch.last_backend() == "sdpa"  # on the CPU: one layer's blocks gathered for sdpa


@pytest.mark.parametrize("path", PATHS)
def test_left_padded_batch(path: str) -> None:
    assert_same_generation(MODELS["gqa"], path, 4, prompts(batch=3, length=9, pad_first=4))


@pytest.mark.parametrize("path", PATHS)
def test_beam_search(path: str) -> None:
    assert_same_generation(MODELS["gqa"], path, 4, prompts(batch=2, length=7, pad_first=2), num_beams=3)


@pytest.mark.parametrize("path", PATHS)
def test_sampling_with_seed_and_several_return_sequences(path: str) -> None:
    kwargs = {"do_sample": True, "top_k": 20, "num_return_sequences": 2}
    assert_same_generation(MODELS["mha"], path, 3, prompts(batch=2, length=6), seed=7, **kwargs)


def test_prompt_lookup_decoding_uses_crop() -> None:
    # Prompt-lookup decoding drafts tokens and crops the rejected ones from the cache.
    repetitive = {"input_ids": torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]])}
    assert_same_generation(MODELS["gqa"], "contiguous", 4, repetitive, prompt_lookup_num_tokens=3)


def test_crop_then_continue_equals_shorter_prefill() -> None:
    model = MODELS["gqa"]
    ids = prompts(length=10)["input_ids"]
    cache = PagedCache(model, block_size=4)
    model(ids, cache=cache)
    cache.crop(-3)
    assert cache.get_seq_length() == 7
    assert len(cache.tables.rows[0]) == 2  # type: ignore[union-attr]
    after_crop = model(ids[:, 7:], cache=cache).logits
    fresh = model(ids, cache=DynamicCache()).logits[:, 7:]
    torch.testing.assert_close(after_crop, fresh, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="negative"):
        cache.crop(2)


def test_cache_keyword_and_reuse_after_reset() -> None:
    model = MODELS["gqa"]
    inputs = prompts(length=8)
    expected = run(model, DynamicCache(), inputs).sequences
    cache = PagedCache(model, block_size=4)
    assert torch.equal(run(model, cache, inputs).sequences, expected)
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.pool.num_used == 0  # type: ignore[union-attr]
    torch.manual_seed(0)
    again = model.generate(**inputs, cache=cache, max_new_tokens=12)
    assert torch.equal(again, expected)


def test_release_returns_every_block_even_after_beam_search() -> None:
    model = MODELS["gqa"]
    pool = BlockPool(PagedCache(model).pool.geometry, block_size=4)  # type: ignore[union-attr]
    cache = PagedCache(model, pool=pool)
    run(model, cache, prompts(batch=2, length=9), num_beams=3)
    assert pool.num_used > 0
    cache.release()
    assert pool.num_used == 0


def test_pool_cap_raises_pool_exhausted_through_generate() -> None:
    model = MODELS["gqa"]
    cache = PagedCache(model, block_size=4, max_tokens=16)
    with pytest.raises(PoolExhausted) as info:
        run(model, cache, prompts(length=10), max_new_tokens=20)
    assert info.value.free < info.value.requested


def test_stats_count_blocks_and_bytes() -> None:
    model = MODELS["gqa"]
    cache = PagedCache(model, block_size=4)
    model(prompts(batch=2, length=10)["input_ids"], cache=cache)
    stats = cache.stats()
    # 10 tokens -> 3 blocks of 4 per row; 2 rows; 2 layers x 2 heads x 16 dims x K,V x 4 bytes per token.
    bytes_per_block = 4 * 2 * 2 * 2 * 16 * 4
    assert (stats.sequences, stats.tokens, stats.blocks_in_use) == (2, 20, 6)
    assert (stats.slots_allocated, stats.slots_filled) == (24, 20)
    assert stats.bytes_used == 6 * bytes_per_block
    assert stats.utilization == pytest.approx(20 / 24)


def test_paged_path_without_the_attention_is_refused() -> None:
    model = MODELS["gqa"]
    cache = PagedCache(model, attention="paged")
    with pytest.raises(RuntimeError, match="paged_attention"):
        model(prompts(length=5)["input_ids"], cache=cache)


def test_paged_attention_context_restores_the_previous_implementation() -> None:
    model = MODELS["gqa"]
    before = model.config._attn_implementation
    with paged_attention(model):
        assert model.config._attn_implementation == "kvgov"
        # Any other cache still works under the hf_kvgov attention (sdpa fallback).
        dynamic = run(model, DynamicCache(), prompts(length=6)).sequences
    assert model.config._attn_implementation == before
    assert torch.equal(dynamic, run(model, DynamicCache(), prompts(length=6)).sequences)


def test_one_attention_serves_paged_and_eviction_caches_in_one_context() -> None:
    # A model switched once runs a paged cache and an eviction cache that keeps every token (budget = length):
    # both give DynamicCache's tokens, so neither needs an attention of its own.
    model, inputs = MODELS["gqa"], prompts(batch=2, length=9, pad_first=3)
    expected = run(model, DynamicCache(), inputs).sequences
    with paged_attention(model):
        paged = run(model, PagedCache(model, attention="paged", block_size=4), inputs).sequences
        kept = run(model, HeavyHitterCache(model, budget=9 + 12), inputs).sequences
    assert torch.equal(paged, expected) and torch.equal(kept, expected)
    assert eviction_attention is paged_attention  # the eviction caches' examples name the same context


def test_bad_arguments_are_explained() -> None:
    model = MODELS["gqa"]
    with pytest.raises(ValueError, match="attention must be one of"):
        PagedCache(model, attention="flash")  # type: ignore[arg-type]
    other = BlockPool(PagedCache(MODELS["mha"]).pool.geometry)  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="geometry"):
        PagedCache(model, pool=other)
    with pytest.raises(TypeError, match="PreTrainedModel or PretrainedConfig"):
        PagedCache("llama")
    cache = PagedCache(model)
    model(prompts(batch=2, length=4)["input_ids"], cache=cache)
    with pytest.raises(ValueError, match="batch of 3"):
        model(prompts(batch=3, length=4)["input_ids"], cache=cache)


def test_paged_view_prefill_matches_the_reference_kernel() -> None:
    """Prefill through the paged path gathers once and runs sdpa; it must equal the block-chunked spec,
    including queries that sit after a cached prefix (no mask given: causal from the end)."""
    from hf_kvgov.hf.paged_cache import PagedView
    from hf_kvgov.kernels.reference import paged_attention_reference

    generator = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, 10, 4, 2, 8, generator=generator)
    table = torch.tensor([[3, 1, 7, 2], [0, 4, 5, 9]])
    query = torch.randn(2, 6, 5, 8, generator=generator)
    got = PagedView(keys, values, table, 13).attend(query, None, 0.3, None)
    expected = paged_attention_reference(query, keys, values, table, 13, 0.3)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("make", [PagedCache, QuantizedCache], ids=["paged", "int8"])
def test_a_cache_built_for_fewer_layers_names_the_mistake(make) -> None:  # type: ignore[no-untyped-def]
    """A cache built for the 2-layer Llama, given to a 3-layer model of the same head geometry: its third layer is
    refused by name (it was an IndexError from transformers' layer list)."""
    cache = make(tiny_llama())
    ids = torch.arange(3, 23)[None]
    with pytest.raises(ValueError, match="was built for a model of 2 layers, and a layer with index 2 stores K/V"):
        tiny_gemma3()(ids, cache=cache)
