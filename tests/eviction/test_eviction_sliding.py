"""Models with sliding-window layers (Gemma-3 mixes them with full layers; Mistral has them everywhere).

A window layer's query at position q reads keys at positions > q - window. With a budget at least the
sequence, an eviction cache must equal `DynamicCache` (whose sliding layers keep window - 1 tokens), and a
window layer must never hold more than window - 1 slots nor any slot the next query cannot see.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig, MistralConfig, MistralForCausalLM

from hf_kvgov import HeavyHitterCache, SinkCache, eviction_attention
from tests.eviction.test_eviction_equivalence import prompts, run

WINDOW = 8


def tiny_gemma3(
    layer_types: tuple[str, ...] = ("sliding_attention", "full_attention", "sliding_attention"),
) -> Gemma3ForCausalLM:
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=len(layer_types),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=WINDOW,
        layer_types=list(layer_types),
        max_position_embeddings=256,
    )
    return Gemma3ForCausalLM(config).eval()


def tiny_mistral() -> MistralForCausalLM:
    torch.manual_seed(1)
    config = MistralConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=WINDOW,
        max_position_embeddings=256,
    )
    return MistralForCausalLM(config).eval()


MODELS = {"gemma3": tiny_gemma3(), "mistral": tiny_mistral()}
LARGE = {
    "h2o": lambda model: HeavyHitterCache(model, budget=64, recent=8),
    "sink": lambda model: SinkCache(model, n_sink=4, window=60),
}


def assert_same_as_dynamic(model, cache, inputs, **kwargs) -> None:  # type: ignore[no-untyped-def]
    expected = run(model, DynamicCache(config=model.config), inputs, **kwargs)
    with eviction_attention(model):
        got = run(model, cache, inputs, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    for got_step, expected_step in zip(got.scores, expected.scores, strict=True):
        torch.testing.assert_close(got_step, expected_step, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", sorted(LARGE))
@pytest.mark.parametrize("arch", sorted(MODELS))
def test_prompt_longer_than_the_window_equals_dynamic_cache(arch: str, kind: str) -> None:
    model = MODELS[arch]
    cache = LARGE[kind](model)
    assert_same_as_dynamic(model, cache, prompts(length=3 * WINDOW + 5), max_new_tokens=2 * WINDOW)
    for layer in cache.layers:
        if layer.window is not None:  # type: ignore[attr-defined]
            assert layer.slots <= WINDOW - 1  # type: ignore[attr-defined]
        else:
            assert layer.slots == 3 * WINDOW + 5 + 2 * WINDOW - 1  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", sorted(LARGE))
def test_left_padded_batch_equals_dynamic_cache(kind: str) -> None:
    model = MODELS["gemma3"]
    assert_same_as_dynamic(model, LARGE[kind](model), prompts(batch=3, length=2 * WINDOW, pad=(5, 0, 11)))


def test_chunked_feeding_equals_one_forward() -> None:
    model = MODELS["gemma3"]
    ids = prompts(length=30)["input_ids"]
    expected = model(ids, cache=DynamicCache(config=model.config)).logits
    cache = HeavyHitterCache(model, budget=64)
    with eviction_attention(model):
        got = torch.cat([model(ids[:, s : s + 3], cache=cache).logits for s in range(0, 30, 3)], dim=1)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("budget", [3, 6, 20])
def test_window_layers_keep_only_what_the_next_query_can_read(budget: int) -> None:
    # Small budgets evict inside the window too; whatever is kept must be visible to the next query.
    model = MODELS["gemma3"]
    cache = HeavyHitterCache(model, budget=budget, recent=2)
    ids = prompts(length=40)["input_ids"]
    with eviction_attention(model):
        for start in range(0, 40, 5):
            model(ids[:, start : start + 5], cache=cache)
            next_position = start + 5
            for layer in cache.layers:
                kept = layer.positions[layer.valid]  # type: ignore[attr-defined]
                limit = min(budget, WINDOW - 1) if layer.window is not None else budget  # type: ignore[attr-defined]
                assert layer.slots <= limit  # type: ignore[attr-defined]
                if layer.window is not None:  # type: ignore[attr-defined]
                    assert bool((kept > next_position - WINDOW).all()), kept


def test_sink_keys_move_only_in_full_attention_layers() -> None:
    # Gemma-3 keeps one RoPE per layer type; the sinks are re-rotated with the full-attention frequencies (a
    # sliding layer's keys are never turned: the view reads them as stored).
    model = MODELS["gemma3"]
    cache = SinkCache(model, n_sink=2, window=10)
    rotary = model.model.rotary_emb
    expected = rotary.full_attention_inv_freq
    assert not torch.equal(expected, rotary.sliding_attention_inv_freq)
    for rope, layer_type in zip(cache.sink_keys.ropes, model.config.layer_types, strict=True):
        assert torch.equal(rope.inv_freq, getattr(rotary, f"{layer_type}_inv_freq"))
        assert not rope.interleaved
