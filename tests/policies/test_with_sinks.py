"""`WithSinks`: attention sinks added to any policy, on hand-made facts and through `PolicyCache`."""

from __future__ import annotations

import pytest
import torch

from hf_kvgov import PolicyCache, eviction_attention
from hf_kvgov.policies import H2O, TOVA, SlotFacts, SnapKV, WithSinks
from tests.conftest import tiny_llama
from tests.eviction.test_eviction_equivalence import prompts
from tests.eviction.test_eviction_policies import assert_same_tokens


def attention(values: list[float]) -> SlotFacts:
    return SlotFacts(recent_attention=torch.tensor([[values]]))


def test_the_first_tokens_are_kept_and_the_inner_policy_chooses_the_rest() -> None:
    scores = [0.0, 0.0, 0.9, 0.1, 0.8, 0.2, 0.3, 0.05]
    positions, valid = torch.arange(8)[None, None], torch.ones(1, 1, 8, dtype=torch.bool)
    # Sinks: slots 0 and 1 (attention 0); TOVA then keeps the two best of the rest, 0.9 and 0.8.
    assert WithSinks(2, TOVA()).select(attention(scores), positions, valid, 4).tolist() == [[[0, 1, 2, 4]]]
    # TOVA alone would keep 0.9, 0.8, 0.3, 0.2.
    assert TOVA().select(attention(scores), positions, valid, 4).tolist() == [[[2, 4, 5, 6]]]


def test_sinks_are_the_first_real_tokens_and_a_short_row_is_padded() -> None:
    positions = torch.tensor([[[0, 1, 2, 3, 4], [0, 1, 2, 3, 4]]])
    valid = torch.tensor([[[False, False, True, True, True], [True, True, True, True, True]]])
    facts = SlotFacts(recent_attention=torch.tensor([[[0.9, 0.9, 0.0, 0.5, 0.1], [0.0, 0.7, 0.6, 0.1, 0.2]]]))
    kept = WithSinks(1, TOVA()).select(facts, positions, valid, 4)
    # Row/head 0: three valid slots, all kept after one filler (the lowest invalid slot index first).
    # Head 1: sink slot 0, then TOVA's best three of the rest (0.7, 0.6, 0.2).
    assert kept.tolist() == [[[0, 2, 3, 4], [0, 1, 2, 4]]]


def test_it_reads_what_the_inner_policy_reads_and_refuses_budgets_below_both() -> None:
    policy = WithSinks(4, SnapKV())
    assert policy.needs == SnapKV().needs and policy.min_budget == 36
    positions, valid = torch.arange(40)[None, None], torch.ones(1, 1, 40, dtype=torch.bool)
    with pytest.raises(
        ValueError, match=r"always keeps 4 sinks and what SnapKV\(.*\) keeps, so the budget must be at least 36"
    ):
        policy.select(attention([0.0] * 40), positions, valid, 35)
    with pytest.raises(TypeError, match=r"WithSinks\.inner must be an eviction policy"):
        WithSinks(4, "snapkv")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"WithSinks\.n_sink must be at least 0"):
        WithSinks(-1, TOVA())


def test_sinks_with_snapkv_at_prefill_and_h2o_during_decode_is_configuration() -> None:
    model = tiny_llama()
    prefill = WithSinks(2, SnapKV(window=2, kernel=1))
    decode = WithSinks(2, H2O(heavy=1.0, recent=2))
    cache = PolicyCache(model, prefill, budget=8, decode_policy=decode)
    ids = torch.randint(3, 96, (1, 30), generator=torch.Generator().manual_seed(0))
    with eviction_attention(model):
        out = model.generate(input_ids=ids, cache=cache, max_new_tokens=6, do_sample=False)
    assert out.shape == (1, 36)
    for layer in cache.layers:
        kept = sorted(layer.positions[0, 0].tolist())  # type: ignore[attr-defined]
        assert len(kept) == 8 and kept[:2] == [0, 1] and kept[-2:] == [33, 34]  # the newest token, 35, is not fed back
    # Covering everything, the combination is lossless.
    make = lambda m: PolicyCache(m, prefill, budget=64, decode_policy=decode)  # noqa: E731
    assert_same_tokens(model, make, prompts(batch=2, length=9, pad=(3, 0)))
