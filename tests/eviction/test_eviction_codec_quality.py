"""int8 + H2O 20% on SmolLM2-135M: perplexity with the cache in the loop, and the bytes it holds.

2,048 tokens of Pride and Prejudice (from character 20,000) are fed 16 at a time through
`chunked_token_losses`, as ``kvgov eval ppl`` feeds them; the budget is 20% of the 2,048-token context
(409 slots per sequence and KV head), resolved as the registry's ``h2o@0.2`` resolves it for a known
context. Perplexity is over all 2,047 predicted tokens. Measured (float32, CPU; K/V bytes held after the
text as a share of float16 K/V for the same tokens):

    full cache (DynamicCache)                 22.845                 1
    H2O 20%, float32 slots                    23.316   (+2.06%)      0.3996 (float32; 0.0999 if float16)
    H2O 20%, int8 slots                       23.339   (+2.16%)      0.1061
    H2O 20%, fp8 e4m3 slots                   23.466   (+2.72%)      0.1030
    H2O 20%, fp8 e5m2 slots                   23.579   (+3.21%)      0.1030
    H2O 20%, int4 slots                       24.805   (+8.58%)      0.0562
    H2O 20%, int4, value/key groups of 32     24.137   (+5.66%)      0.0624
    H2O 20%, int4, value/key groups of 16     23.663   (+3.58%)      0.0749

int8 adds 0.10% to H2O's own loss. The test runs the first three rows, on one thread.

Bytes, SmolLM2 (30 layers, 3 KV heads, head_dim 64): float16 K + V cost 2 x 30 x 3 x 64 x 2 = 23,040 bytes
per token. int8 + H2O holds 409 slots per (layer, KV head), each 2 x (64 codes + float16 scale + float16
zero) = 136 bytes: 5,006,160 bytes after the 2,047 tokens fed (the last one predicts nothing), 2,445.6
bytes per token = 0.1061 x float16. Positions, validity and attention mass add 13 bytes per slot, 0.0101 x
float16.
"""

from __future__ import annotations

import math

import pytest
import torch

from hf_kvgov.evaluation.perplexity import chunked_token_losses
from hf_kvgov.registry import get_cache_spec

pytestmark = pytest.mark.real_model

TOKENS = 2048
CHUNK = 16
BUDGET = 409  # floor(0.2 x 2048)
LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64
FP16_BYTES_PER_TOKEN = 2 * LAYERS * KV_HEADS * HEAD_DIM * 2  # 23,040


@pytest.fixture(autouse=True)
def one_thread():  # type: ignore[no-untyped-def]
    """One intra-op thread: the cores are shared with other test processes, and two threads contending for
    a busy core make these small forwards several times slower (measured here: 439 s on two threads, 90 s on one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def passage(smollm2, austen_text) -> torch.Tensor:  # type: ignore[no-untyped-def]
    _, tokenizer = smollm2
    ids = tokenizer(austen_text[20000:45000], return_tensors="pt")["input_ids"][:, :TOKENS]
    assert ids.shape[1] == TOKENS
    return ids


def perplexity(model, ids: torch.Tensor, name: str, chunk: int = CHUNK) -> tuple[float, object]:  # type: ignore[no-untyped-def]
    losses, caches = chunked_token_losses(model, ids, [get_cache_spec(name)], chunk)
    return math.exp(losses[0].mean().item()), caches[0]


def test_int8_h2o_at_20_percent_keeps_perplexity_at_a_tenth_of_the_float16_bytes(smollm2, passage) -> None:  # type: ignore[no-untyped-def]
    model, _ = smollm2
    config = model.config
    assert (config.num_hidden_layers, config.num_key_value_heads, config.head_dim) == (LAYERS, KV_HEADS, HEAD_DIM)
    full, _ = perplexity(model, passage, "dynamic", chunk=TOKENS)
    ppl, stats = {}, {}
    for name in ("h2o@0.2", "h2o@0.2:int8"):
        ppl[name], cache = perplexity(model, passage, name)
        stats[name] = cache.stats()  # type: ignore[attr-defined]
    int8 = stats["h2o@0.2:int8"]
    assert (int8.budget, int8.slots, int8.tokens_seen, int8.codec) == (BUDGET, BUDGET, TOKENS - 1, "int8")
    slot_heads = LAYERS * KV_HEADS * BUDGET
    assert int8.kv_bytes == slot_heads * 2 * (HEAD_DIM + 2 + 2)
    assert int8.metadata_bytes == slot_heads * (8 + 1 + 4)
    kv_ratio = int8.kv_bytes / int8.tokens_seen / FP16_BYTES_PER_TOKEN
    assert kv_ratio <= 0.11, f"int8 + H2O holds {kv_ratio:.4f} x the float16 bytes of the same tokens"
    loss = {name: value / full - 1 for name, value in ppl.items()}
    report = ", ".join(f"{name} {value:.3f}" for name, value in ppl.items())
    assert loss["h2o@0.2:int8"] <= 0.03, f"full {full:.3f}; {report}"
    # Quantizing the kept slots adds little on top of evicting 80% of them.
    assert ppl["h2o@0.2:int8"] <= ppl["h2o@0.2"] * 1.005, f"full {full:.3f}; {report}"
