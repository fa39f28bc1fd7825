"""What a fractional budget is a fraction of (``budget_of=`` or generate's prompt), and ``compress="prefill"``."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_kvgov import HeavyHitterCache, PolicyCache, SinkCache, eviction_attention
from hf_kvgov.policies import SnapKV
from tests.conftest import tiny_llama
from tests.eviction.test_eviction_sliding import tiny_mistral

MODEL = tiny_llama(num_kv_heads=2)


def ids(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 96, (1, length), generator=torch.Generator().manual_seed(seed))


def feed(cache: object, tokens: torch.Tensor, chunk: int, start: int = 0, model: object = MODEL) -> torch.Tensor:
    """Logits ``[1, n, vocab]`` of ``tokens`` fed ``chunk`` at a time with explicit positions from ``start``."""
    out = []
    with torch.inference_mode():
        for i in range(0, tokens.shape[1], chunk):
            piece = tokens[:, i : i + chunk]
            positions = torch.arange(start + i, start + i + piece.shape[1])[None]
            out.append(model(piece, cache=cache, position_ids=positions).logits)  # type: ignore[operator]
    return torch.cat(out, dim=1)


def generate(cache: object, prompt: torch.Tensor, **kwargs: object) -> torch.Tensor:
    with eviction_attention(MODEL), torch.inference_mode():
        return MODEL.generate(input_ids=prompt, cache=cache, do_sample=False, **kwargs)  # type: ignore[arg-type]


def test_a_declared_length_fixes_the_budget_on_construction_and_a_chunked_stream_keeps_it() -> None:
    cache = HeavyHitterCache(MODEL, budget=0.25, budget_of=40)
    assert cache.stats().budget == 10  # known before any token, unlike a fraction of the prompt
    with eviction_attention(MODEL):
        feed(cache, ids(40), chunk=8)
    assert cache.stats().budget == 10 and [layer.slots for layer in cache.layers] == [10, 10]  # type: ignore[attr-defined]
    cache.reset()
    assert cache.stats().budget == 10


@pytest.mark.parametrize("make", [lambda: HeavyHitterCache(MODEL, budget=0.2), lambda: PolicyCache(MODEL, "snapkv")])
def test_an_undeclared_fraction_is_refused_outside_generate_with_the_fix_named(make: object) -> None:
    cache = make()  # type: ignore[operator]
    with eviction_attention(MODEL), pytest.raises(ValueError, match=r"budget=0\.2 is a fraction.*budget_of=<tokens>"):
        feed(cache, ids(32), chunk=32)


def test_a_fractional_layer_budget_alone_is_named_in_the_refusal() -> None:
    cache = HeavyHitterCache(MODEL, budget=4, recent=2, layer_budgets={1: 0.5})
    with eviction_attention(MODEL), pytest.raises(ValueError, match=r"layer_budgets\[1\]=0\.5 is a fraction"):
        feed(cache, ids(16), chunk=16)


def test_under_generate_a_fraction_is_of_the_prompt_and_is_resolved_again_after_reset() -> None:
    cache = PolicyCache(MODEL, SnapKV(window=4), budget=0.5)
    generate(cache, ids(20), max_new_tokens=3)
    assert cache.stats().budget == 10 and cache.layers[0].slots == 10  # type: ignore[attr-defined]
    generate(cache, torch.cat((ids(20), ids(6, seed=1)), dim=1), max_new_tokens=2)  # a second turn: no refusal
    assert cache.stats().budget == 10
    cache.reset()
    generate(cache, ids(12), max_new_tokens=2)
    assert cache.stats().budget == 6


def test_generate_with_a_chunked_prefill_is_refused_since_the_first_chunk_is_not_the_prompt() -> None:
    with pytest.raises(ValueError, match="prefill_chunk_size"):
        generate(HeavyHitterCache(MODEL, budget=0.5), ids(24), max_new_tokens=2, prefill_chunk_size=8)
    cache = HeavyHitterCache(MODEL, budget=0.5, budget_of=24)  # the fix the message names
    generate(cache, ids(24), max_new_tokens=2, prefill_chunk_size=8)
    assert cache.stats().budget == 12


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"budget": 8, "budget_of": 64}, "every budget is an int"),
        ({"budget": 0.2, "budget_of": 0}, "positive int"),
        ({"budget": 0.2, "budget_of": 2.5}, "positive int"),
        ({"budget": 8, "compress": "decode"}, "compress must be one of"),
    ],
)
def test_bad_budget_of_and_compress_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HeavyHitterCache(MODEL, **kwargs)  # type: ignore[arg-type]


def test_compress_prefill_evicts_the_prompt_once_then_appends_every_later_token() -> None:
    cache = PolicyCache(MODEL, SnapKV(window=4), budget=6, compress="prefill")
    with eviction_attention(MODEL):
        feed(cache, ids(20), chunk=20)
        kept = [layer.positions[0, 0].tolist() for layer in cache.layers]  # type: ignore[attr-defined]
        feed(cache, ids(12, seed=2), chunk=4, start=20)
    assert all(len(row) == 6 for row in kept)
    after = [layer.positions[0, 0].tolist() for layer in cache.layers]  # type: ignore[attr-defined]
    assert after == [row + list(range(20, 32)) for row in kept]


def test_compress_prefill_with_the_whole_prompt_kept_equals_dynamic_cache() -> None:
    tokens, cache, dynamic = (
        ids(28, seed=3),
        SinkCache(MODEL, n_sink=2, window=6, budget=16, compress="prefill"),
        DynamicCache(),
    )
    with eviction_attention(MODEL):
        ours = torch.cat((feed(cache, tokens[:, :16], 16), feed(cache, tokens[:, 16:], 4, start=16)), dim=1)
    full = torch.cat((feed(dynamic, tokens[:, :16], 16), feed(dynamic, tokens[:, 16:], 4, start=16)), dim=1)
    assert cache.layers[0].slots == 28  # type: ignore[attr-defined]
    assert torch.allclose(ours, full, atol=1e-5)


def test_compress_prefill_keeps_a_sliding_layer_to_its_window() -> None:
    model = tiny_mistral()  # every layer slides over 8 tokens
    cache = HeavyHitterCache(model, budget=4, recent=2, compress="prefill")
    with eviction_attention(model):
        feed(cache, ids(20, seed=4), chunk=20, model=model)
        assert [layer.slots for layer in cache.layers] == [4, 4]  # type: ignore[attr-defined]
        feed(cache, ids(12, seed=5), chunk=4, start=20, model=model)
    assert [layer.slots for layer in cache.layers] == [7, 7]  # type: ignore[attr-defined]
