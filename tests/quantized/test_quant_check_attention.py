"""Attention in the check's batches: sliding-window layers masked as the caches keep them."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from hf_kvgov.hf.paged_cache import PagedCache
from hf_kvgov.hf.quantized_cache import QuantizedCache
from hf_kvgov.quality.lockstep import StackedCache, score_in_lockstep
from tests.conftest import tiny_gemma3, tiny_mistral


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
