"""Budgets, memory bounds, stats, errors and the attention switch of the eviction caches (tiny models)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel

from hf_kvgov import HeavyHitterCache, PolicyCache, SinkCache, eviction_attention
from hf_kvgov.hf.eviction import ATTENTION_NAME
from hf_kvgov.registry import get_cache_spec, kv_bytes
from tests.conftest import tiny_llama

MODEL = tiny_llama(num_kv_heads=2)
# Per (sequence, KV head, layer) slot: key + value, 16 dims, float32.
KV_BYTES_PER_SLOT = 2 * 16 * 4


def ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 96, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "make",
    [lambda m: HeavyHitterCache(m, budget=256, recent=64), lambda m: SinkCache(m, n_sink=4, window=252)],
    ids=["h2o", "sink"],
)
def test_streaming_8192_tokens_holds_a_fixed_number_of_bytes(make) -> None:  # type: ignore[no-untyped-def]
    cache = make(MODEL)
    stream = ids(1, 8192, seed=1)
    held = []
    with eviction_attention(MODEL), torch.inference_mode():
        for start in range(0, 8192, 64):
            logits = MODEL(stream[:, start : start + 64], cache=cache).logits
            held.append(cache.stats().kv_bytes)
    assert bool(torch.isfinite(logits).all())
    # 2 layers x 2 KV heads x min(tokens so far, 256) slots: growth stops at the budget, after 4 chunks.
    expected = [2 * 2 * min(64 * (i + 1), 256) * KV_BYTES_PER_SLOT for i in range(128)]
    assert held == expected
    assert cache.get_seq_length() == 8192


def test_stats_count_tokens_kept_per_layer_and_head_never_padding() -> None:
    prompt = ids(2, 8)
    mask = torch.ones_like(prompt)
    prompt[0, :2], mask[0, :2] = 0, 0
    for budget, kept_per_head, slots in ((10, 6 + 8, 8), (5, 5 + 5, 5)):
        cache = HeavyHitterCache(MODEL, budget=budget, recent=2)
        with eviction_attention(MODEL):
            MODEL(prompt, attention_mask=mask, cache=cache)
        stats = cache.stats()
        assert (stats.sequences, stats.tokens_seen, stats.budget, stats.slots) == (2, 8, budget, slots)
        assert stats.kept == ((kept_per_head, kept_per_head), (kept_per_head, kept_per_head))
        assert stats.kv_bytes == 2 * 2 * 2 * slots * KV_BYTES_PER_SLOT
        # positions (8 bytes) + validity (1) + mass (4) per slot, for 2 layers x 2 rows x 2 heads.
        assert stats.metadata_bytes == 2 * 2 * 2 * slots * (8 + 1 + 4)
        assert stats.bytes_used == stats.kv_bytes + stats.metadata_bytes == kv_bytes(cache)
        assert stats.bytes_per_token == pytest.approx(stats.bytes_used / 16)


def test_fractional_budget_is_resolved_from_the_prompt_and_again_after_reset() -> None:
    h2o = HeavyHitterCache(MODEL, budget=0.5)
    sink = SinkCache(MODEL, n_sink=4, window=8, budget=0.25)
    assert h2o.stats().budget is None
    with eviction_attention(MODEL):
        first = MODEL.generate(input_ids=ids(1, 20), cache=h2o, max_new_tokens=5, do_sample=False)
        MODEL.generate(input_ids=ids(1, 20), cache=sink, max_new_tokens=5, do_sample=False)
        assert (h2o.budget, h2o.stats().slots) == (10, 10)  # half of the 20-token prompt
        assert h2o.policy.recent == 5 and h2o.policy.heavy == 5  # type: ignore[union-attr]
        assert sink.budget == 12  # a quarter of 20 is 5, raised to 4 sinks + 8 window
        h2o.reset()
        assert (h2o.budget, h2o.get_seq_length(), h2o.stats().slots) == (None, 0, 0)
        again = MODEL.generate(input_ids=ids(1, 20), cache=h2o, max_new_tokens=5, do_sample=False)
    assert torch.equal(first, again)


def test_budget_smaller_than_its_fixed_parts_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match=r"4 sink \+ 60 window = 64 slots.*at least 64; got a budget of 32"):
        SinkCache(MODEL, n_sink=4, window=60, budget=32)
    with pytest.raises(ValueError, match="at least 6; got a budget of 4"):
        HeavyHitterCache(MODEL, budget=4, recent=6)
    with pytest.raises(ValueError, match="at least 7; got a budget of 6"):
        HeavyHitterCache(MODEL, budget=6, recent=3, heavy=4)
    with pytest.raises(ValueError, match=r"adding up to 1\.2"):
        HeavyHitterCache(MODEL, budget=0.2, recent=0.7, heavy=0.5)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"budget": 0}, ValueError, "at least 1; got 0"),
        ({"budget": 1.5}, ValueError, r"in \(0, 1\]; got 1.5"),
        ({"budget": True}, TypeError, "int number of tokens or a float fraction"),
        ({"budget": 8, "recent": -1}, ValueError, "at least 0; got -1"),
        ({"budget": 8, "query_chunk": 0}, ValueError, "query_chunk must be a positive int"),
    ],
)
def test_bad_arguments_are_explained(kwargs, error, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(error, match=message):
        HeavyHitterCache(MODEL, **kwargs)


def test_models_the_caches_cannot_serve_are_refused() -> None:
    with pytest.raises(TypeError, match="needs the transformers model"):
        HeavyHitterCache(MODEL.config, budget=8)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=32, n_layer=1, n_head=2, n_positions=64))
    with pytest.raises(ValueError, match="has none"):
        SinkCache(gpt2, n_sink=4, window=12)


def test_running_without_the_eviction_attention_is_refused() -> None:
    cache = HeavyHitterCache(MODEL, budget=8)
    with pytest.raises(RuntimeError, match=r"eviction_attention\(model\)"):
        MODEL(ids(1, 5), cache=cache)


def test_a_cache_given_another_models_kv_names_the_geometry() -> None:
    """Built for MODEL (2 KV heads), run by a model of 4 under that model's eviction attention: the geometry is the
    mistake named, not the attention of the model the cache was built for."""
    other = tiny_llama(num_kv_heads=4)
    cache = HeavyHitterCache(MODEL, budget=8)
    wrong = "stored K/V with 4 heads of dim 16; this cache was built for 2 KV heads"
    with pytest.raises(ValueError, match=wrong), eviction_attention(other):
        other(ids(1, 5), cache=cache)


def test_a_policy_name_that_needs_settings_is_refused_with_the_way_to_give_them() -> None:
    with pytest.raises(ValueError, match=r"PolicyCache: The eviction policy 'h2o' cannot be built from no settings"):
        PolicyCache(MODEL, "h2o")
    with pytest.raises(ValueError, match=r"Give decode_policy as a policy object .*make_policy\('sink', ...\)"):
        PolicyCache(MODEL, "snapkv", decode_policy="sink")


def test_cropping_and_assisted_decoding_are_refused() -> None:
    cache = SinkCache(MODEL, n_sink=2, window=6)
    with eviction_attention(MODEL):
        MODEL(ids(1, 5), cache=cache)
        cache.crop(0)  # nothing to remove is fine
        with pytest.raises(ValueError, match="cannot crop 2 token"):
            cache.crop(-2)
        repetitive = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]])
        with pytest.raises(ValueError, match="cropped"):
            MODEL.generate(
                input_ids=repetitive,
                cache=SinkCache(MODEL, 2, 6),
                prompt_lookup_num_tokens=3,
                max_new_tokens=4,
            )


def test_another_batch_size_needs_a_reset() -> None:
    cache = HeavyHitterCache(MODEL, budget=8)
    with eviction_attention(MODEL):
        MODEL(ids(2, 4), cache=cache)
        with pytest.raises(ValueError, match="holds a batch of 2 sequences but got a batch of 3"):
            MODEL(ids(3, 4), cache=cache)
        cache.reset()
        MODEL(ids(3, 4), cache=cache)
    assert cache.stats().sequences == 3


def test_context_restores_the_implementation_and_other_caches_still_work() -> None:
    before = MODEL.config._attn_implementation
    expected = MODEL.generate(input_ids=ids(1, 6), cache=DynamicCache(), max_new_tokens=8, do_sample=False)
    with eviction_attention(MODEL):
        assert MODEL.config._attn_implementation == ATTENTION_NAME
        # A DynamicCache under the eviction attention runs plain sdpa.
        dynamic = MODEL.generate(input_ids=ids(1, 6), cache=DynamicCache(), max_new_tokens=8, do_sample=False)
    assert MODEL.config._attn_implementation == before
    assert torch.equal(dynamic, expected)
    with pytest.raises(RuntimeError, match="boom"), eviction_attention(MODEL):
        raise RuntimeError("boom")
    assert MODEL.config._attn_implementation == before


@pytest.mark.parametrize("name", ["h2o", "sink"])
def test_registered_specs_build_and_run_under_their_attention(name: str) -> None:
    spec = get_cache_spec(name)
    assert not spec.lossless
    cache = spec.build(MODEL)
    with spec.attention(MODEL):
        MODEL.generate(input_ids=ids(1, 400), cache=cache, max_new_tokens=3, do_sample=False)
    # 20% of a 400-token prompt is 80 slots; the sink preset never goes below 4 + 60.
    assert cache.stats().slots == 80
