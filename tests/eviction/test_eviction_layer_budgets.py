"""Per-layer budgets (``layer_budgets=``) of the eviction caches, on tiny models."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import DynamicCache

from hf_kvgov import GovernedCache, HeavyHitterCache, PolicyCache, SinkCache, eviction_attention
from hf_kvgov.engine.parts import HeavyHitter, Layer
from hf_kvgov.policies import SnapKV
from hf_kvgov.policies.pyramid import Pyramid
from tests.conftest import tiny_llama
from tests.eviction.test_eviction_sliding import tiny_gemma3, tiny_mistral

MODEL = tiny_llama(num_kv_heads=2)


def ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 96, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_a_layer_with_budget_one_keeps_the_whole_prompt_as_dynamic_cache_does() -> None:
    prompt = ids(2, 20)
    cache, dynamic = HeavyHitterCache(MODEL, budget=4, recent=2, layer_budgets={0: 1.0}, budget_of=20), DynamicCache()
    with eviction_attention(MODEL), torch.inference_mode():
        MODEL(prompt, cache=cache)
    with torch.inference_mode():
        MODEL(prompt, cache=dynamic)
    layer = cache.layers[0]
    assert torch.equal(layer.keys, dynamic.layers[0].keys) and torch.equal(layer.values, dynamic.layers[0].values)
    assert layer.positions.tolist() == [[list(range(20))] * 2] * 2  # type: ignore[attr-defined]
    stats = cache.stats()
    assert (stats.budget, stats.layer_budgets, stats.slots) == (4, (20, 4), 20)
    assert cache.layers[1].slots == 4  # type: ignore[attr-defined]
    # A slot costs 2 x 16 float32 = 128 bytes per (row, KV head): 20 of them in layer 0, 4 in layer 1.
    assert stats.kv_bytes == 2 * 2 * (20 + 4) * 128


def test_an_int_layer_budget_covering_the_stream_keeps_every_token_while_others_evict() -> None:
    # Layer 0's K/V depend only on the tokens, so with nothing evicted there it holds DynamicCache's layer 0
    # bit for bit, although layer 1 keeps 5 slots and changes what the model predicts.
    stream = ids(1, 33, seed=1)
    cache, dynamic = HeavyHitterCache(MODEL, budget=5, recent=2, layer_budgets={0: 64}), DynamicCache()
    with torch.inference_mode():
        with eviction_attention(MODEL):
            for start in range(0, 33, 8):
                MODEL(stream[:, start : start + 8], cache=cache)
        for start in range(0, 33, 8):
            MODEL(stream[:, start : start + 8], cache=dynamic)
    assert torch.equal(cache.layers[0].keys, dynamic.layers[0].keys)
    assert torch.equal(cache.layers[0].values, dynamic.layers[0].values)
    assert [layer.slots for layer in cache.layers] == [33, 5]  # type: ignore[attr-defined]
    assert cache.stats().layer_budgets == (64, 5)


def test_layer_budgets_covering_everything_make_a_small_default_budget_lossless() -> None:
    prompt = {"input_ids": ids(2, 11, seed=2)}
    kwargs = {"max_new_tokens": 10, "do_sample": False, "return_dict_in_generate": True, "output_logits": True}
    expected = MODEL.generate(**prompt, cache=DynamicCache(), **kwargs)
    cache = HeavyHitterCache(MODEL, budget=3, recent=1, layer_budgets={0: 32, 1: 32})
    with eviction_attention(MODEL):
        got = MODEL.generate(**prompt, cache=cache, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    for got_step, expected_step in zip(got.logits, expected.logits, strict=True):
        torch.testing.assert_close(got_step, expected_step, atol=1e-5, rtol=1e-5)
    assert cache.stats().slots == 20 and cache.stats().budget == 3


def test_fractional_layer_budgets_of_a_declared_length_resolve_on_construction_and_survive_reset() -> None:
    cache = HeavyHitterCache(MODEL, budget=4, recent=2, layer_budgets={1: 0.5}, budget_of=20)
    assert cache.stats().layer_budgets == (4, 10)
    with eviction_attention(MODEL), torch.inference_mode():
        MODEL(ids(1, 30), cache=cache)
        assert [layer.slots for layer in cache.layers] == [4, 10]  # type: ignore[attr-defined]
        cache.reset()
        assert cache.stats().layer_budgets == (4, 10)


def test_a_smaller_layer_budget_evicts_more_in_that_layer_only() -> None:
    cache = SinkCache(MODEL, n_sink=2, window=6, budget=12, layer_budgets={1: 8})
    with eviction_attention(MODEL), torch.inference_mode():
        MODEL(ids(1, 30, seed=3), cache=cache)
    # Sinks 0, 1 and the newest tokens: 10 of them in layer 0, 6 in layer 1.
    positions = [layer.positions[0, 0].tolist() for layer in cache.layers]  # type: ignore[attr-defined]
    assert positions == [[0, 1, *range(20, 30)], [0, 1, *range(24, 30)]]
    assert cache.stats().layer_budgets == (12, 8)


def test_sliding_window_layers_cap_their_own_budget_at_the_window() -> None:
    model = tiny_mistral()  # every layer slides over 8 tokens
    cache = HeavyHitterCache(model, budget=64, recent=4, layer_budgets={1: 5})
    with eviction_attention(model), torch.inference_mode():
        model(ids(1, 20, seed=4), cache=cache)
    assert cache.stats().layer_budgets == (7, 5)
    assert [layer.slots for layer in cache.layers] == [7, 5]  # type: ignore[attr-defined]


def test_layer_budgets_combine_with_a_codec() -> None:
    cache = HeavyHitterCache(MODEL, budget=4, recent=2, codec="int8", layer_budgets={0: 1.0}, budget_of=10)
    with eviction_attention(MODEL), torch.inference_mode():
        MODEL(ids(1, 10, seed=5), cache=cache)
    # int8 slot: K and V each 16 codes + float16 scale + float16 zero point; 10 + 4 slots per KV head.
    assert cache.stats().kv_bytes == 2 * (10 + 4) * 2 * (16 + 4)


def test_a_pyramid_gives_the_lower_layer_more_slots_and_holds_the_bytes_of_the_uniform_budget() -> None:
    # Budget 8 over 2 layers, H2O's 2 recent slots fixed: 6 to share, 0.3 to the last layer -> 13.7 and 2.3,
    # rounded to whole slots summing to 16: 14 and 2.
    prompt = ids(2, 30, seed=6)
    pyramid = HeavyHitterCache(MODEL, budget=8, recent=2, layer_budgets=Pyramid())
    uniform = HeavyHitterCache(MODEL, budget=8, recent=2)
    with eviction_attention(MODEL), torch.inference_mode():
        MODEL(prompt, cache=pyramid)
        MODEL(prompt, cache=uniform)
    assert pyramid.stats().layer_budgets == (14, 2)
    assert [layer.slots for layer in pyramid.layers] == [14, 2]  # type: ignore[attr-defined]
    # 2 rows x 2 KV heads x 16 slots x 128 bytes (K and V, 16 float32 each), as the uniform 8 + 8.
    assert pyramid.stats().kv_bytes == uniform.stats().kv_bytes == 2 * 2 * 16 * 128


def test_a_fractional_budget_is_split_once_resolved_on_the_prompt_and_again_after_reset() -> None:
    cache = PolicyCache(MODEL, SnapKV(window=2, kernel=1), budget=0.4, layer_budgets=Pyramid(beta=2))
    assert cache.stats().layer_budgets == (None, None)
    prompt = {"input_ids": ids(1, 20, seed=7)}
    with eviction_attention(MODEL):
        MODEL.generate(**prompt, cache=cache, max_new_tokens=3, do_sample=False)
        # 40% of 20 = 8, SnapKV's 2-slot window fixed: 6 to share, low 3, high 9 -> 11 and 5.
        assert cache.stats().layer_budgets == (11, 5)
        assert [layer.slots for layer in cache.layers] == [11, 5]  # type: ignore[attr-defined]
        cache.reset()
        assert cache.stats().layer_budgets == (None, None)
        MODEL.generate(input_ids=ids(1, 30, seed=8), cache=cache, max_new_tokens=1, do_sample=False)
    # 40% of 30 = 12: 10 to share, low 5, high 15 -> 17 and 7.
    assert cache.stats().layer_budgets == (17, 7)


def test_a_flat_pyramid_generates_what_the_uniform_budget_generates() -> None:
    prompt = {"input_ids": ids(2, 24, seed=9)}
    kwargs = {"max_new_tokens": 8, "do_sample": False, "return_dict_in_generate": True, "output_logits": True}
    with eviction_attention(MODEL):
        expected = MODEL.generate(**prompt, cache=HeavyHitterCache(MODEL, budget=10, recent=3), **kwargs)
        flat = HeavyHitterCache(MODEL, budget=10, recent=3, layer_budgets=Pyramid(beta=1))
        got = MODEL.generate(**prompt, cache=flat, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    for got_step, expected_step in zip(got.logits, expected.logits, strict=True):
        torch.testing.assert_close(got_step, expected_step, atol=0, rtol=0)


def test_a_pyramid_skips_sliding_window_layers() -> None:
    model = tiny_gemma3(("sliding_attention", "full_attention", "sliding_attention", "full_attention"))
    cache = HeavyHitterCache(model, budget=10, recent=2, layer_budgets=Pyramid())
    with eviction_attention(model), torch.inference_mode():
        model(ids(1, 40, seed=10), cache=cache)
    # The full layers 1 and 3 share 2 x 10: 8 to share, low 0.4, high 15.6 -> 17.6 and 2.4 -> 18 and 2; the
    # sliding layers keep their window (7 slots) as they would under any budget of at least 7.
    assert cache.stats().layer_budgets == (7, 18, 7, 2)
    assert [layer.slots for layer in cache.layers] == [7, 18, 7, 2]  # type: ignore[attr-defined]


def test_the_chain_takes_a_pyramid_as_the_policy_part_s_allocation() -> None:
    cache = HeavyHitterCache(MODEL, budget=8, recent=2, layer_budgets=Pyramid())
    assert cache.parts.policy == HeavyHitter(8, 2, query_chunk=256, allocation=Pyramid()) and not cache.parts.layers
    assert "pyramid budgets over layers, beta 20" in cache.parts.describe()
    composed = GovernedCache(MODEL, **cache.parts.kwargs())
    assert isinstance(composed, HeavyHitterCache) and composed.stats().layer_budgets == (14, 2)
    with pytest.raises(ValueError, match=r"give one or the other"):
        GovernedCache(MODEL, policy=HeavyHitter(8, 2, allocation=Pyramid()), layers={0: Layer(budget=4)})
    with pytest.raises(TypeError, match=r"HeavyHitter\.allocation must be a Pyramid"):
        HeavyHitter(8, allocation={0: 4})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (
            lambda: HeavyHitterCache(MODEL, budget=4, layer_budgets={2: 0.5}),
            ValueError,
            "HeavyHitterCache: layer_budgets names layer 2, but the model has layers 0..1.",
        ),
        (
            lambda: HeavyHitterCache(MODEL, budget=4, layer_budgets={-1: 0.5}),
            ValueError,
            "names layer -1, but the model has layers 0..1",
        ),
        (
            lambda: HeavyHitterCache(MODEL, budget=4, layer_budgets={"0": 8}),
            TypeError,
            "layer_budgets keys must be int layer indices; got '0'.",
        ),
        (
            lambda: HeavyHitterCache(MODEL, budget=4, layer_budgets=[(0, 8)]),
            TypeError,
            "layer_budgets must map layer indices to budgets, as in {0: 1.0, 3: 128}, or be an allocator such as "
            "Pyramid(); got [(0, 8)] of type list.",
        ),
        (
            lambda: HeavyHitterCache(MODEL, budget=4, layer_budgets={0: 0}),
            ValueError,
            "HeavyHitterCache: layer_budgets[0] as a number of tokens must be at least 1; got 0.",
        ),
        (
            lambda: HeavyHitterCache(MODEL, budget=4, layer_budgets={1: 1.5}),
            ValueError,
            "layer_budgets[1] as a fraction must lie in (0, 1]; got 1.5.",
        ),
        (
            lambda: HeavyHitterCache(MODEL, budget=4, layer_budgets={1: "all"}),
            TypeError,
            "layer_budgets[1] must be an int number of tokens or a float fraction; got 'all' of type str.",
        ),
        (
            lambda: HeavyHitterCache(MODEL, budget=16, recent=6, layer_budgets={1: 4}),
            ValueError,
            "layer_budgets gives layer 1 a budget of 4 slots, but this cache always keeps at least 6 per KV head",
        ),
        (
            lambda: SinkCache(MODEL, n_sink=4, window=60, layer_budgets={0: 32}),
            ValueError,
            "SinkCache: layer_budgets gives layer 0 a budget of 32 slots, but this cache always keeps at least 64",
        ),
    ],
)
def test_bad_layer_budgets_are_refused_with_a_sentence(make: Any, error: type, message: str) -> None:
    with pytest.raises(error) as raised:
        make()
    assert message in str(raised.value)
