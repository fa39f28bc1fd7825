"""Head-adaptive budgets (``head_budgets=HeadAdaptive()``) on the eviction caches.

The checks: the cache keeps exactly what `HeadAdaptive.select` picks from its policy's priority; a floor of 1
is the uniform cache, token for token; a budget covering everything is `DynamicCache`; the pool holds only the
kept slots, so bytes equal the uniform budget's and fall below the padded layout's; a full pool refuses; and
what is evicted is spilled, nothing lost.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from transformers import DynamicCache

from hf_kvgov import HeavyHitterCache, PolicyCache, PoolExhausted, Recall, eviction_attention, eviction_pool
from hf_kvgov.policies import EvictionPolicy, FactNeeds, HeadAdaptive, SlotFacts, SnapKV, select_by_priority
from hf_kvgov.policies.base import ranking_of
from tests.conftest import tiny_gemma3, tiny_llama
from tests.eviction.test_eviction_policies import Recording
from tests.eviction.test_pooled_slots import BLOCK, batch, generate


def prefill(model: Any, cache: Any, rows: int = 2) -> None:
    ids, mask = batch(model, rows)
    with eviction_attention(model), torch.inference_mode():
        model(input_ids=ids, attention_mask=mask, cache=cache)


@dataclass
class RecordingPriority(Recording):
    """SnapKV that records the priority it hands the cache at each eviction."""

    inner: EvictionPolicy = field(default_factory=lambda: SnapKV(window=4, kernel=3))
    calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]] = field(default_factory=list)

    def priority(self, facts: SlotFacts, positions: torch.Tensor, valid: torch.Tensor, budget: int) -> torch.Tensor:
        priority = ranking_of(self.inner, "RecordingPriority").priority(facts, positions, valid, budget)
        self.calls.append((priority, positions, valid, budget))
        return priority


def kept_positions(positions: torch.Tensor, valid: torch.Tensor) -> list[list[list[int]]]:
    """Sorted kept positions per (row, head)."""
    return [
        [sorted(p[v].tolist()) for p, v in zip(rp, rv, strict=True)] for rp, rv in zip(positions, valid, strict=True)
    ]


def test_the_cache_keeps_what_head_adaptive_selects_from_the_policys_priority() -> None:
    model = tiny_llama()
    policy = RecordingPriority()
    adaptive = HeadAdaptive(floor=0.25)
    cache = PolicyCache(model, policy, budget=8, head_budgets=adaptive)
    prefill(model, cache)
    layers = model.config.num_hidden_layers
    assert len(policy.calls) == layers  # the prompt (30 tokens) exceeds 8: every layer evicts once
    for layer, (priority, positions, valid, budget) in zip(cache.layers, policy.calls, strict=True):
        keep_idx, kept = adaptive.select(priority, positions, valid, budget)
        chosen = valid.gather(-1, keep_idx) & kept
        assert kept_positions(layer.positions, layer.valid) == kept_positions(positions.gather(-1, keep_idx), chosen)
    per_head = [[int(v.sum()) for v in row] for row in cache.layers[0].valid]
    assert [sum(row) for row in per_head] == [2 * 8, 2 * 8]  # the layer's total: 2 KV heads x budget 8
    assert any(len(set(row)) > 1 for layer in cache.layers for row in layer.valid.sum(-1).tolist())


@pytest.mark.parametrize("codec", [None, "int8"])
def test_a_floor_of_one_is_the_uniform_cache(codec: str | None) -> None:
    model = tiny_llama()
    uniform = generate(model, PolicyCache(model, SnapKV(window=4), budget=10, codec=codec))
    floored = generate(
        model, PolicyCache(model, SnapKV(window=4), budget=10, codec=codec, head_budgets=HeadAdaptive(1))
    )
    assert torch.equal(uniform.sequences, floored.sequences)
    for a, b in zip(uniform.logits, floored.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("build", ["snapkv", "h2o"])
def test_a_budget_covering_everything_is_the_dynamic_cache(build: str) -> None:
    model = tiny_gemma3(window=8)  # sliding layers keep their window; the full layer keeps everything
    adaptive = HeadAdaptive()
    cache = (
        PolicyCache(model, SnapKV(window=4), budget=64, head_budgets=adaptive)
        if build == "snapkv"
        else HeavyHitterCache(model, budget=64, head_budgets=adaptive)
    )
    governed = generate(model, cache)
    reference = generate(model, DynamicCache(config=model.config), switch=False)
    assert torch.equal(governed.sequences, reference.sequences)
    for a, b in zip(governed.logits, reference.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_the_pool_holds_only_the_kept_slots() -> None:
    model = tiny_llama()
    pool = eviction_pool(model, block_size=BLOCK)
    adaptive = PolicyCache(model, SnapKV(window=4), budget=12, head_budgets=HeadAdaptive(floor=0), pool=pool)
    prefill(model, adaptive)
    uniform = PolicyCache(model, SnapKV(window=4), budget=12)
    prefill(model, uniform)
    heads = model.config.num_key_value_heads
    for layer in adaptive.layers:
        counts = layer.valid.sum(-1)  # [rows, heads]
        assert counts.sum(-1).tolist() == [heads * 12, heads * 12]
        # One stream of kept records per row, BLOCK x heads records to a block.
        assert [len(table) for table in layer.home.tables] == [-(-heads * 12 // (BLOCK * heads))] * 2
        padded_blocks = -(-int(counts.max()) // BLOCK)  # blocks per row if each head were padded to the largest
        assert padded_blocks > len(layer.home.tables[0]) or int(counts.max()) == 12
    assert any(int(layer.valid.sum(-1).max()) > 12 for layer in adaptive.layers)  # heads did differ
    stats = adaptive.stats()
    assert stats.kv_bytes == pool.num_used * pool.bytes_per_block
    assert stats.kv_bytes == uniform.stats().kv_bytes  # uniform budget 12 = 3 blocks of 4 per row and layer
    assert sum(map(sum, stats.kept)) == sum(map(sum, uniform.stats().kept))
    adaptive.release()
    assert pool.num_used == 0


def test_without_a_pool_the_cache_builds_its_own() -> None:
    model = tiny_llama()
    cache = HeavyHitterCache(model, budget=12, head_budgets=HeadAdaptive())
    generate(model, cache)
    assert cache.pool is not None and cache.pool.num_used * cache.pool.bytes_per_block == cache.stats().kv_bytes
    assert cache.parts.policy is not None and cache.parts.policy.heads == HeadAdaptive()


def test_a_full_pool_raises_and_leaves_the_first_request_untouched() -> None:
    model = tiny_llama()
    # 12 slots x 2 heads per row and layer = 3 blocks; 2 rows x 2 layers = 12 blocks per request.
    pool = eviction_pool(model, block_size=BLOCK, max_tokens=16 * BLOCK)
    first = PolicyCache(model, SnapKV(window=4), budget=12, head_budgets=HeadAdaptive(), pool=pool)
    expected = generate(model, PolicyCache(model, SnapKV(window=4), budget=12, head_budgets=HeadAdaptive()))
    assert torch.equal(generate(model, first).sequences, expected.sequences)
    held = pool.num_used
    kept = [[t.clone() for t in layer.home._read().read()] for layer in first.layers]  # from the blocks
    second = PolicyCache(model, SnapKV(window=4), budget=12, head_budgets=HeadAdaptive(), pool=pool)
    with pytest.raises(PoolExhausted):
        generate(model, second)
    second.release()
    assert pool.num_used == held
    for layer, (keys, values) in zip(first.layers, kept, strict=True):  # nothing of the first was overwritten
        again = layer.home._read().read()  # read the blocks again, not the step's cached store
        assert torch.equal(again[0], keys) and torch.equal(again[1], values)


def test_what_is_evicted_is_spilled_nothing_lost(tmp_path: Any) -> None:
    model = tiny_llama()
    recall = Recall(path=str(tmp_path), pages=2, page_tokens=1)
    cache = PolicyCache(model, SnapKV(window=4), budget=8, head_budgets=HeadAdaptive(floor=0), recall=recall)
    generate(model, cache, rows=1, new=12)  # one token per page: every evicted token is on disk, none pending
    stats = cache.stats()
    assert stats.recall is not None
    assert any(len(set(head)) > 1 for head in stats.kept)  # heads kept different numbers: fillers existed
    slots_seen = model.config.num_hidden_layers * model.config.num_key_value_heads * stats.tokens_seen
    assert stats.recall.tokens_spilled + sum(map(sum, stats.kept)) == slots_seen


def test_head_budgets_are_refused_unless_they_can_rank() -> None:
    model = tiny_llama()
    with pytest.raises(TypeError, match="head_budgets must be HeadAdaptive"):
        PolicyCache(model, SnapKV(), budget=40, head_budgets="ada")  # type: ignore[arg-type]

    @dataclass(frozen=True)
    class Oldest:  # a policy with no priority: it cannot be compared across heads
        min_budget: int = 1

        @property
        def needs(self) -> FactNeeds:
            return FactNeeds()

        def select(self, facts: SlotFacts, positions: torch.Tensor, valid: torch.Tensor, budget: int) -> torch.Tensor:
            return select_by_priority(-positions.float(), positions, valid, min(budget, positions.shape[-1]))

    with pytest.raises(TypeError, match="priority"):
        PolicyCache(model, Oldest(), budget=40, head_budgets=HeadAdaptive())
