"""The planner's model of eviction slots and of caches that keep every token in sliding-window layers.

Byte counts are worked out by hand first; then the planner's figure for a real cache on a tiny model must
equal the cache's own `stats()` (within 2%, as the chain benchmark relies on).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from hf_kvgov import HeavyHitterCache, PagedCache, PolicyCache, QuantizedCache, SinkCache, eviction_attention
from hf_kvgov.bench.plan_setups import planner_geometry, planner_setup
from hf_kvgov.engine.quant_config import QuantConfig
from hf_kvgov.planner import CacheSetup, ModelGeometry
from hf_kvgov.planner.accounting import sequence_bytes, shared_store_bytes
from hf_kvgov.planner.layout import SLOT_CODECS
from hf_kvgov.policies import ExpectedAttention, HeadAdaptive, QueryForecast, SnapKV
from tests.conftest import tiny_gemma3, tiny_llama

# Per kept slot and KV head: positions (int64) and validity (bool), plus H2O's fp32 attention mass.
METADATA, SCORE = 8 + 1, 4


@pytest.mark.parametrize(
    ("codec", "slot"),
    [
        ("int8", 2 * (16 + 2 * 2)),  # codes D, then scale + zero (fp16) for the slot's one group, K and V
        ("int4", 2 * (8 + 2 * 2)),  # two codes per byte
        ("fp8", 2 * (16 + 2)),  # no zero point
    ],
)
def test_slot_codes_by_hand(codec: str, slot: int) -> None:
    layout = SLOT_CODECS[codec](2, None)
    assert layout.slot_bytes(16) == slot
    assert SLOT_CODECS[codec](2, 8).slot_bytes(16) - slot == 2 * (2 if codec != "fp8" else 1) * 2  # a second group


def test_eviction_slots_are_counted_per_kept_slot(unit: ModelGeometry) -> None:
    # unit: 1 layer x 1 KV head x head_dim 8. 20% of 100 tokens = 20 slots.
    setup = CacheSetup(
        block_size=1, kv_dtype="fp32", codec="int8", h2o_budget=0.2, h2o_recent=1, h2o_metadata_bytes=METADATA,
        eviction_slots=True,
    )  # fmt: skip
    per_slot = 2 * (8 + 2 * 2) + SCORE + METADATA
    assert sequence_bytes(unit, setup, 100).device == 20 * per_slot
    # Without a codec a slot is K and V in the model's precision.
    dense = CacheSetup(block_size=1, kv_dtype="fp32", h2o_budget=0.2, h2o_recent=1, eviction_slots=True)
    assert sequence_bytes(unit, dense, 100).device == 20 * (2 * 8 * 4 + SCORE)


def test_eviction_budget_comes_from_the_sequence_and_windows_cap_it() -> None:
    geometry = ModelGeometry("g", 2, 1, 8, 4096, sliding_window=64, sliding_layers=(0,))
    setup = CacheSetup(block_size=1, kv_dtype="fp32", h2o_budget=0.2, h2o_recent=1, h2o_score_bytes=0)
    # 20% of 1,000 tokens = 200 slots in the full layer; the window layer keeps at most 63 (its next query's).
    assert sequence_bytes(geometry, setup, 1000).device == (200 + 63) * 2 * 8 * 4
    # Below the window, both layers keep the same budget: 20% of 300 = 60.
    assert sequence_bytes(geometry, setup, 300).device == 2 * 60 * 2 * 8 * 4


def test_eviction_slots_refuse_block_spill() -> None:
    with pytest.raises(ValueError, match="eviction_slots describes an eviction cache's per-head slots"):
        CacheSetup(block_size=1, eviction_slots=True)
    with pytest.raises(ValueError, match="spills no blocks"):
        CacheSetup(block_size=1, h2o_budget=0.2, spill_hot_tokens=64, eviction_slots=True)


def test_a_shared_prefix_is_stored_once_in_full_precision_and_the_budget_is_of_the_own_tokens() -> None:
    geometry = ModelGeometry("g", 2, 1, 8, 4096)  # 2 layers, 1 KV head of dim 8
    setup = CacheSetup(
        block_size=16, kv_dtype="fp32", codec="int8", h2o_budget=0.2, h2o_recent=1, eviction_slots=True,
        shared_fraction=0.5, h2o_score_bytes=0,
    )  # fmt: skip
    # 320 tokens: 160 shared (10 blocks), 160 own, of which H2O keeps 32: two blocks of slot rows of int8 records
    # (8 codes + fp16 scale and zero: 12 bytes, K and V).
    assert sequence_bytes(geometry, setup, 320).device == 2 * 2 * 16 * 2 * 12
    assert shared_store_bytes(geometry, setup, 160) == 2 * 10 * 16 * 2 * 8 * 4  # the tree's fp32 blocks


def test_a_cache_that_keeps_every_token_ignores_the_window() -> None:
    geometry = ModelGeometry("g", 2, 1, 8, 4096, sliding_window=32, sliding_layers=(0,))
    block = 2 * 16 * 8 * 2  # fp16, 16 tokens
    freeing = CacheSetup(block_size=16)
    keeping = CacheSetup(block_size=16, window_frees=False)
    # 160 tokens = 10 blocks. Freeing: the window [128, 160) spans blocks 8..9 = 2 blocks in layer 0.
    assert sequence_bytes(geometry, freeing, 160).device == (10 + 2) * block
    assert sequence_bytes(geometry, keeping, 160).device == 2 * 10 * block


# ------------------------------------------------------------------ against the caches' own accounting


MODELS = {"llama": tiny_llama, "gemma3": tiny_gemma3}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request: pytest.FixtureRequest) -> Any:
    return MODELS[request.param]()


def _run(model: Any, cache: Any, tokens: int, evicting: bool) -> Any:
    """The prompt (all tokens but the last), then one decode step, as the chain benchmark feeds a sequence."""
    ids = torch.arange(4, 4 + tokens).remainder(90).add(4)[None]
    context = eviction_attention(model) if evicting else contextlib.nullcontext()
    with context, torch.inference_mode():
        model(ids[:, :-1], cache=cache)
        model(ids[:, -1:], cache=cache)
    return cache


def _predicted(model: Any, cache: Any, tokens: int) -> int:
    geometry = planner_geometry(model)
    setup = planner_setup(cache, "fp32")
    assert geometry is not None and setup is not None
    return sequence_bytes(geometry, setup, tokens).device


# 61 tokens: floor(0.2 x 60) = floor(0.2 x 61) = 12 and floor(0.5 x 60) = floor(0.5 x 61) = 30, so the budget
# the cache resolves on its 60-token prompt is the planner's for the 61-token sequence. The prompt is fed
# directly, not by generate, so the caches are told its length.
PROMPT = 60
EVICTING: dict[str, Callable[[Any], Any]] = {
    "h2o": lambda m: HeavyHitterCache(m, budget=0.2, budget_of=PROMPT),
    "h2o-int8": lambda m: HeavyHitterCache(m, budget=0.2, codec="int8", budget_of=PROMPT),
    "h2o-int4": lambda m: HeavyHitterCache(m, budget=0.5, codec="int4", budget_of=PROMPT),
    "h2o-fp8": lambda m: HeavyHitterCache(m, budget=0.5, codec="fp8", budget_of=PROMPT),
    "sink-int8": lambda m: SinkCache(m, n_sink=2, window=6, budget=0.5, codec="int8", budget_of=PROMPT),
    "snapkv": lambda m: PolicyCache(m, SnapKV(window=4, kernel=3), budget=0.2, budget_of=PROMPT),
    "mean-mass-int8": lambda m: PolicyCache(m, "mean_mass", budget=0.5, codec="int8", budget_of=PROMPT),
    "expected-attention-running": lambda m: PolicyCache(
        m, ExpectedAttention(forecast=QueryForecast(running=True)), budget=0.7, budget_of=PROMPT
    ),
}


@pytest.mark.parametrize("name", sorted(EVICTING))
def test_eviction_bytes_match_stats(model: Any, name: str) -> None:
    cache = _run(model, EVICTING[name](model), 61, evicting=True)
    measured = cache.stats().bytes_used
    assert _predicted(model, cache, 61) == measured  # exact; the chain benchmark needs within 2%


def test_h2o_int8_bytes_by_hand_on_the_tiny_llama() -> None:
    model = tiny_llama()
    cache = _run(model, HeavyHitterCache(model, budget=0.2, codec="int8", budget_of=PROMPT), 61, evicting=True)
    # 2 layers x 2 KV heads x 12 slots x (40 B of codes and scales + 4 B mass + 9 B bookkeeping).
    expected = 2 * 2 * 12 * (40 + SCORE + METADATA)
    assert cache.stats().bytes_used == expected == _predicted(model, cache, 61)


def test_running_statistics_by_hand_on_the_tiny_llama() -> None:
    model = tiny_llama()
    cache = _run(model, EVICTING["expected-attention-running"](model), 61, evicting=True)
    # 2 layers x 2 KV heads x 42 slots (0.7 x 60) x (128 B of float32 K and V + 9 B bookkeeping), and per layer the
    # running statistics of 4 query heads of dim 16 in float64: a count, 4 x 16 sums and the upper triangles (16 x 17
    # / 2 = 136 entries) of 4 sums of outer products.
    statistics = 8 * (1 + 4 * 16 + 4 * 136)
    assert cache.query_statistics_bytes == statistics and not cache.keeps_mass
    assert cache.stats().bytes_used == 2 * 2 * 42 * (128 + METADATA) + 2 * statistics == _predicted(model, cache, 61)


def test_budgets_the_planner_cannot_model_get_no_setup(model: Any) -> None:
    for cache in (
        PolicyCache(model, "snapkv", budget=40),  # a count of slots, not a fraction of the sequence
        PolicyCache(model, "snapkv", budget=0.2, compress="prefill"),  # later tokens are all kept
        PolicyCache(model, "snapkv", budget=0.2, head_budgets=HeadAdaptive()),  # the fullest head decides
    ):
        assert planner_setup(cache, "fp32") is None


@pytest.mark.parametrize("make", [lambda m: PagedCache(m), lambda m: QuantizedCache(m, bits=8)], ids=["paged", "int8"])
def test_block_caches_match_stats(model: Any, make: Callable[[Any], Any]) -> None:
    cache = _run(model, make(model), 61, evicting=False)
    assert _predicted(model, cache, 61) == cache.stats().bytes_used
    # A full-attention layer holds all 4 blocks (3 full, 1 tail). Both caches free what left a window: the last
    # step's query at 60 sees 53.. (window 8), so a sliding layer keeps block 3 (48-63) alone, its tail.
    full_layers = sum(group.window is None for group in cache.groups for _ in group.layers)
    sliding_layers = len(cache.layers) - full_layers
    fp_block = 16 * 2 * 2 * 16 * 4  # 16 tokens x K and V x 2 heads x dim 16, fp32
    if isinstance(cache, QuantizedCache):
        # int8: codes (1 B) for K and V, fp16 scale + zero per key channel and per value token and head.
        sealed_block = 2 * 16 * 2 * 16 + 2 * 2 * 2 * 16 + 2 * 2 * 16 * 2
        pool = cache._quantized_pool
        assert pool.sealed.bytes_per_block == pool.layers_per_block * sealed_block  # a block spans a layer group
        # A full-attention layer: sink and tail in full precision, blocks 1 and 2 sealed.
        expected = full_layers * (2 * fp_block + 2 * sealed_block) + sliding_layers * fp_block
    else:
        expected = (full_layers * math.ceil(61 / 16) + sliding_layers) * fp_block
    assert cache.stats().bytes_used == expected


MIXED: dict[str, dict[str, Any]] = {
    "int8, layer 0 int4": {"bits": 8, "layer_formats": {0: "int4"}},
    "int4, layer 1 full": {"bits": 4, "layer_formats": {1: "full"}},
    "fp8, layer 0 int2": {"bits": 8, "fmt": "fp8", "layer_formats": {0: "int2"}},
}


@pytest.mark.parametrize("name", sorted(MIXED))
def test_per_layer_formats_are_planned_layer_by_layer(model: Any, name: str) -> None:
    options = MIXED[name]
    cache = _run(model, QuantizedCache(model, **options), 61, evicting=False)
    assert _predicted(model, cache, 61) == cache.stats().bytes_used
    # The map matters: the uniform cache holds other bytes, and the planner tells them apart.
    uniform_options = {k: v for k, v in options.items() if k != "layer_formats"}
    uniform = _run(model, QuantizedCache(model, **uniform_options), 61, evicting=False)
    assert uniform.stats().bytes_used != cache.stats().bytes_used == _predicted(model, cache, 61)


def test_layer_codecs_name_layers_of_the_model() -> None:
    geometry = ModelGeometry("g", 2, 1, 8, 4096)
    setup = CacheSetup(codec="int8", layer_codecs=((3, "int4"),))
    with pytest.raises(ValueError, match=r"layer_codecs names layers \[3\], but g has layers 0..1"):
        sequence_bytes(geometry, setup, 100)
    with pytest.raises(ValueError, match="unknown codecs"):
        CacheSetup(codec="int8", layer_codecs=((0, "int3"),))
    with pytest.raises(ValueError, match="distinct layer indices"):
        CacheSetup(codec="int8", layer_codecs=((0, "int4"), (0, None)))


@pytest.mark.parametrize("name", sorted(MIXED))
def test_eviction_slots_of_a_per_layer_map_are_planned_layer_by_layer(model: Any, name: str) -> None:
    quant = QuantConfig(**{"bits": 8, **MIXED[name]})
    cache = _run(model, HeavyHitterCache(model, budget=0.5, codec=quant, budget_of=PROMPT), 61, evicting=True)
    uniform_quant = QuantConfig(bits=quant.bits, fmt=quant.fmt)  # the map's default codec on every layer
    uniform = _run(model, HeavyHitterCache(model, budget=0.5, codec=uniform_quant, budget_of=PROMPT), 61, evicting=True)
    # The map changes what the slots hold, and the planner counts the map's formats, not the default codec's.
    assert uniform.stats().bytes_used != cache.stats().bytes_used == _predicted(model, cache, 61)
