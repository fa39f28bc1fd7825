"""The named caches are presets of GovernedCache: the composed equivalent is the same cache, token for token.

Each preset is built directly and through ``GovernedCache(model, **preset.parts.kwargs())`` and, for the
hand-written compositions, through the parts a user would write. Both run the same generate on the tiny
model; the tokens and every step's logits must be identical (the same store runs, so not even float
noise may differ).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch

from hf_kvgov import (
    DiskOffloadCache,
    GovernedCache,
    GovernedCacheBase,
    HeavyHitterCache,
    PagedCache,
    PolicyCache,
    QuantizedCache,
    QuantizedDiskCache,
    SinkCache,
    eviction_attention,
    paged_attention,
    prefix_tree,
)
from hf_kvgov.chain import ChainParts, Disk, Evict, HeavyHitter, Layer, Paging, Sink
from hf_kvgov.hf.eviction import EvictionCache
from hf_kvgov.policies import H2O, HeadAdaptive, Pyramid, SnapKV
from hf_kvgov.tiers.recall_pages import Recall
from tests.conftest import tiny_llama

MODEL = tiny_llama()
Build = Callable[[Any], Any]
TREE = prefix_tree(MODEL, pool=Paging(block_size=4))  # generate below never publishes: it stays empty
INT8_TREE = prefix_tree(MODEL, pool=Paging(block_size=4), codec="int8")  # the same, over an int8 pool

PRESETS: dict[str, Build] = {
    "paged": lambda m: PagedCache(m, block_size=8),
    "paged, paged attention": lambda m: PagedCache(m, block_size=4, attention="paged"),
    "int8": lambda m: QuantizedCache(m, bits=8, block_size=4),
    "int4, layer 0 full precision": lambda m: QuantizedCache(m, bits=4, block_size=4, full_precision_layers=[0]),
    "fp8, residual, paged attention": lambda m: QuantizedCache(
        m, bits=8, fmt="fp8", block_size=4, residual=8, attention="paged"
    ),
    "disk": lambda m: DiskOffloadCache(m, hot_tokens=8, block_size=4),
    "disk with a prefix tree": lambda m: DiskOffloadCache(m, hot_tokens=8, prefix=TREE, namespace="a"),
    "int8 + disk": lambda m: QuantizedDiskCache(m, hot_tokens=8, block_size=4),
    "int4 + disk, residual, paged attention": lambda m: QuantizedDiskCache(
        m, hot_tokens=4, bits=4, block_size=4, residual=4, attention="paged"
    ),
    "int8 + disk with a prefix tree": lambda m: QuantizedDiskCache(m, hot_tokens=8, prefix=INT8_TREE, namespace="a"),
    "h2o": lambda m: HeavyHitterCache(m, budget=12, recent=4),
    "sink": lambda m: SinkCache(m, n_sink=2, window=10),
    "h2o, int8 slots, layer 0 budget": lambda m: HeavyHitterCache(m, budget=12, codec="int8", layer_budgets={0: 16}),
    "sink, fp8 slots": lambda m: SinkCache(m, n_sink=2, window=10, codec="fp8"),
    "h2o, int8 slots, recall": lambda m: HeavyHitterCache(m, budget=12, codec="int8", recall=Recall(pages=2)),
    "h2o, head-adaptive": lambda m: HeavyHitterCache(m, budget=12, head_budgets=HeadAdaptive()),
    "snapkv": lambda m: PolicyCache(m, SnapKV(window=4), budget=12),
    "snapkv then h2o, int8, recall": lambda m: PolicyCache(
        m, "snapkv", 40, decode_policy=H2O(0.5, 8), codec="int8", recall=Recall(pages=2)
    ),
    "tova, prefill only, pyramid, head-adaptive": lambda m: PolicyCache(
        m, "tova", 12, compress="prefill", layer_budgets=Pyramid(), head_budgets=HeadAdaptive(0.5)
    ),
}

# The same caches as a user composes them from parts.
COMPOSED: dict[str, tuple[Build, Build]] = {
    "paged": (lambda m: PagedCache(m, block_size=8), lambda m: GovernedCache(m, pool=Paging(block_size=8))),
    "int8": (lambda m: QuantizedCache(m, block_size=4), lambda m: GovernedCache(m, pool=Paging(4), codec="int8")),
    "int4 with a full-precision layer": (
        lambda m: QuantizedCache(m, bits=4, block_size=4, full_precision_layers=[1]),
        lambda m: GovernedCache(m, pool=Paging(4), codec="int4", layers={1: Layer(full_precision=True)}),
    ),
    "disk": (
        lambda m: DiskOffloadCache(m, hot_tokens=8, block_size=4),
        lambda m: GovernedCache(m, pool=Paging(4), spill=Disk(hot_tokens=8)),
    ),
    "prefix sharing + disk": (
        lambda m: DiskOffloadCache(m, hot_tokens=8, block_size=4, prefix=TREE),
        lambda m: GovernedCache(m, pool=Paging(4), prefix=TREE, spill=Disk(hot_tokens=8)),
    ),
    "int8 + disk": (
        lambda m: QuantizedDiskCache(m, hot_tokens=8, block_size=4),
        lambda m: GovernedCache(m, pool=Paging(4), codec="int8", spill=Disk(hot_tokens=8)),
    ),
    "prefix sharing + int8 + disk": (
        lambda m: QuantizedDiskCache(m, hot_tokens=8, block_size=4, prefix=INT8_TREE),
        lambda m: GovernedCache(m, pool=Paging(4), prefix=INT8_TREE, codec="int8", spill=Disk(hot_tokens=8)),
    ),
    "h2o": (
        lambda m: HeavyHitterCache(m, budget=12, recent=4),
        lambda m: GovernedCache(m, policy=HeavyHitter(budget=12, recent=4)),
    ),
    "sink": (lambda m: SinkCache(m, n_sink=2, window=10), lambda m: GovernedCache(m, policy=Sink(2, 10))),
    "SnapKV, int8, a layer budget": (
        lambda m: PolicyCache(m, SnapKV(window=4), budget=12, codec="int8", layer_budgets={1: 20}),
        lambda m: GovernedCache(m, policy=Evict(SnapKV(window=4), 12), codec="int8", layers={1: Layer(budget=20)}),
    ),
    "Expected Attention, head-adaptive, disk spill with recall": (
        lambda m: PolicyCache(m, "expected_attention", 40, head_budgets=HeadAdaptive(), recall=Recall(pages=2)),
        lambda m: GovernedCache(
            m, policy=Evict("expected_attention", 40, heads=HeadAdaptive()), spill=Disk(recall_pages=2)
        ),
    ),
    "int8 + H2O with a layer budget": (
        lambda m: HeavyHitterCache(m, budget=12, recent=4, codec="int8", layer_budgets={1: 20}),
        lambda m: GovernedCache(m, policy=HeavyHitter(12, recent=4), codec="int8", layers={1: Layer(budget=20)}),
    ),
    "int8 + H2O + disk spill with recall": (
        lambda m: HeavyHitterCache(m, budget=12, recent=4, codec="int8", recall=Recall(pages=2, page_tokens=4)),
        lambda m: GovernedCache(
            m, policy=HeavyHitter(12, recent=4), codec="int8", spill=Disk(recall_pages=2, page_tokens=4)
        ),
    ),
}


def attention_for(cache: Any, model: Any) -> contextlib.AbstractContextManager[Any]:
    if isinstance(cache, EvictionCache):
        return eviction_attention(model)
    if cache.parts.attention == "paged":
        return paged_attention(model)
    return contextlib.nullcontext()


def generate(model: Any, cache: Any) -> Any:
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 96, (2, 21), generator=generator)
    mask = torch.ones_like(ids)
    ids[0, :3], mask[0, :3] = 0, 0  # left padding in row 0
    with attention_for(cache, model):
        return model.generate(
            input_ids=ids,
            attention_mask=mask,
            cache=cache,
            max_new_tokens=10,
            do_sample=False,
            return_dict_in_generate=True,
            output_scores=True,
        )


def assert_identical(first: Any, second: Any) -> None:
    assert torch.equal(first.sequences, second.sequences)
    for a, b in zip(first.scores, second.scores, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_and_its_composed_equivalent_are_the_same_cache(name: str) -> None:
    preset = PRESETS[name](MODEL)
    composed = GovernedCache(MODEL, **preset.parts.kwargs())
    assert isinstance(preset, GovernedCacheBase)
    assert type(composed) is type(preset)
    assert composed.parts == preset.parts
    assert_identical(generate(MODEL, preset), generate(MODEL, composed))


@pytest.mark.parametrize("name", sorted(COMPOSED))
def test_parts_written_by_hand_build_the_preset(name: str) -> None:
    build_preset, build_composed = COMPOSED[name]
    preset, composed = build_preset(MODEL), build_composed(MODEL)
    assert type(composed) is type(preset)
    assert composed.parts == preset.parts
    assert_identical(generate(MODEL, preset), generate(MODEL, composed))


@pytest.mark.parametrize(
    ("policy", "kind"),
    [
        (HeavyHitter(12, recent=4), HeavyHitterCache),
        (Evict(SnapKV(window=4), 12, decode_policy=H2O(0.5, 4), heads=HeadAdaptive()), PolicyCache),
    ],
)
def test_the_whole_chain_builds(tmp_path: Any, policy: Any, kind: type) -> None:
    from hf_kvgov import prefix_tree

    parts = {"codec": "int8", "policy": policy, "spill": Disk(path=str(tmp_path))}
    tree = prefix_tree(MODEL, pool=Paging(16))  # the shared prefix is read as computed: a full-precision tree
    cache = GovernedCache(MODEL, pool=Paging(16), prefix=tree, **parts)
    assert isinstance(cache, kind) and cache.pool is not None and cache.recall is not None
    assert cache.prefix is tree
    out = generate(MODEL, cache)
    assert out.sequences.shape == (2, 31) and cache.stats().kv_bytes == cache.pool.num_used * cache.pool.bytes_per_block


BLOCK_PRESETS = [name for name in sorted(PRESETS) if not isinstance(PRESETS[name](MODEL), EvictionCache)]


@pytest.mark.parametrize("name", BLOCK_PRESETS)
def test_each_block_preset_is_the_one_store_with_its_links(name: str) -> None:
    """The store itself, given a preset's parts, is that preset token for token: the presets add no behaviour."""
    preset = PRESETS[name](MODEL)
    store = PagedCache.from_parts(MODEL, preset.parts)
    assert type(store) is PagedCache and store.parts == preset.parts
    assert (store.sealer is None) == (preset.parts.codec is None)
    assert (store.spill_link is None) == (preset.parts.spill is None)
    assert_identical(generate(MODEL, preset), generate(MODEL, store))


@pytest.mark.parametrize("preset", [QuantizedCache, DiskOffloadCache, QuantizedDiskCache])
def test_block_presets_override_only_their_constructor_and_the_type_of_their_stats(preset: type) -> None:
    overridden = {name for name in vars(preset) if name in dir(PagedCache) and callable(getattr(PagedCache, name))}
    assert overridden <= {"__init__", "stats"}, overridden


def test_the_store_takes_its_links_as_arguments(tmp_path: Any) -> None:
    from hf_kvgov.engine.parts import codec_config

    int8 = codec_config("int8")
    store = PagedCache(MODEL, block_size=4, codec=int8, spill=Disk(path=str(tmp_path), hot_tokens=8))
    preset = QuantizedDiskCache(MODEL, path=str(tmp_path), hot_tokens=8, block_size=4)
    assert store.parts == preset.parts
    assert_identical(generate(MODEL, preset), generate(MODEL, store))
    assert store.stats().spilled_blocks > 0  # type: ignore[attr-defined]  # a QuantizedDiskCacheStats
    with pytest.raises(ValueError, match="creates its own pool"):
        PagedCache(MODEL, pool=store.pool, spill=Disk())
    with pytest.raises(ValueError, match=r"give it as Disk\(max_resident_bytes=\.\.\.\)"):
        PagedCache(MODEL, max_tokens=64, spill=Disk())
    unchecked = ChainParts(pool=Paging(4, max_tokens=64), spill=Disk())  # parts the chain rules would refuse
    with pytest.raises(ValueError, match=r"give it as Disk\(max_resident_bytes=\.\.\.\)"):
        PagedCache.from_parts(MODEL, unchecked)


def test_a_disk_tier_named_with_its_trees_pool_draws_from_the_tree() -> None:
    tree = prefix_tree(MODEL, pool=Paging(block_size=4))
    cache = GovernedCache(MODEL, pool=tree.pool, prefix=tree, spill=Disk(hot_tokens=8))
    reference = DiskOffloadCache(MODEL, hot_tokens=8, prefix=tree)
    assert isinstance(cache, DiskOffloadCache) and cache.pool is tree.pool
    assert_identical(generate(MODEL, reference), generate(MODEL, cache))
