"""stats() counts the bytes really held: codes + scales of sealed blocks + full-precision sink and tail.

A bfloat16 model with head_dim 64 (SmolLM2's) and blocks of 64 tokens. Per layer and block:

    bf16 block            2 (K, V) x 64 tokens x 64 dims x 2 B                      = 16,384 B
    int8 sealed block     codes 2 x 64 x 64 x 1 B = 8,192, + key scale and zero 64 ch x 2 x 2 B = 256
                          + value scale and zero 64 tokens x 2 x 2 B = 256           =  8,704 B  (1/2 x 17/16)
    int4 sealed block     codes 4,096 + 256 + 256                                    =  4,608 B  (1/4 x 9/8)
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_kvgov import PagedCache
from hf_kvgov.hf.quantized_cache import QuantizedCache
from hf_kvgov.storage.quantized_pool import QuantizedBlockPool

LAYERS, BLOCK = 2, 64
TOKENS = 20 * BLOCK + 5  # 21 blocks: sink, 19 sealed, a tail of 5 tokens
FULL_BLOCK = LAYERS * 16_384
SEALED_BLOCK = {8: LAYERS * 8_704, 4: LAYERS * 4_608}


@pytest.fixture(scope="module")
def bf16_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
    )
    return LlamaForCausalLM(config).to(torch.bfloat16).eval()


def fill(model: LlamaForCausalLM, cache: PagedCache, chunk: int = TOKENS) -> None:
    ids = torch.randint(3, 96, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        for start in range(0, TOKENS, chunk):
            model(ids[:, start : start + chunk], cache=cache)


@pytest.mark.parametrize(("bits", "about"), [(8, 1 / 2), (4, 1 / 4)])
def test_bytes_held_against_the_full_precision_cache(bf16_model: LlamaForCausalLM, bits: int, about: float) -> None:
    paged = PagedCache(bf16_model, block_size=BLOCK)
    quantized = QuantizedCache(bf16_model, bits=bits, block_size=BLOCK)
    fill(bf16_model, paged)
    fill(bf16_model, quantized)
    full, stats = paged.stats(), quantized.stats()
    assert full.bytes_used == 21 * FULL_BLOCK
    assert (stats.full_precision_blocks, stats.sealed_blocks) == (2, 19)
    assert stats.bytes_used == 2 * FULL_BLOCK + 19 * SEALED_BLOCK[bits]
    assert stats.unquantized_bytes == full.bytes_used
    # Sealed blocks alone: half (int8) or a quarter (int4) of bf16, plus 1/16 or 1/8 for scales.
    overhead = {8: 17 / 16, 4: 9 / 8}[bits]
    assert SEALED_BLOCK[bits] / FULL_BLOCK == pytest.approx(about * overhead)
    # With the sink and tail blocks still in bf16, over this cache:
    assert stats.bytes_used / full.bytes_used == pytest.approx((2 + 19 * about * overhead) / 21)
    assert stats.compression == pytest.approx(full.bytes_used / stats.bytes_used)
    assert stats.bytes_per_token == pytest.approx(stats.bytes_used / TOKENS)


def test_full_precision_memory_of_sealed_blocks_is_released(bf16_model: LlamaForCausalLM) -> None:
    cache = QuantizedCache(bf16_model, bits=8, block_size=BLOCK)
    # Blocks are sealed at the end of the step that filled them, so a step holds its own tokens in full
    # precision: prefilling in chunks of 4 blocks (generate's prefill_chunk_size) bounds that peak.
    fill(bf16_model, cache, chunk=4 * BLOCK)
    pool = cache.pool
    assert isinstance(pool, QuantizedBlockPool)
    # Only the sink and the tail hold full-precision blocks; the pool never grew past its first step.
    assert pool.num_used == 2 and pool.capacity == 8
    assert pool.sealed.num_used == 19
    # The reserved figure is the size of the tensors that really exist.
    tensors = [*pool.keys, *pool.values, *(t for layer in pool.sealed.pieces for t in layer.values())]
    assert cache.stats().pool_bytes_reserved == sum(t.numel() * t.element_size() for t in tensors)
    cache.release()
    assert cache.stats().bytes_used == 0 and pool.sealed.num_used == 0
