"""GPT-OSS's learned attention sinks through hf_kvgov's own attention: paged block tables read in place, eviction
slots, and the serving engine each give the tokens of transformers' own attention over `DynamicCache`.

The tiny GPT-OSS alternates sliding and full layers and has sinks from -1 to 3 per query head; without them (set to
-60) every one of these prompts gives other greedy tokens (`test_the_sinks_decide_these_tokens`), so equality says
the sinks were applied. These paths used to fail at their first attention call (`s_aux` was refused there).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import DynamicCache, Gemma2Config, Gemma2ForCausalLM

from hf_kvgov import HeavyHitter, HeavyHitterCache, PagedCache, eviction_attention, paged_attention
from hf_kvgov.serving import ServingEngine
from tests.conftest import tiny_gpt_oss
from tests.serving.test_engine import alone, alone_quantized, greedy

LENGTHS = (5, 17, 33, 2, 40)


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_gpt_oss()


@pytest.fixture(scope="module")
def prompts(model: Any) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, model.config.vocab_size, (n,), generator=generator).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def reference(model: Any, prompts: list[list[int]]) -> list[list[int]]:
    return [alone(model, p) for p in prompts]


def batch() -> dict[str, torch.Tensor]:
    """Two rows, the second left-padded by 7."""
    ids = torch.randint(3, 96, (2, 30), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    return {"input_ids": ids, "attention_mask": mask}


def run(model: Any, cache: Any) -> Any:
    return model.generate(
        **batch(), cache=cache, max_new_tokens=10, do_sample=False, output_scores=True, return_dict_in_generate=True
    )


def test_the_sinks_decide_these_tokens(prompts: list[list[int]], reference: list[list[int]]) -> None:
    without = tiny_gpt_oss()
    with torch.no_grad():
        for layer in without.model.layers:
            layer.self_attn.sinks.fill_(-60.0)
    assert all(alone(without, p) != r for p, r in zip(prompts, reference, strict=True))


@pytest.mark.parametrize(
    "build",
    [
        lambda m: PagedCache(m, attention="paged", block_size=4),
        lambda m: HeavyHitterCache(m, budget=64),  # a budget above every row's length: nothing is evicted
        lambda m: DynamicCache(config=m.config),  # no view: the given K/V, through the torch reference
    ],
    ids=["PagedCache(attention='paged')", "HeavyHitterCache, nothing evicted", "DynamicCache under kvgov"],
)
def test_hf_kvgov_attention_equals_transformers_own(model: Any, build: Any) -> None:
    expected = run(model, DynamicCache(config=model.config))
    with paged_attention(model):
        got = run(model, build(model))
    assert torch.equal(got.sequences, expected.sequences)
    for ours, theirs in zip(got.scores, expected.scores, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_an_evicting_cache_runs_with_sinks(model: Any) -> None:
    with eviction_attention(model):
        cache = HeavyHitterCache(model, budget=12)
        out = run(model, cache)
    assert out.sequences.shape == (2, 40)
    stats = cache.stats()
    assert stats.tokens_seen == 39 and stats.slots <= 12  # the last token is not yet stored; 12 kept at most


@pytest.mark.parametrize("max_batched_tokens", [512, 7])
def test_the_engine_answers_each_request_as_alone(
    model: Any, prompts: list[list[int]], reference: list[list[int]], max_batched_tokens: int
) -> None:
    with ServingEngine(model, block_size=4, max_batched_tokens=max_batched_tokens) as engine:
        assert engine.generate(prompts, greedy()) == reference


def test_the_engines_codes_answer_as_a_quantized_cache_alone(model: Any, prompts: list[list[int]]) -> None:
    """The engine reads sealed blocks with the sinks in its own attention; `QuantizedCache` hands their decoded K/V
    to transformers' attention, which adds the sinks itself: two implementations, the same tokens."""
    expected = [alone_quantized(model, p, 8) for p in prompts]
    with ServingEngine(model, block_size=4, codec="int8", prefix_sharing=False) as engine:
        assert engine.generate(prompts, greedy(20)) == expected


def test_the_engine_evicts_blocks_with_sinks(model: Any, prompts: list[list[int]]) -> None:
    with ServingEngine(model, block_size=4, policy=HeavyHitter(0.5), prefix_sharing=False) as engine:
        outputs = engine.generate(prompts, greedy())
        assert engine.pool.num_used == 0
    assert [len(o) for o in outputs] == [12] * len(prompts)


def test_the_kvgov_attention_over_another_caches_kv_soft_caps_too() -> None:
    """Without a view (another cache's K/V), soft-capped logits go through the same reference as the sinks; they
    used to be refused ("use eager attention"). A tiny Gemma-2, its logits capped at 5, left padding."""
    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, attn_logit_softcapping=5.0, sliding_window=8,
        attn_implementation="eager",
    )  # fmt: skip
    gemma2 = Gemma2ForCausalLM(config).eval()
    expected = run(gemma2, DynamicCache(config=gemma2.config))
    with paged_attention(gemma2):
        got = run(gemma2, DynamicCache(config=gemma2.config))
    assert torch.equal(got.sequences, expected.sequences)
    for ours, theirs in zip(got.scores, expected.scores, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
