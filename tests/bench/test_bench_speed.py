"""`kvgov bench speed` on the tiny model: one row per (cache, context, batch), KV bytes checked by hand."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from hf_kvgov.bench.allocation import release
from hf_kvgov.bench.memory import ProcessPeakRss
from hf_kvgov.bench.prompts import prompt_ids, text_token_ids
from hf_kvgov.bench.speed import SpeedConfig, SpeedReport, generate_once, run_speed, speed_markdown
from hf_kvgov.registry import get_cache_spec
from tests.bench.conftest import BLOCK, BYTES_PER_BLOCK, BYTES_PER_TOKEN

NEW_TOKENS = 3
CONTEXTS = (20, 37)
BATCHES = (1, 2)
CACHES = ("paged", "int8", "h2o", "disk")


@pytest.fixture(scope="module")
def report(tiny: tuple[Any, Any]) -> SpeedReport:
    model, tokenizer = tiny
    config = SpeedConfig(CACHES, CONTEXTS, BATCHES, new_tokens=NEW_TOKENS, rounds=1)
    return run_speed(model, tokenizer, config, model_name="tiny", progress=False)


def _row(report: SpeedReport, cache: str, context: int, batch: int) -> Any:
    (row,) = [r for r in report.rows if (r.cache, r.context, r.batch) == (cache, context, batch)]
    return row


def test_one_row_per_cache_context_and_batch(report: SpeedReport) -> None:
    caches = ("dynamic", *CACHES)  # the baseline is added first
    assert report.config.caches == caches
    expected = [(b, c, name) for b in BATCHES for c in CONTEXTS for name in caches]
    assert [(r.batch, r.context, r.cache) for r in report.rows] == expected
    for row in report.rows:
        assert row.ttft_s > 0 and row.tpot_s > 0 and row.tokens_per_s > 0 and row.decode_tokens_per_s > 0
        assert row.peak_memory_bytes > 0 and row.memory_kind == "peak RSS"
        assert (row.new_tokens, row.rounds) == (NEW_TOKENS, 1)


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("context", CONTEXTS)
def test_kv_bytes_by_hand(report: SpeedReport, context: int, batch: int) -> None:
    stored = context + NEW_TOKENS - 1  # the last generated token is never fed back
    dynamic = _row(report, "dynamic", context, batch)
    paged = _row(report, "paged", context, batch)
    assert dynamic.kv_bytes == batch * stored * BYTES_PER_TOKEN
    assert paged.kv_bytes == batch * math.ceil(stored / BLOCK) * BYTES_PER_BLOCK
    assert paged.kv_bytes == {(20, 1): 16_384, (20, 2): 32_768, (37, 1): 24_576, (37, 2): 49_152}[(context, batch)]
    assert paged.kv_bytes_per_token == paged.kv_bytes / (batch * stored)
    assert paged.kv_bytes_vs_dynamic == paged.kv_bytes / dynamic.kv_bytes
    assert dynamic.kv_bytes_vs_dynamic == 1.0 and dynamic.tokens_per_s_vs_dynamic == 1.0
    assert paged.tokens_per_s_vs_dynamic == paged.tokens_per_s / dynamic.tokens_per_s


def test_int8_bytes_by_hand(report: SpeedReport) -> None:
    # 39 tokens: block 0 (the sink) and the tail stay fp32; block 1 is int8 codes, with fp16 scale and zero
    # per key channel and per value token: 2 x 16 x 16 codes + 16 x 2 x 2 + 16 x 2 x 2 = 640 B per layer and head.
    sealed = 2 * 2 * (2 * 16 * 16 + 16 * 2 * 2 + 16 * 2 * 2)
    assert _row(report, "int8", 37, 1).kv_bytes == 2 * BYTES_PER_BLOCK + sealed == 18_944
    assert _row(report, "int8", 20, 2).kv_bytes == 2 * 2 * BYTES_PER_BLOCK  # 22 tokens: sink + tail, none sealed


@pytest.mark.parametrize("name", CACHES)
def test_kv_bytes_are_what_the_cache_stats_report(tiny: tuple[Any, Any], report: SpeedReport, name: str) -> None:
    model, tokenizer = tiny
    ids = prompt_ids(text_token_ids(tokenizer), 2, 37)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    sample, cache = generate_once(model, get_cache_spec(name), inputs, NEW_TOKENS, ProcessPeakRss())
    try:
        assert sample.kv_bytes == cache.stats().bytes_used > 0
        assert _row(report, name, 37, 2).kv_bytes == sample.kv_bytes  # greedy: every run holds the same K/V
    finally:
        release(cache)


def test_markdown_has_a_line_per_row(report: SpeedReport) -> None:
    text = speed_markdown(report)
    table = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| ---")]
    assert len(table) == len(report.rows) + 1  # the header, then one line per row
    assert "| 2 | 37 | paged |" in text and "49,152" in text


def test_config_is_validated() -> None:
    assert SpeedConfig(("paged", "dynamic", "paged"), (8,), (1,)).caches == ("paged", "dynamic")
    with pytest.raises(ValueError, match="Unknown cache 'nope'"):
        SpeedConfig(("nope",), (8,), (1,))
    with pytest.raises(ValueError, match="new_tokens must be an int >= 2"):
        SpeedConfig(("paged",), (8,), (1,), new_tokens=1)
    with pytest.raises(ValueError, match="contexts must be a non-empty list of positive ints"):
        SpeedConfig(("paged",), (), (1,))
    with pytest.raises(ValueError, match="batches must be a non-empty list of positive ints; got \\[0\\]"):
        SpeedConfig(("paged",), (8,), (0,))
