"""QuantizedCache on SmolLM2-135M (trained weights): generate on both attention paths against the
fake-quantizing reference, and perplexity over 2,048 tokens of Pride and Prejudice with the cache in the
loop, against the full-precision cache in the same batched run.

Perplexity increase measured on this machine, 2,048 tokens from character 30,000 (full cache 27.677):

    blocks of 64, one block per step (this test)   int8 +0.012%   fp8 e4m3 +0.171%   int4 +0.313%
    same, no sink block (sink_blocks=0)            int8 +0.036%   fp8 e4m3 +0.393%   int4 +0.579%
    blocks of 16, one block per step (the CLI's)   int8 +0.026%   fp8 e4m3 +0.746%   int4 +0.582%
    blocks of 128 (COMPACT_BLOCK_SIZE)       int8 -0.002%   fp8 e4m3 +0.347%   int4 +0.270%

A step of one block reproduces generation exactly: each token sees the full-precision sink, the sealed
blocks before its own, and its own block in full precision. The limits below sit between the measured
values and those of the cache without its sink block, so they catch that regression (and anything worse,
such as per-token key scales) while leaving room for float32 summation-order differences across machines.
DESIGN.md's 22.3 vs 21.20 (+5%) for int4 quantized *every* token, the newest included; a sealed-block
cache keeps the sink and the block being written in full precision, which is why it loses far less.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from quant_fake_reference import FakeQuantCache

from hf_kvgov import paged_attention
from hf_kvgov.hf.quantized_cache import QuantizedCache
from hf_kvgov.quality import score_in_lockstep

pytestmark = pytest.mark.real_model
BLOCK = 64
FORMATS = {"int8": {"bits": 8}, "fp8": {"bits": 8, "fmt": "fp8"}, "int4": {"bits": 4}}
MAX_INCREASE_PCT = {"int8": 0.1, "fp8": 0.3, "int4": 0.45}  # the issue asks int8 <= 0.5
# Bytes of one 64-token block over SmolLM2's 30 layers (3 KV heads, head_dim 64), float32 vs sealed:
FULL_BLOCK = 30 * 2 * 64 * 3 * 64 * 4
SEALED_BLOCK = {
    "int8": 30 * (2 * 64 * 3 * 64 + 2 * (3 * 64 * 2 * 2)),  # codes + key and value scale and zero, fp16
    "int4": 30 * (64 * 3 * 64 + 2 * (3 * 64 * 2 * 2)),  # two codes per byte
    "fp8": 30 * (2 * 64 * 3 * 64 + 3 * 64 * (2 + 1) + 3 * 64 * 2),  # key scale, e4m3 key zero; value scale
}


def generate(model, prompt, cache):  # type: ignore[no-untyped-def]
    kwargs = {"max_new_tokens": 16, "do_sample": False, "return_dict_in_generate": True, "output_logits": True}
    return model.generate(**prompt, cache=cache, **kwargs)


@pytest.fixture(scope="module")
def prompt(smollm2, austen_text):  # type: ignore[no-untyped-def]
    _, tokenizer = smollm2
    return tokenizer(austen_text[20000:21000], return_tensors="pt")


@pytest.fixture(scope="module")
def reference_generation(smollm2, prompt):  # type: ignore[no-untyped-def]
    model = smollm2[0]
    cache = FakeQuantCache(model.config, "int4", block_size=16)
    return generate(model, prompt, cache)


@pytest.mark.parametrize("path", ["contiguous", "paged"])
def test_generate_matches_fake_quantization(smollm2, prompt, reference_generation, path: str) -> None:  # type: ignore[no-untyped-def]
    model = smollm2[0]
    cache = QuantizedCache(model, bits=4, block_size=16, attention=path)  # type: ignore[arg-type]
    with paged_attention(model) if path == "paged" else contextlib.nullcontext():
        got = generate(model, prompt, cache)
    assert torch.equal(got.sequences, reference_generation.sequences)
    pairs = zip(got.logits, reference_generation.logits, strict=True)
    worst = max((g - e).abs().max().item() for g, e in pairs)
    # The contiguous path runs the reference's own arithmetic: bit for bit. The paged path's online softmax
    # sums in another order; a 1e-7 difference in a key can move an int4 code across a rounding boundary,
    # and one code step moves a logit by up to ~2e-2 (measured 0.020; int8 0.002).
    assert worst <= {"contiguous": 1e-5, "paged": 5e-2}[path], f"logits differ by {worst}"
    assert cache.stats().sealed_blocks == cache.get_seq_length() // 16 - 1


def test_perplexity_with_the_cache_in_the_loop(smollm2, austen_text) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer = smollm2
    ids = tokenizer(austen_text[30000:42000], return_tensors="pt")["input_ids"][:, :2048]
    assert ids.shape[1] == 2048
    candidates = {
        name: functools.partial(QuantizedCache, model, block_size=BLOCK, **options) for name, options in FORMATS.items()
    }
    scores = score_in_lockstep(model, ids, candidates, chunk_tokens=BLOCK, block_size=BLOCK).scores
    measured = {name: round(s.ppl_increase_pct, 3) for name, s in scores.items()}
    assert scores["int8"].reference_perplexity == pytest.approx(27.677, abs=0.01)  # the text measured above
    assert scores["int8"].ppl_increase_pct <= 0.5, measured
    for name, limit in MAX_INCREASE_PCT.items():
        assert scores[name].ppl_increase_pct <= limit, measured
    assert scores["int8"].kl_mean < 1e-4 < min(scores["fp8"].kl_mean, scores["int4"].kl_mean)
    assert scores["int8"].top1_agreement > 0.99 and scores["int4"].top1_agreement > 0.9
    # 2,047 tokens held (the last one predicts nothing): 32 blocks, sink and tail in float32, 30 sealed.
    for name, score in scores.items():
        assert score.bytes_per_token == pytest.approx((2 * FULL_BLOCK + 30 * SEALED_BLOCK[name]) / 2047)
