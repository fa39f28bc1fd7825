"""Eviction caches against independent references, with evictions happening.

- H2O: a reference that never removes anything. It runs on a DynamicCache under its own attention
  function, which masks evicted tokens per KV head, accumulates attention mass over absolute positions and
  evicts by plain Python loops (keep the `recent` newest live tokens plus the heaviest others).
- StreamingLLM: in a 1-layer model a token's K/V depend only on the token and its position, so the cache's
  output for token t equals a cache-free forward over [sinks, window, ..., t] numbered 0, 1, 2, ... as
  StreamingLLM numbers positions inside its cache. This only holds if sink keys are re-rotated correctly,
  and it is checked far past max_position_embeddings.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from hf_kvgov import HeavyHitterCache, SinkCache, eviction_attention
from tests.conftest import tiny_llama

REFERENCE_NAME = "kvgov_test_h2o_reference"


class ReferenceH2O:
    """H2O by masking: `alive[layer]` and `mass[layer]` are ``[batch, kv_heads, tokens so far]``."""

    def __init__(self, budget: int, recent: int) -> None:
        self.budget, self.recent = budget, recent
        self.alive: dict[int, torch.Tensor] = {}
        self.mass: dict[int, torch.Tensor] = {}

    def attention(self, module: Any, query, key, value, attention_mask, scaling=None, **kwargs):  # type: ignore[no-untyped-def]
        layer = module.layer_idx
        batch, q_heads, q_len, _ = query.shape
        kv_heads, total = key.shape[1], key.shape[2]
        group = q_heads // kv_heads
        if attention_mask is None:  # plain causal, no padding
            attention_mask = torch.ones(q_len, total, dtype=torch.bool).tril(total - q_len)[None, None]
        real_new = attention_mask[:, 0, torch.arange(q_len), torch.arange(total - q_len, total)]  # [b, q]
        old_alive = self.alive.get(layer, torch.zeros(batch, kv_heads, 0, dtype=torch.bool))
        alive = torch.cat((old_alive, real_new[:, None].expand(batch, kv_heads, q_len)), dim=-1)
        mask = attention_mask & alive.repeat_interleave(group, dim=1)[:, :, None, :]
        logits = query @ key.repeat_interleave(group, dim=1).transpose(-1, -2) * scaling
        probs = logits.masked_fill(~mask, float("-inf")).softmax(-1).nan_to_num(0.0)
        out = probs @ value.repeat_interleave(group, dim=1)
        mass = torch.nn.functional.pad(self.mass.get(layer, torch.zeros(batch, kv_heads, 0)), (0, q_len))
        mass = mass + probs.reshape(batch, kv_heads, group, q_len, total).sum(dim=(2, 3))
        self.alive[layer], self.mass[layer] = self._evict(alive, mass), mass
        return out.transpose(1, 2), None

    def _evict(self, alive: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
        alive = alive.clone()
        for row in range(alive.shape[0]):
            for head in range(alive.shape[1]):
                live = alive[row, head].nonzero().flatten().tolist()
                if len(live) <= self.budget:
                    continue
                older, recent = live[: len(live) - self.recent], live[len(live) - self.recent :]
                heavy = sorted(older, key=lambda t: -mass[row, head, t].item())[: self.budget - self.recent]
                alive[row, head] = False
                alive[row, head, recent + heavy] = True
        return alive


@pytest.fixture()
def reference_attention():  # type: ignore[no-untyped-def]
    """Yields a function that switches a model to a fresh reference and restores it afterwards."""
    switched: list[tuple[Any, str]] = []

    def use(model: Any, budget: int, recent: int) -> ReferenceH2O:
        reference = ReferenceH2O(budget, recent)
        AttentionInterface.register(REFERENCE_NAME, reference.attention)
        AttentionMaskInterface.register(REFERENCE_NAME, sdpa_mask)
        switched.append((model, model.config._attn_implementation))
        model.set_attn_implementation(REFERENCE_NAME)
        return reference

    yield use
    for model, previous in reversed(switched):
        model.set_attn_implementation(previous)


def generate(model, cache, inputs, **kwargs):  # type: ignore[no-untyped-def]
    return model.generate(
        **inputs, cache=cache, return_dict_in_generate=True, output_logits=True, do_sample=False, **kwargs
    )


def sharp_llama(seed: int = 0) -> LlamaForCausalLM:
    """The tiny Llama with 4x query/key weights: peaked attention, so KV heads disagree on heavy hitters."""
    model = tiny_llama(num_kv_heads=2, seed=seed)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
    return model


@pytest.mark.parametrize(("budget", "recent", "heads_differ"), [(8, 4, True), (6, 1, False), (10, 10, False)])
def test_h2o_matches_the_masking_reference(reference_attention, budget: int, recent: int, heads_differ: bool) -> None:  # type: ignore[no-untyped-def]
    model = sharp_llama()
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 96, (2, 14), generator=generator)
    mask = torch.ones_like(ids)
    ids[1, :5], mask[1, :5] = 0, 0  # row 1 is left-padded
    inputs = {"input_ids": ids, "attention_mask": mask}
    cache = HeavyHitterCache(model, budget=budget, recent=recent)
    with eviction_attention(model):
        got = generate(model, cache, inputs, max_new_tokens=16, min_new_tokens=16)
    reference = reference_attention(model, budget, recent)
    expected = generate(model, DynamicCache(), inputs, max_new_tokens=16, min_new_tokens=16)
    assert torch.equal(got.sequences, expected.sequences)
    for got_step, expected_step in zip(got.logits, expected.logits, strict=True):
        torch.testing.assert_close(got_step, expected_step, atol=1e-5, rtol=1e-5)
    # Every (layer, row, head) keeps exactly the reference's live tokens, never padding (row 1's position p
    # is absolute index p + 5). With heavy hitters, the sharp model's KV heads disagree on which to keep.
    kept = {}
    for index, layer in enumerate(cache.layers):
        for row, pad in enumerate((0, 5)):
            for head in range(2):
                alive = reference.alive[index][row, head].nonzero().flatten() - pad
                positions = layer.positions[row, head][layer.valid[row, head]]  # type: ignore[attr-defined]
                assert positions.tolist() == alive.tolist()
                kept[index, row, head] = positions.tolist()
    assert heads_differ == any(kept[layer, row, 0] != kept[layer, row, 1] for layer, row, _ in kept)


def test_h2o_chunked_prefill_matches_the_reference(reference_attention) -> None:  # type: ignore[no-untyped-def]
    model = sharp_llama(seed=4)
    ids = torch.randint(3, 96, (1, 40), generator=torch.Generator().manual_seed(5))
    cache = HeavyHitterCache(model, budget=12, recent=5, query_chunk=4)
    with eviction_attention(model):
        got = torch.cat([model(ids[:, s : s + 9], cache=cache).logits for s in range(0, 40, 9)], dim=1)
    reference_attention(model, 12, 5)
    dynamic = DynamicCache()
    expected = torch.cat([model(ids[:, s : s + 9], cache=dynamic).logits for s in range(0, 40, 9)], dim=1)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def one_layer_llama(max_positions: int = 64) -> LlamaForCausalLM:
    torch.manual_seed(11)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
    )
    return LlamaForCausalLM(config).eval()


def streaming_reference(model, ids: torch.Tensor, t: int, chunk_start: int, n_sink: int, window: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Logits for token ``t`` from a cache-free forward over what a sink cache shows it, numbered 0, 1, ..."""
    before = ids[0, :chunk_start].tolist()
    if len(before) > n_sink + window:
        before = before[:n_sink] + before[len(before) - window :]
    context = torch.tensor([before + ids[0, chunk_start : t + 1].tolist()])
    positions = torch.arange(context.shape[1])[None]
    return model(context, position_ids=positions).logits[0, -1]


@pytest.mark.parametrize("chunk", [1, 7])
def test_sink_matches_streaming_positions_far_past_max_positions(chunk: int) -> None:
    model = one_layer_llama(max_positions=64)
    ids = torch.randint(3, 96, (1, 500), generator=torch.Generator().manual_seed(6))
    cache = SinkCache(model, n_sink=4, window=12)
    with eviction_attention(model), torch.inference_mode():
        logits = torch.cat([model(ids[:, s : s + chunk], cache=cache).logits[0] for s in range(0, 500, chunk)])
        assert bool(torch.isfinite(logits).all())
        for t in (10, 40, 63, 64, 200, 499):
            expected = streaming_reference(model, ids, t, t - t % chunk, n_sink=4, window=12)
            torch.testing.assert_close(logits[t], expected, atol=1e-4, rtol=1e-4)
    assert cache.get_seq_length() == 500 and cache.stats().slots == 16


def test_sink_without_sinks_is_a_plain_window() -> None:
    model = one_layer_llama()
    ids = torch.randint(3, 96, (1, 90), generator=torch.Generator().manual_seed(8))
    cache = SinkCache(model, n_sink=0, window=10)
    with eviction_attention(model), torch.inference_mode():
        logits = torch.cat([model(ids[:, s : s + 1], cache=cache).logits[0] for s in range(90)])
        expected = streaming_reference(model, ids, 89, 89, n_sink=0, window=10)
    torch.testing.assert_close(logits[89], expected, atol=1e-4, rtol=1e-4)


def test_generation_streams_far_past_max_position_embeddings() -> None:
    model = one_layer_llama(max_positions=64)
    model.generation_config.pad_token_id = 0
    cache = SinkCache(model, n_sink=4, window=28)
    prompt = {"input_ids": torch.randint(3, 96, (1, 20), generator=torch.Generator().manual_seed(9))}
    with eviction_attention(model), torch.inference_mode():
        out = generate(model, cache, prompt, max_new_tokens=480, min_new_tokens=480)
    assert out.sequences.shape[1] == 500
    assert all(bool(torch.isfinite(step).all()) for step in out.logits)
    assert cache.get_seq_length() == 499 and cache.stats().slots == 32
