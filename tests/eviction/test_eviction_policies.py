"""SnapKV, TOVA, key-norm, mean mass and Expected Attention through `PolicyCache`: lossless when the budget
covers everything, the facts they rank by equal to an eager-attention reference (Expected Attention's, from
the queries attention saw, in ``tests/policies/test_expected_attention.py``), each codec, and a prefill policy
with a decode policy."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from transformers import DynamicCache

from hf_kvgov import eviction_attention
from hf_kvgov.engine.slots import view as view_module
from hf_kvgov.hf.eviction import PolicyCache
from hf_kvgov.policies import (
    H2O,
    TOVA,
    EvictionPolicy,
    ExpectedAttention,
    FactNeeds,
    KeyNorm,
    MeanMass,
    SlotFacts,
    SnapKV,
    gather_kept,
)
from tests.conftest import tiny_gemma3, tiny_llama
from tests.eviction.test_eviction_equivalence import prompts, run

MODEL = tiny_llama(num_kv_heads=2)  # GQA: 4 query heads share each of the 2 KV heads
GROUP = 2
NEW: dict[str, Callable[[], EvictionPolicy]] = {
    "snapkv": lambda: SnapKV(window=4, kernel=3),
    "tova": TOVA,
    "key_norm": lambda: KeyNorm(recent=3),
    "mean_mass": lambda: MeanMass(recent=2),
    "expected_attention": lambda: ExpectedAttention(sinks=1, recent=1),
}
# The policies whose facts are functions of the attention matrix and the keys alone.
FROM_ATTENTION = sorted(set(NEW) - {"expected_attention"})


def assert_same_tokens(model, make_cache, inputs, **kwargs) -> None:  # type: ignore[no-untyped-def]
    expected = run(model, DynamicCache(), inputs, **kwargs)
    with eviction_attention(model):
        got = run(model, make_cache(model), inputs, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    for got_step, expected_step in zip(got.scores, expected.scores, strict=True):
        torch.testing.assert_close(got_step, expected_step, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(NEW))
def test_left_padded_batch_equals_dynamic_cache_when_the_budget_covers_everything(name: str) -> None:
    # 9 prompt + 12 new tokens fit in 64 slots: nothing is evicted, so every policy must be lossless.
    assert_same_tokens(MODEL, lambda m: PolicyCache(m, NEW[name](), budget=64), prompts(batch=2, length=9, pad=(4, 0)))


def test_prefill_and_decode_policies_equal_dynamic_cache_when_the_budget_covers_everything() -> None:
    make = lambda m: PolicyCache(m, "snapkv", budget=64, decode_policy=H2O(heavy=1.0, recent=8))  # noqa: E731
    assert_same_tokens(MODEL, make, prompts(batch=2, length=9, pad=(3, 0)))


@pytest.mark.parametrize("name", sorted(NEW))
def test_sliding_window_layers_equal_dynamic_cache_past_the_window(name: str) -> None:
    # Gemma-3 in miniature: its 8-token sliding layers read only the window, the full layer every slot.
    model = tiny_gemma3()
    assert_same_tokens(model, lambda m: PolicyCache(m, NEW[name](), budget=64), prompts(batch=2, length=14, pad=(2, 0)))


@pytest.mark.parametrize("codec", ["int8", "int4", "int2", "fp8"])
@pytest.mark.parametrize("name", sorted(NEW))
def test_every_codec_evicts_to_the_budget(name: str, codec: str) -> None:
    cache = PolicyCache(MODEL, NEW[name](), budget=6, codec=codec)
    with eviction_attention(MODEL):
        out = run(MODEL, cache, prompts(batch=2, length=20, pad=(5, 0)), max_new_tokens=6)
    assert out.sequences.shape == (2, 26)
    assert cache.stats().slots == 6 and cache.get_seq_length() == 25


# ---------------------------------------------------------------- the facts, against eager attention


def eager_reference(ids: torch.Tensor, mask: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer: eager attention probabilities ``[b, q_heads, q, k]`` and the cached keys ``[b, kv, k, d]``."""
    cache = DynamicCache()
    previous = MODEL.config._attn_implementation
    MODEL.set_attn_implementation("eager")
    try:
        out = MODEL(ids, attention_mask=mask, cache=cache, output_attentions=True)
    finally:
        MODEL.set_attn_implementation(previous)
    return list(out.attentions), [layer.keys for layer in cache.layers]


def reference_facts(attn: torch.Tensor, keys: torch.Tensor, needs: FactNeeds) -> SlotFacts:
    """The facts as the policies' contract defines them, from one layer's full attention matrix."""
    batch, q_heads, q_len, k_len = attn.shape
    grouped = attn.reshape(batch, q_heads // GROUP, GROUP, q_len, k_len)
    recent = grouped[:, :, :, q_len - needs.recent_queries :].sum(dim=(2, 3)) if needs.recent_queries else None
    return SlotFacts(
        mass=grouped.sum(dim=(2, 3)) if needs.mass else None,
        recent_attention=recent,
        key_norm=keys.norm(dim=-1) if needs.key_norm else None,
    )


@pytest.mark.parametrize("name", FROM_ATTENTION)
def test_prefill_keeps_what_the_policy_chooses_from_eager_attention(name: str) -> None:
    # The cache attends 5 queries at a time, so SnapKV's 4-query window spans two chunks.
    policy, budget = NEW[name](), 7
    inputs = prompts(batch=2, length=24, pad=(3, 0))
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    attentions, keys = eager_reference(ids, mask)
    cache = PolicyCache(MODEL, policy, budget=budget, query_chunk=5)
    with eviction_attention(MODEL):
        MODEL(ids, attention_mask=mask, cache=cache)
    positions = torch.arange(24).expand(2, 2, 24)
    valid = mask.bool()[:, None].expand(2, 2, 24)
    for layer, attn, layer_keys in zip(cache.layers, attentions, keys, strict=True):
        keep = policy.select(reference_facts(attn, layer_keys, policy.needs), positions, valid, budget)
        assert torch.equal(layer.positions, gather_kept(positions, keep))  # type: ignore[attr-defined]
        assert (layer.scores is None) == (not policy.needs.mass)  # type: ignore[attr-defined]  # kept only if ranked by


@pytest.mark.parametrize(
    ("name", "expected"),
    [("snapkv", {(False, 0), (False, 4)}), ("tova", {(False, 0), (False, 1)}), ("key_norm", {(False, 0)})],
)
def test_attention_computes_only_the_facts_the_policy_needs(name: str, expected: set, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # (want mass, last queries summed) per attention call: the last queries only on steps that evict.
    calls: set[tuple[bool, int]] = set()
    original = view_module.attend_slots

    def recording(*args: Any, **kwargs: Any) -> Any:
        calls.add((kwargs["want_scores"], kwargs["recent_queries"]))
        return original(*args, **kwargs)

    monkeypatch.setattr(view_module, "attend_slots", recording)
    ids = prompts(length=5)["input_ids"]
    cache = PolicyCache(MODEL, NEW[name](), budget=8)
    with eviction_attention(MODEL):
        for start in range(0, 15, 5):  # the first 5 tokens fit in 8 slots; the next chunks evict
            MODEL(ids.repeat(1, 3)[:, start : start + 5], cache=cache)
    assert calls == expected


# ---------------------------------------------------------------- a prefill policy and a decode policy


@dataclass
class Recording:
    """Delegates to ``inner`` and records the facts each eviction was handed."""

    inner: EvictionPolicy
    seen: list[SlotFacts] = field(default_factory=list)

    @property
    def needs(self) -> FactNeeds:
        return self.inner.needs

    @property
    def min_budget(self) -> int:
        return self.inner.min_budget

    def select(self, facts: SlotFacts, positions: torch.Tensor, valid: torch.Tensor, budget: int) -> torch.Tensor:
        self.seen.append(facts)
        return self.inner.select(facts, positions, valid, budget)


def test_the_prompt_is_evicted_by_the_prefill_policy_and_later_steps_by_the_decode_policy() -> None:
    ids = prompts(length=20)["input_ids"]
    attentions, _ = eager_reference(ids, torch.ones_like(ids))
    prefill, decode = Recording(SnapKV(window=4, kernel=3)), Recording(H2O(heavy=1.0, recent=2))
    cache = PolicyCache(MODEL, prefill, budget=8, decode_policy=decode)
    alone = PolicyCache(MODEL, SnapKV(window=4, kernel=3), budget=8)
    with eviction_attention(MODEL):
        MODEL(ids, cache=cache)
        MODEL(ids, cache=alone)
        assert len(prefill.seen) == 2 and not decode.seen  # one eviction per layer, by SnapKV
        for layer, solo, attn in zip(cache.layers, alone.layers, attentions, strict=True):
            assert torch.equal(layer.positions, solo.positions)  # type: ignore[attr-defined]
            # H2O will need the prompt's mass, so it was accumulated from the first query on.
            mass = reference_facts(attn, attn, FactNeeds(mass=True)).mass
            assert mass is not None
            expected = gather_kept(mass, torch.searchsorted(torch.arange(20), layer.positions))  # type: ignore[attr-defined]
            torch.testing.assert_close(layer.scores, expected, atol=1e-5, rtol=1e-5)  # type: ignore[attr-defined]
        MODEL(ids[:, :1], cache=cache)
    assert len(prefill.seen) == 2 and len(decode.seen) == 2
    assert all(f.mass is not None and f.recent_attention is None for f in decode.seen)


def test_a_budget_below_either_policy_is_refused() -> None:
    with pytest.raises(ValueError, match=r"keep at least 32 slots per KV head.*got a budget of 12"):
        PolicyCache(MODEL, "snapkv", budget=12, decode_policy=H2O(heavy=1.0, recent=2))
    with pytest.raises(TypeError, match="must be a policy name or an object with needs"):
        PolicyCache(MODEL, 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Unknown eviction policy 'snap'"):
        PolicyCache(MODEL, "snap")
