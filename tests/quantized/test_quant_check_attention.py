"""Attention in the check's batches: sliding-window layers masked as the caches keep them, and on a CPU
grouped-query K/V heads read in place, which gives what transformers' sdpa gives."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

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


def test_rows_that_keep_different_tokens_are_refused() -> None:
    model = tiny_gemma3(window=16)
    rows = [PagedCache(model, block_size=8), QuantizedCache(model, block_size=8, full_precision_layers=(1,))]
    ids = torch.randint(3, 96, (2, 40), generator=torch.Generator().manual_seed(2))
    stacked = StackedCache(rows, num_layers=3)
    with torch.inference_mode(), pytest.raises(ValueError, match="they keep different tokens"):
        for start in range(0, 40, 8):
            model(input_ids=ids[:, start : start + 8], cache=stacked, use_cache=True)


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
