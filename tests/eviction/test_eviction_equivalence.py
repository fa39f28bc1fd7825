"""With a budget at least the sequence length nothing is evicted: both caches equal DynamicCache, tiny Llama."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_kvgov import HeavyHitterCache, SinkCache, eviction_attention
from tests.conftest import tiny_llama

MODELS = {"gqa": tiny_llama(num_kv_heads=2), "mha": tiny_llama(num_kv_heads=4, seed=1)}
LARGE = {
    "h2o": lambda model: HeavyHitterCache(model, budget=64, recent=8),
    "sink": lambda model: SinkCache(model, n_sink=4, window=60),
}


def prompts(batch: int = 1, length: int = 11, pad: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    """Random prompts; row i is left-padded by ``pad[i]`` tokens."""
    generator = torch.Generator().manual_seed(batch * 100 + length)
    ids = torch.randint(3, 96, (batch, length), generator=generator)
    mask = torch.ones_like(ids)
    for row, count in enumerate(pad):
        ids[row, :count] = 0
        mask[row, :count] = 0
    return {"input_ids": ids, "attention_mask": mask}


def run(model, cache, inputs, seed: int = 0, **kwargs):  # type: ignore[no-untyped-def]
    torch.manual_seed(seed)
    kwargs.setdefault("max_new_tokens", 12)
    return model.generate(**inputs, cache=cache, return_dict_in_generate=True, output_scores=True, **kwargs)


def assert_same_as_dynamic(model, kind: str, inputs, **kwargs) -> None:  # type: ignore[no-untyped-def]
    expected = run(model, DynamicCache(), inputs, **kwargs)
    cache = LARGE[kind](model)
    with eviction_attention(model):
        got = run(model, cache, inputs, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    for got_step, expected_step in zip(got.scores, expected.scores, strict=True):
        finite = torch.isfinite(expected_step)
        assert torch.equal(finite, torch.isfinite(got_step))
        torch.testing.assert_close(got_step[finite], expected_step[finite], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", sorted(LARGE))
@pytest.mark.parametrize("arch", sorted(MODELS))
def test_greedy_equals_dynamic_cache(arch: str, kind: str) -> None:
    assert_same_as_dynamic(MODELS[arch], kind, prompts(length=13))


@pytest.mark.parametrize("kind", sorted(LARGE))
def test_left_padded_batch_equals_dynamic_cache(kind: str) -> None:
    assert_same_as_dynamic(MODELS["gqa"], kind, prompts(batch=3, length=9, pad=(4, 0, 2)))


@pytest.mark.parametrize("kind", sorted(LARGE))
def test_beam_search_equals_dynamic_cache(kind: str) -> None:
    assert_same_as_dynamic(MODELS["gqa"], kind, prompts(batch=2, length=7, pad=(2,)), num_beams=3)


@pytest.mark.parametrize("kind", sorted(LARGE))
def test_sampling_with_several_return_sequences_equals_dynamic_cache(kind: str) -> None:
    kwargs = {"do_sample": True, "top_k": 20, "num_return_sequences": 2}
    assert_same_as_dynamic(MODELS["mha"], kind, prompts(batch=2, length=6), seed=7, **kwargs)


@pytest.mark.parametrize("kind", sorted(LARGE))
def test_chunked_feeding_equals_one_forward(kind: str) -> None:
    model = MODELS["gqa"]
    ids = prompts(length=30)["input_ids"]
    expected = model(ids, cache=DynamicCache()).logits
    cache = LARGE[kind](model)
    with eviction_attention(model):
        got = torch.cat([model(ids[:, s : s + 7], cache=cache).logits for s in range(0, 30, 7)], dim=1)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert cache.get_seq_length() == 30


def test_query_chunks_do_not_change_the_result() -> None:
    # The prompt is attended 3 queries at a time: outputs and accumulated mass equal one chunk's.
    model = MODELS["gqa"]
    ids = prompts(length=20)["input_ids"]
    caches = [HeavyHitterCache(model, budget=8, query_chunk=chunk) for chunk in (3, 256)]
    with eviction_attention(model):
        small, whole = (model(ids, cache=cache).logits for cache in caches)
    torch.testing.assert_close(small, whole, atol=1e-6, rtol=1e-6)
    for a, b in zip(caches[0].layers, caches[1].layers, strict=True):
        assert torch.equal(a.positions, b.positions)  # type: ignore[attr-defined]
        torch.testing.assert_close(a.scores, b.scores, atol=1e-6, rtol=1e-6)  # type: ignore[attr-defined]
