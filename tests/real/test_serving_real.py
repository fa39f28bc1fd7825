"""The serving engine on the embedded real models: requests of different passages, questions and lengths, served
together (chunked prefill, prefix hits of unequal length, a cap that forces preemption), each answer token for token
what the request gets alone with `DynamicCache`."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_kvgov.serving import SamplingParams, ServingEngine

pytestmark = pytest.mark.real_model

NEW = 16
QUESTIONS = ("Who is speaking?", "What happens next?", "Name one person in this passage.", "Summarise it:")


def _prompts(tokenizer, text: str, starts: tuple[int, ...], length: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """Two questions on each passage: the pairs share the passage as a prefix, the questions differ in length."""
    prompts = []
    for i, start in enumerate(starts):
        passage = text[start : start + length]
        for question in QUESTIONS[i % 2 :: 2]:
            prompts.append(tokenizer(f"{passage}\n\n{question}\nAnswer:")["input_ids"])
    return prompts


def _alone(model, prompt: list[int]) -> list[int]:  # type: ignore[no-untyped-def]
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, cache=DynamicCache(config=model.config)
    )
    return out[0, len(prompt) :].tolist()


def _serve(model, prompts: list[list[int]], **engine_args) -> tuple[list[list[int]], object]:  # type: ignore[no-untyped-def]
    with ServingEngine(model, **engine_args) as engine:
        outputs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
        return outputs, engine.stats()


def test_smollm2_requests_served_together_answer_as_alone(smollm2, austen_text) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer = smollm2
    prompts = _prompts(tokenizer, austen_text, (30000, 91000, 150500), 900)
    reference = [_alone(model, p) for p in prompts]
    got, stats = _serve(model, prompts, max_batched_tokens=128)  # the second of a pair enters mid-prefill
    assert [g[: len(r)] for g, r in zip(got, reference, strict=True)] == reference
    assert stats.prefix_hit_tokens > 0  # type: ignore[attr-defined]
    # A cap of about two requests' worth: the others wait or are preempted, and still answer the same.
    longest = max(len(p) for p in prompts) + NEW
    engine = ServingEngine(model, block_size=16)
    cap = 2 * -(-longest // 16) * engine.pool.bytes_per_block
    engine.close()
    got, stats = _serve(model, prompts, max_batched_tokens=128, max_bytes=cap)
    assert [g[: len(r)] for g, r in zip(got, reference, strict=True)] == reference
    assert stats.kv_bytes_peak <= cap  # type: ignore[attr-defined]


def test_gemma3_sliding_layers_with_prefix_hits(gemma3, austen_text) -> None:  # type: ignore[no-untyped-def]
    """Gemma-3-270M slides over 512 tokens on 15 of 18 layers; passages of ~700 tokens pass the window."""
    model, tokenizer = gemma3
    prompts = _prompts(tokenizer, austen_text, (60000, 120000), 2900)
    reference = [_alone(model, p) for p in prompts]
    with ServingEngine(model, max_batched_tokens=512) as engine:
        first = engine.generate(prompts[::2], SamplingParams(max_new_tokens=NEW, ignore_eos=True))
        second = engine.generate(prompts[1::2], SamplingParams(max_new_tokens=NEW, ignore_eos=True))
        assert engine.stats().prefix_hit_tokens >= 0.8 * sum(len(p) for p in prompts[1::2])
    got = [first[0], second[0], first[1], second[1]]
    assert [g[: len(r)] for g, r in zip(got, reference, strict=True)] == reference
