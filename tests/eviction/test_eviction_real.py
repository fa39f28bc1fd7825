"""Eviction caches on SmolLM2-135M: lossless when nothing is evicted, and perplexity at a 20% budget.

Quality numbers measured on this test's passage (Pride and Prejudice from character 20,000; 1,024
tokens fed 64 at a time with the cache in the loop; perplexity of the 768 tokens predicted after the first
eviction; float32 on CPU):

    full cache (DynamicCache)          22.06
    HeavyHitterCache, 204 slots        22.25   (+0.8%)
    SinkCache 4 + 200, 204 slots       22.85   (+3.6%)
    recent window only, 204 slots      45.10   (+104%)

A second passage (character 150,000) gave +2.3% for H2O, +5.8% for sinks and +108% for the window alone.
The thresholds below leave room over the measured losses for other BLAS builds (H2O <= 3%, sinks <= 6%)
and require both to beat the window-only baseline by a wide margin, which held on both passages.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

from hf_kvgov import HeavyHitterCache, Recall, SinkCache, eviction_attention

pytestmark = pytest.mark.real_model

TOKENS = 1024
CHUNK = 64
BUDGET = TOKENS // 5  # 204 slots per (sequence, KV head): 20% of the stream
FIRST_EVICTED = (BUDGET // CHUNK + 1) * CHUNK  # 256: the first chunk that reads an already-evicted cache


@pytest.fixture(scope="module")
def passage(smollm2, austen_text) -> torch.Tensor:  # type: ignore[no-untyped-def]
    _, tokenizer = smollm2
    ids = tokenizer(austen_text[20000:32000], return_tensors="pt")["input_ids"][:, :TOKENS]
    assert ids.shape[1] == TOKENS
    return ids


def stream_nll(model, cache, ids: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Float ``[TOKENS - 1]``: entry ``i`` is the loss of token ``i + 1`` predicted at position ``i``."""
    logits = []
    with torch.inference_mode():
        for start in range(0, ids.shape[1], CHUNK):
            logits.append(model(ids[:, start : start + CHUNK], cache=cache).logits[0].float())
    return torch.nn.functional.cross_entropy(torch.cat(logits)[:-1], ids[0, 1:], reduction="none")


def perplexity_after_eviction(nll: torch.Tensor) -> float:
    return math.exp(nll[FIRST_EVICTED:].mean().item())


def test_h2o_and_sinks_at_20_percent_stay_close_to_the_full_cache(smollm2, passage) -> None:  # type: ignore[no-untyped-def]
    model, _ = smollm2
    full = perplexity_after_eviction(stream_nll(model, DynamicCache(config=model.config), passage))
    caches = {
        "h2o": HeavyHitterCache(model, budget=BUDGET),
        "sink": SinkCache(model, n_sink=4, window=BUDGET - 4),
        "recent": SinkCache(model, n_sink=0, window=BUDGET),
    }
    with eviction_attention(model):
        ppl = {name: perplexity_after_eviction(stream_nll(model, cache, passage)) for name, cache in caches.items()}
    for cache in caches.values():
        assert cache.stats().slots == BUDGET and cache.get_seq_length() == TOKENS
    loss = {name: value / full - 1 for name, value in ppl.items()}
    assert loss["h2o"] <= 0.03, f"H2O perplexity {ppl['h2o']:.2f} vs full {full:.2f}"
    assert loss["sink"] <= 0.06, f"sink perplexity {ppl['sink']:.2f} vs full {full:.2f}"
    assert loss["recent"] >= 0.5, f"window-only perplexity {ppl['recent']:.2f} vs full {full:.2f}"
    assert ppl["h2o"] * 1.3 < ppl["recent"] and ppl["sink"] * 1.3 < ppl["recent"]


@pytest.fixture(scope="module")
def prompt(smollm2, austen_text):  # type: ignore[no-untyped-def]
    _, tokenizer = smollm2
    return tokenizer(austen_text[40000:40600], return_tensors="pt")


@pytest.mark.parametrize(
    "make",
    [lambda m: HeavyHitterCache(m, budget=1024), lambda m: SinkCache(m, n_sink=4, window=1020)],
    ids=["h2o", "sink"],
)
def test_greedy_32_tokens_equal_dynamic_cache_when_the_budget_covers_everything(smollm2, prompt, make) -> None:  # type: ignore[no-untyped-def]
    model, _ = smollm2
    kwargs = {"max_new_tokens": 32, "do_sample": False, "return_dict_in_generate": True, "output_logits": True}
    expected = model.generate(**prompt, cache=DynamicCache(config=model.config), **kwargs)
    cache = make(model)
    with eviction_attention(model):
        got = model.generate(**prompt, cache=cache, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    worst = max((g - e).abs().max().item() for g, e in zip(got.logits, expected.logits, strict=True))
    assert worst <= 1e-3, f"logits differ by {worst}"
    assert cache.stats().slots == prompt["input_ids"].shape[1] + 31


GEMMA_KWARGS = {"max_new_tokens": 12, "do_sample": False, "return_dict_in_generate": True, "output_logits": True}


@pytest.fixture(scope="module")
def gemma3_run(gemma3, austen_text):  # type: ignore[no-untyped-def]
    """A prompt longer than Gemma-3's 512-token window, and DynamicCache's greedy output for it."""
    model, tokenizer = gemma3
    prompt = tokenizer(austen_text[60000:64000], return_tensors="pt")
    prompt = {k: v[:, :560] for k, v in prompt.items()}
    return prompt, model.generate(**prompt, cache=DynamicCache(config=model.config), **GEMMA_KWARGS)


@pytest.mark.parametrize(
    "make",
    [lambda m: HeavyHitterCache(m, budget=2048), lambda m: SinkCache(m, n_sink=4, window=2044)],
    ids=["h2o", "sink"],
)
def test_gemma3_sliding_layers_equal_dynamic_cache_past_the_window(gemma3, gemma3_run, make) -> None:  # type: ignore[no-untyped-def]
    # 5 of every 6 Gemma-3 layers see only the last 512 tokens; the prompt is longer than that, so the
    # window must be applied to the kept slots exactly as DynamicCache's sliding layers apply it.
    model, _ = gemma3
    prompt, expected = gemma3_run
    window = model.config.get_text_config().sliding_window
    assert prompt["input_ids"].shape[1] == 560 > window
    cache = make(model)
    with eviction_attention(model):
        got = model.generate(**prompt, cache=cache, **GEMMA_KWARGS)
    assert torch.equal(got.sequences, expected.sequences)
    worst = max((g - e).abs().max().item() for g, e in zip(got.logits, expected.logits, strict=True))
    assert worst <= 1e-3, f"logits differ by {worst}"
    window_slots = {layer.slots for layer in cache.layers if layer.window is not None}
    assert window_slots == {window - 1}


def test_recalling_evicted_pages_halves_what_h2o_alone_loses(smollm2, passage) -> None:  # type: ignore[no-untyped-def]
    """H2O at 10% (102 slots), alone and with its evicted tokens recalled (4 pages of 16 per step).

    Measured on this passage (``-s`` prints the figures): full 22.06; H2O alone +4.29% holding 4.8 MB; with
    recall +1.11% holding 7.1 MB (a pending page and a mean key per written page per layer and KV head, and
    one layer's recalled pages in the shared buffer). H2O with 204 slots loses +0.8% (the first test above);
    at equal memory recall pays with more pages (eval/RESULTS.md: streaming with the shared buffer) and where
    an evicted token is asked for again (passkey). The thresholds leave room for other BLAS builds.
    """
    model, _ = smollm2
    full = perplexity_after_eviction(stream_nll(model, DynamicCache(config=model.config), passage))
    kept = BUDGET // 2
    with eviction_attention(model):
        only = HeavyHitterCache(model, budget=kept)
        alone = perplexity_after_eviction(stream_nll(model, only, passage))
        cache = HeavyHitterCache(model, budget=kept, recall=Recall(pages=4, page_tokens=16))
        recalled = perplexity_after_eviction(stream_nll(model, cache, passage))
    stats = cache.recall_stats()
    assert stats is not None and stats.write_amplification == 1.0 and stats.max_pages_read_per_step <= 4 * 3
    loss_alone, loss_recalled = alone / full - 1, recalled / full - 1
    report = (
        f"full {full:.2f}; H2O {kept} alone {alone:.2f} ({100 * loss_alone:+.2f}%, {only.stats().bytes_used:,} B); "
        f"with recall {recalled:.2f} ({100 * loss_recalled:+.2f}%, {cache.stats().bytes_used:,} B)"
    )
    print(report)
    assert loss_recalled <= 0.6 * loss_alone and loss_recalled <= 0.03, report
    cache.release()
