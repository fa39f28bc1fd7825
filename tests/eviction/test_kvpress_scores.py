"""At kvpress's settings, the eviction caches keep what kvpress's presses keep, on a real (tiny) model.

The references below are the scores of NVIDIA kvpress 0.5.5 written out from its presses' definitions (kvpress is
not a dependency): SnapKVPress averages the softmax attention of the last ``window`` queries over the keys before
the window, pools it with ``avg_pool1d`` of width ``kernel`` (zero-padded), averages the query heads of each KV
group and always keeps the window; ObservedAttentionPress sums every query's attention to a key, divides by the
number of queries that could read it and averages the query heads of each group. Both keep the top scores per KV
head. The attention comes from the model's own eager forward; the caches run on their eviction attention. On the
compress-then-continue protocol the two libraries then give identical perplexities (`eval/RESULTS.md`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional

from hf_kvgov import PolicyCache, eviction_attention
from hf_kvgov.policies import MeanMass, SnapKV
from tests.conftest import tiny_llama

LENGTH, BUDGET, WINDOW, KERNEL = 40, 14, 6, 5


def peaked_model() -> Any:
    """The tiny Llama with queries scaled 6x: attention as peaked as a trained model's, so that the rules differ
    (near-uniform random attention ranks old tokens first under every rule)."""
    model = tiny_llama(num_kv_heads=2, num_heads=4)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(6)
    return model


def prompt_attention(model: Any, ids: torch.Tensor) -> list[torch.Tensor]:
    """Float ``[heads, LENGTH, LENGTH]`` per layer: the prompt's causal attention (eager, no cache)."""
    model.set_attn_implementation("eager")
    with torch.inference_mode():
        out = model(input_ids=ids, output_attentions=True, use_cache=False)
    return [a[0].float() for a in out.attentions]


def per_group(scores: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[heads, n]`` -> ``[kv_heads, n]``: the mean over each KV group's query heads (kvpress's GQA rule)."""
    return scores.reshape(kv_heads, -1, scores.shape[-1]).mean(1)


def snapkv_press_keeps(attention: torch.Tensor, kv_heads: int) -> list[list[int]]:
    window = attention[:, -WINDOW:, :-WINDOW].mean(1)  # [heads, LENGTH - WINDOW]
    pooled = functional.avg_pool1d(window[:, None], KERNEL, stride=1, padding=KERNEL // 2)[:, 0]
    scores = per_group(pooled, kv_heads)
    scores = functional.pad(scores, (0, WINDOW), value=float(scores.max()) + 1)
    return [sorted(row.topk(BUDGET).indices.tolist()) for row in scores]


def observed_attention_press_keeps(attention: torch.Tensor, kv_heads: int) -> list[list[int]]:
    readers = torch.arange(LENGTH, 0, -1, dtype=attention.dtype)
    scores = per_group(attention.sum(1) / readers, kv_heads)
    return [sorted(row.topk(BUDGET).indices.tolist()) for row in scores]


def cache_keeps(model: Any, policy: Any, ids: torch.Tensor) -> list[list[list[int]]]:
    """Kept positions per layer and KV head after a compressing prefill of ``ids``."""
    cache = PolicyCache(model, policy, budget=BUDGET, compress="prefill")
    with eviction_attention(model), torch.inference_mode():
        model(input_ids=ids, cache=cache)
    return [
        [sorted(p[v].tolist()) for p, v in zip(layer.positions[0], layer.valid[0], strict=True)]
        for layer in cache.layers
    ]


def test_snapkv_at_kvpress_settings_keeps_what_snapkv_press_keeps() -> None:
    model = peaked_model()
    ids = torch.randint(3, model.config.vocab_size, (1, LENGTH), generator=torch.Generator().manual_seed(5))
    expected = [snapkv_press_keeps(a, 2) for a in prompt_attention(model, ids)]
    kept = cache_keeps(model, SnapKV(window=WINDOW, kernel=KERNEL, pooling="avg"), ids)
    assert kept == expected
    # The default (max pooling over 7) is another rule: on this prompt it keeps other slots.
    assert cache_keeps(model, SnapKV(window=WINDOW), ids) != expected


def test_mean_mass_keeps_what_observed_attention_press_keeps() -> None:
    model = peaked_model()
    ids = torch.randint(3, model.config.vocab_size, (1, LENGTH), generator=torch.Generator().manual_seed(6))
    attention = prompt_attention(model, ids)
    expected = [observed_attention_press_keeps(a, 2) for a in attention]
    assert cache_keeps(model, MeanMass(), ids) == expected
    # H2O's sum, without the division by readers, keeps other slots on this prompt.
    summed = [[sorted(row.topk(BUDGET).indices.tolist()) for row in per_group(a.sum(1), 2)] for a in attention]
    assert summed != expected
