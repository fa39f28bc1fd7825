"""Attention in the check's batches: sliding-window layers masked as the caches keep them, and on a CPU
grouped-query K/V heads read in place, which gives what transformers' sdpa gives."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from transformers import DynamicCache

from hf_kvgov.hf.paged_cache import PagedCache
from hf_kvgov.hf.quantized_cache import QuantizedCache
from hf_kvgov.quality.grouped_attention import ATTENTION_NAME, grouped_sdpa_on_cpu
from hf_kvgov.quality.lockstep import StackedCache, score_in_lockstep
from tests.conftest import tiny_gemma3, tiny_llama, tiny_mistral


@pytest.mark.parametrize("build", [tiny_gemma3, tiny_mistral])
def test_a_batch_runs_past_the_window_of_a_sliding_window_model(build: Any) -> None:
    # A sliding layer returns only the tokens it keeps: the batch's mask must know that the layer slides.
    model = build(window=16)
    ids = torch.randint(3, 96, (1, 97), generator=torch.Generator().manual_seed(1))
    candidates = {"int8": functools.partial(QuantizedCache, model, bits=8, block_size=8)}
    scores = score_in_lockstep(model, ids, candidates, chunk_tokens=8, block_size=8).scores
    assert scores["int8"].tokens == 96 and scores["int8"].kl_mean < 1e-3


class _DropsFirstToken(DynamicCache):
    """Returns all but its first token: a cache that keeps other tokens than the rest in a full-attention layer."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):  # type: ignore[no-untyped-def]
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        return keys[:, :, 1:], values[:, :, 1:]


def test_rows_that_keep_different_tokens_in_a_full_attention_layer_are_refused() -> None:
    # Sliding-window layers may differ in the history they keep (tests/quantized/test_stacked_sliding.py); a
    # full-attention layer must return the same tokens in every row.
    model = tiny_llama()
    stacked = StackedCache([PagedCache(model, block_size=8), _DropsFirstToken()], num_layers=2)
    ids = torch.randint(3, 96, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode(), pytest.raises(ValueError, match="full-attention layer 0: they keep different"):
        model(input_ids=ids, cache=stacked, use_cache=True)


@pytest.mark.parametrize("kv_heads", [2, 4])  # grouped (2 query heads per K/V head), and plain multi-head
def test_grouped_sdpa_gives_what_transformers_sdpa_gives(kv_heads: int) -> None:
    model = tiny_llama(num_kv_heads=kv_heads, num_heads=4)
    ids = torch.randint(3, 96, (1, 57), generator=torch.Generator().manual_seed(3))
    candidates = {"int4": functools.partial(QuantizedCache, model, bits=4, block_size=8)}
    stock = score_in_lockstep(model, ids, candidates, chunk_tokens=8, block_size=8).scores["int4"]
    with grouped_sdpa_on_cpu(model):
        assert model.config._attn_implementation == ATTENTION_NAME
        grouped = score_in_lockstep(model, ids, candidates, chunk_tokens=8, block_size=8).scores["int4"]
    assert model.config._attn_implementation == "sdpa"
    assert grouped.perplexity == pytest.approx(stock.perplexity, rel=1e-6)
    assert grouped.kl_mean == pytest.approx(stock.kl_mean, rel=1e-4, abs=1e-9)
    assert grouped.top1_agreement == stock.top1_agreement


def test_a_model_not_on_sdpa_keeps_its_attention() -> None:
    model = tiny_llama()
    model.set_attn_implementation("eager")
    with grouped_sdpa_on_cpu(model):
        assert model.config._attn_implementation == "eager"
