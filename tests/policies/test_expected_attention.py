"""Expected Attention: the policy on hand-made scores, and the estimate against its definition worked out
with explicit rotation matrices."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel

from hf_kvgov import PolicyCache, eviction_attention
from hf_kvgov.engine.slots import view as view_module
from hf_kvgov.policies import ExpectedAttention, QueryForecast, SlotFacts, apply_rope, expected_attention, make_policy
from tests.conftest import tiny_llama
from tests.eviction.test_eviction_policies import Recording
from tests.eviction.test_eviction_sliding import tiny_gemma3

INV_FREQ = 1.0 / (10_000 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8))  # head_dim 8


def facts(scores: list[float]) -> SlotFacts:
    return SlotFacts(expected_attention=torch.tensor([[scores]], dtype=torch.float32))


def test_the_policy_keeps_its_sinks_its_recent_slots_and_the_best_expected_scores() -> None:
    scores = [0.0, 0.1, 0.9, 0.3, 0.8, 0.05, 0.7, 0.2]
    positions = torch.arange(8)[None, None]
    valid = torch.ones(1, 1, 8, dtype=torch.bool)
    # 1 sink (slot 0), 1 recent (slot 7), then the best scores 0.9 (slot 2) and 0.8 (slot 4).
    kept = ExpectedAttention(sinks=1, recent=1).select(facts(scores), positions, valid, 4)
    assert kept.tolist() == [[[0, 2, 4, 7]]]
    # No sinks, no window: the four best, 0.9, 0.8, 0.7, 0.3.
    assert ExpectedAttention(sinks=0, recent=0).select(facts(scores), positions, valid, 4).tolist() == [[[2, 3, 4, 6]]]


def test_sinks_are_the_oldest_valid_positions_and_invalid_slots_are_fillers() -> None:
    scores = [0.5, 0.0, 0.9, 0.3, 0.8]
    positions = torch.tensor([[[9, 3, 2, 5, 7]]])
    valid = torch.tensor([[[True, True, False, True, True]]])
    # Slot 2 (position 2) is padding: the oldest valid is slot 1 (position 3), kept though it scores 0;
    # then 0.8 (slot 4) and 0.5 (slot 0); in position order 3, 7, 9.
    assert ExpectedAttention(sinks=1, recent=0).select(facts(scores), positions, valid, 3).tolist() == [[[1, 4, 0]]]
    # Keeping 5 of 4 valid slots pads with the invalid one, first.
    assert ExpectedAttention(sinks=1, recent=0).select(facts(scores), positions, valid, 5).tolist() == [
        [[2, 1, 3, 4, 0]]
    ]


def test_bad_configurations_and_missing_facts_are_refused() -> None:
    with pytest.raises(ValueError, match=r"ExpectedAttention\.sinks must be at least 0"):
        ExpectedAttention(sinks=-1)
    with pytest.raises(TypeError, match=r"ExpectedAttention\.forecast must be a QueryForecast"):
        ExpectedAttention(forecast=512)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"QueryForecast\.horizon must be a positive int; got 0"):
        QueryForecast(horizon=0)
    with pytest.raises(ValueError, match=r"QueryForecast\.queries must be a positive int; got 0"):
        QueryForecast(queries=0)
    with pytest.raises(TypeError, match=r"QueryForecast\.covariance must be a bool"):
        QueryForecast(covariance=1)  # type: ignore[arg-type]
    positions, valid = torch.arange(6)[None, None], torch.ones(1, 1, 6, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"always keeps 4 sinks and 2 recent slots, so the budget must be at least 6"):
        ExpectedAttention(recent=2).select(facts([0.0] * 6), positions, valid, 5)
    assert ExpectedAttention().min_budget == 36  # 4 sinks and a 32-token window by default
    with pytest.raises(ValueError, match=r"ExpectedAttention ranks slots by expected_attention"):
        ExpectedAttention().select(SlotFacts(), positions, valid, 5)
    assert make_policy("expected_attention") == ExpectedAttention()


def rotation(position: float) -> torch.Tensor:
    """RoPE's rotation at ``position`` as an explicit [8, 8] matrix: column j is e_j turned by apply_rope."""
    basis = torch.eye(8, dtype=torch.float64)[None, None]  # [1, 1, 8 vectors, 8]
    return apply_rope(basis, torch.full((8,), position, dtype=torch.float64), INV_FREQ)[0, 0].T


def test_one_query_with_a_horizon_of_one_is_that_query_moved_to_the_next_position() -> None:
    generator = torch.Generator().manual_seed(0)
    unrotated = torch.randn(1, 1, 1, 8, generator=generator, dtype=torch.float64)
    keys = torch.randn(1, 1, 6, 8, generator=generator, dtype=torch.float64)
    query = apply_rope(unrotated, torch.tensor([11]), INV_FREQ)  # as attention sees it, at position 11
    forecast = QueryForecast(horizon=1, covariance=False, value_norm=False)
    got = expected_attention(
        forecast, INV_FREQ, query, torch.tensor([[11]]), torch.ones(1, 1, dtype=torch.bool),
        keys, keys, torch.ones(1, 1, 6, dtype=torch.bool), 0.5,
    )  # fmt: skip
    moved = apply_rope(unrotated, torch.tensor([12]), INV_FREQ)
    torch.testing.assert_close(got[0, 0], ((moved[0, 0] @ keys[0, 0].T) * 0.5).softmax(dim=-1)[0])


def test_the_estimate_matches_its_definition_with_explicit_matrices() -> None:
    # Two query heads share one KV head; 5 queries at positions 3..7, the second one padding.
    generator = torch.Generator().manual_seed(1)
    unrotated = torch.randn(1, 2, 5, 8, generator=generator, dtype=torch.float64)
    positions = torch.arange(3, 8)
    query = apply_rope(unrotated, positions, INV_FREQ)
    query_valid = torch.tensor([[True, False, True, True, True]])
    keys = torch.randn(1, 1, 7, 8, generator=generator, dtype=torch.float64)
    values = torch.randn(1, 1, 7, 8, generator=generator, dtype=torch.float64)
    valid = torch.tensor([[[True, True, True, False, True, True, True]]])
    scale, horizon = 8**-0.5, 4
    got = expected_attention(
        QueryForecast(horizon=horizon), INV_FREQ, query, positions[None], query_valid, keys, values, valid, scale
    )
    turn = torch.stack([rotation(7 + t) for t in range(1, horizon + 1)]).mean(dim=0)
    expected = torch.zeros(7, dtype=torch.float64)
    for head in range(2):
        seen = unrotated[0, head, [0, 2, 3, 4]]
        mean, covariance = seen.mean(dim=0), torch.cov(seen.T, correction=0)
        logits = scale * (turn @ mean) @ keys[0, 0].T
        logits += 0.5 * scale**2 * torch.einsum("sd,de,se->s", keys[0, 0], turn @ covariance @ turn.T, keys[0, 0])
        expected += logits.masked_fill(~valid[0, 0], float("-inf")).softmax(dim=-1)
    expected *= values[0, 0].norm(dim=-1)
    torch.testing.assert_close(got[0, 0].double(), expected, rtol=1e-5, atol=1e-7)
    assert got[0, 0, 3] == 0  # a slot future queries cannot read


def test_only_the_last_queries_make_the_statistics_when_asked() -> None:
    generator = torch.Generator().manual_seed(2)
    query = torch.randn(1, 1, 6, 8, generator=generator, dtype=torch.float64)
    keys = torch.randn(1, 1, 9, 8, generator=generator, dtype=torch.float64)
    positions, valid = torch.arange(6)[None], torch.ones(1, 6, dtype=torch.bool)
    slots = torch.ones(1, 1, 9, dtype=torch.bool)
    last_two = expected_attention(QueryForecast(queries=2), INV_FREQ, query, positions, valid, keys, keys, slots, 0.3)
    alone = expected_attention(
        QueryForecast(), INV_FREQ, query[:, :, 4:], positions[:, 4:], valid[:, 4:], keys, keys, slots, 0.3
    )
    torch.testing.assert_close(last_two, alone)


def test_a_budget_covering_everything_generates_what_dynamic_cache_generates() -> None:
    for model in (tiny_llama(), tiny_gemma3()):
        prompt = {"input_ids": torch.randint(3, 96, (2, 30), generator=torch.Generator().manual_seed(3))}
        kwargs = {"max_new_tokens": 6, "do_sample": False, "return_dict_in_generate": True, "output_logits": True}
        expected = model.generate(**prompt, cache=DynamicCache(config=model.config), **kwargs)
        with eviction_attention(model):
            got = model.generate(**prompt, cache=PolicyCache(model, ExpectedAttention(), budget=64), **kwargs)
        assert torch.equal(got.sequences, expected.sequences)
        for got_step, expected_step in zip(got.logits, expected.logits, strict=True):
            torch.testing.assert_close(got_step, expected_step, atol=1e-5, rtol=1e-5)


def test_the_cache_hands_the_policy_the_estimate_of_the_queries_attention_saw(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    model = tiny_llama()
    seen_queries: list[torch.Tensor] = []
    original = view_module.EvictionView.attend

    def recording(self, query, mask, scale, softcap):  # type: ignore[no-untyped-def]
        seen_queries.append(query.clone())
        return original(self, query, mask, scale, softcap)

    monkeypatch.setattr(view_module.EvictionView, "attend", recording)
    policy = Recording(ExpectedAttention(sinks=1, recent=2))
    ids = torch.randint(3, 96, (2, 24), generator=torch.Generator().manual_seed(5))
    cache = PolicyCache(model, policy, budget=7, query_chunk=5)
    with eviction_attention(model), torch.inference_mode():
        model(ids, cache=cache)
    reference = DynamicCache()
    with torch.inference_mode():
        model(ids, cache=reference)
    positions = torch.arange(24)
    every = torch.ones(2, 2, 24, dtype=torch.bool)
    for layer, query, facts in zip(reference.layers, seen_queries, policy.seen, strict=True):
        estimate = expected_attention(
            QueryForecast(), model.model.rotary_emb.inv_freq, query, positions.expand(2, 24),
            torch.ones(2, 24, dtype=torch.bool), layer.keys, layer.values, every, 16**-0.5,
        )  # fmt: skip
        assert facts.expected_attention is not None
        torch.testing.assert_close(facts.expected_attention, estimate, atol=1e-6, rtol=1e-5)


def test_an_evicting_cache_keeps_what_the_policy_chose_from_the_estimate() -> None:
    model = tiny_llama()
    cache = PolicyCache(model, ExpectedAttention(sinks=2, recent=2), budget=10)
    with eviction_attention(model), torch.inference_mode():
        model(torch.randint(3, 96, (1, 30), generator=torch.Generator().manual_seed(4)), cache=cache)
    for layer in cache.layers:
        kept = sorted(layer.positions[0, 0].tolist())  # type: ignore[attr-defined]
        assert len(kept) == 10 and kept[:2] == [0, 1] and kept[-2:] == [28, 29]


def test_a_model_without_rope_is_refused_on_construction() -> None:
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=32, n_layer=1, n_head=2, n_positions=64))
    with pytest.raises(ValueError, match=r"PolicyCache turns queries to the positions to come with the model's rotary"):
        PolicyCache(gpt2, ExpectedAttention(), budget=40)
    PolicyCache(gpt2, "tova", budget=8)  # a policy that needs no RoPE is served
