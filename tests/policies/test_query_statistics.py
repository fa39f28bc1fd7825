"""Running query statistics for Expected Attention (``QueryForecast(running=True)``): the moments of every query
a layer has seen, kept by the eviction cache across steps, prefill and decode."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_kvgov import PolicyCache, eviction_attention
from hf_kvgov.policies import ExpectedAttention, QueryForecast, apply_rope, expected_attention, make_policy
from hf_kvgov.policies.query_forecast import QueryStatistics, observe_queries
from hf_kvgov.registry import get_cache_spec
from tests.conftest import tiny_llama

INV_FREQ = 1.0 / (10_000 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8))  # head_dim 8
RUNNING = QueryForecast(running=True)


def step_inputs(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ten queries of two rows and two query heads at positions 0..9 (row 1's first two padding), and slots."""
    generator = torch.Generator().manual_seed(seed)
    unrotated = torch.randn(2, 2, 10, 8, generator=generator, dtype=torch.float64)
    positions = torch.arange(10).expand(2, 10)
    query = apply_rope(unrotated, torch.arange(10), INV_FREQ)
    valid = torch.ones(2, 10, dtype=torch.bool)
    valid[1, :2] = False
    keys = torch.randn(2, 1, 12, 8, generator=generator, dtype=torch.float64)
    return query, positions, valid, keys, torch.ones(2, 1, 12, dtype=torch.bool)


def test_moments_over_two_steps_are_those_of_all_their_queries_at_once() -> None:
    query, positions, valid, keys, slots = step_inputs()
    statistics = None
    for part in (slice(0, 6), slice(6, 10)):
        statistics = observe_queries(statistics, INV_FREQ, query[:, :, part], positions[:, part], valid[:, part])
    assert statistics is not None and statistics.count.tolist() == [10.0, 8.0]
    got = expected_attention(
        RUNNING, INV_FREQ, query[:, :, 6:], positions[:, 6:], valid[:, 6:], keys, keys, slots, 0.3, statistics
    )
    at_once = expected_attention(QueryForecast(), INV_FREQ, query, positions, valid, keys, keys, slots, 0.3)
    torch.testing.assert_close(got, at_once)
    # The step's own four queries alone forecast something else.
    alone = expected_attention(
        QueryForecast(), INV_FREQ, query[:, :, 6:], positions[:, 6:], valid[:, 6:], keys, keys, slots, 0.3
    )
    assert not torch.allclose(got, alone)


def test_mean_and_covariance_by_hand_and_rows_follow_beams() -> None:
    statistics = QueryStatistics.empty(2, 1, 2, torch.device("cpu"))
    queries = torch.tensor([[[[1.0, 0.0], [3.0, 2.0]]], [[[5.0, 5.0], [0.0, 0.0]]]], dtype=torch.float64)
    statistics.add(queries, torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64))
    mean, covariance = statistics.moments()
    assert mean[0, 0].tolist() == [2.0, 1.0] and covariance[0, 0].tolist() == [[1.0, 1.0], [1.0, 1.0]]
    assert mean[1, 0].tolist() == [5.0, 5.0] and covariance[1, 0].tolist() == [[0.0, 0.0], [0.0, 0.0]]
    statistics.select_rows(torch.tensor([1, 1]))
    assert statistics.count.tolist() == [1.0, 1.0] and statistics.moments()[0][0, 0].tolist() == [5.0, 5.0]


def test_a_running_forecast_needs_its_statistics_and_the_flag_is_checked() -> None:
    query, positions, valid, keys, slots = step_inputs()
    with pytest.raises(ValueError, match=r"running=True\) needs the layer's running QueryStatistics"):
        expected_attention(RUNNING, INV_FREQ, query, positions, valid, keys, keys, slots, 0.3)
    with pytest.raises(TypeError, match=r"QueryForecast\.running must be a bool"):
        QueryForecast(running=1)  # type: ignore[arg-type]


def running_cache(model, budget: int) -> PolicyCache:  # type: ignore[no-untyped-def]
    return PolicyCache(model, ExpectedAttention(sinks=1, recent=2, forecast=RUNNING), budget=budget)


def test_the_cache_counts_every_valid_query_of_prefill_and_decode() -> None:
    model = tiny_llama()
    ids = torch.randint(3, 96, (2, 20), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding: row 1 has 15 real tokens
    cache = running_cache(model, budget=12)
    with eviction_attention(model):
        out = model.generate(input_ids=ids, attention_mask=mask, cache=cache, max_new_tokens=5, do_sample=False)
    assert out.shape[1] == 25
    for layer in cache.layers:
        stats = layer.query_stats  # type: ignore[attr-defined]
        # 20 / 15 prompt queries, then 4 decode steps (the fifth token is sampled after the last forward).
        assert stats is not None and stats.count.tolist() == [24.0, 19.0]


def test_beams_and_a_budget_covering_everything_match_dynamic_cache() -> None:
    model = tiny_llama()
    prompt = {"input_ids": torch.randint(3, 96, (1, 16), generator=torch.Generator().manual_seed(7))}
    kwargs = {"max_new_tokens": 5, "do_sample": False, "num_beams": 2, "return_dict_in_generate": True}
    expected = model.generate(**prompt, cache=DynamicCache(config=model.config), **kwargs)
    cache = running_cache(model, budget=64)
    with eviction_attention(model):
        got = model.generate(**prompt, cache=cache, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    assert cache.layers[0].query_stats is not None  # type: ignore[attr-defined]
    assert cache.layers[0].query_stats.count.shape == (2,)  # type: ignore[attr-defined]  # one row per beam


def test_the_statistics_are_counted_in_the_bytes_held() -> None:
    model = tiny_llama()  # 4 query heads of head_dim 16 in each of 2 layers
    ids = torch.randint(3, 96, (2, 20), generator=torch.Generator().manual_seed(8))
    plain = PolicyCache(model, ExpectedAttention(sinks=1, recent=2), budget=12)
    running = running_cache(model, budget=12)
    with eviction_attention(model), torch.inference_mode():
        for cache in (plain, running):
            model(ids, cache=cache)
    # Per layer, float64: a count per row, a sum of 4 x 16 and the upper triangles (16 x 17 / 2 = 136 entries) of
    # 4 sums of outer products per row; 2 rows.
    per_layer = 8 * 2 * (1 + 4 * 16 + 4 * 136)
    assert running.stats().metadata_bytes - plain.stats().metadata_bytes == 2 * per_layer
    assert running.stats().kv_bytes == plain.stats().kv_bytes


def test_the_registry_names_the_streaming_setting() -> None:
    policy = make_policy("expected_attention_running")
    assert isinstance(policy, ExpectedAttention) and policy.forecast.running
    assert (policy.sinks, policy.recent, policy.min_budget) == (4, 128, 132)
    cache = get_cache_spec("expected_attention_running@0.2").build(tiny_llama())
    assert isinstance(cache, PolicyCache)
