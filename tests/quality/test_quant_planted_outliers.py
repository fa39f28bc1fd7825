"""Outlier key channels planted in SmolLM2 without changing the model: int4, int2 and fp8 must absorb them.

In every layer, the key channels 5 and 5 + 32 of every KV head (a RoPE pair: RoPE rotates each channel with
its partner, so scaling both alike commutes with it) are multiplied by 50 in `k_proj`, and the same channels
of every query head of the group divided by 50 in `q_proj`. Every attention logit stays the same up to
float32 rounding, so the full-precision model is unchanged (the weights are restored from a copy after),
while its cached keys now carry the outlier channels the brief warns about (early Qwen, CodeLlama): in layer
3 the planted channel is 36-66x the median channel.

Keys are grouped per channel (KIVI), so a planted channel gets its own range instead of flattening its
token's other channels. Measured on this machine, 1,024 tokens from character 30,000, blocks of 16, one
block per step (perplexity increase against the same model's full cache; unplanted -> planted):

    int8  +0.037% -> +0.026%    int4  +0.479% -> +0.726%    int2 (KIVI settings)  +3.337% -> +3.499%
    int2 with one-byte statistics (a logarithmic scale byte, an e4m3 zero)  +6.301% -> +6.116% (2 threads)
    fp8   -0.083% -> +0.022%    (keys centred per channel; with symmetric key scales it was +0.727% -> +0.806%)

(A factor of 64 would give identical numbers: a power of two only moves each per-channel scale's exponent.)
The test asks each format to stay within 2x its unplanted loss, plus 0.05 points of float noise; run it
with ``-s`` to print the figures.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from hf_kvgov.hf.quantized_cache import QuantizedCache
from hf_kvgov.quality import score_in_lockstep

pytestmark = pytest.mark.real_model
FACTOR = 50.0  # not a power of two, so no quantizer can absorb it exactly by its exponent
CHANNEL = 5
TOKENS = 1024
BLOCK = 16
FORMATS: dict[str, dict[str, Any]] = {
    "int8": {"bits": 8},
    "int4": {"bits": 4},
    "int2": {"bits": 2, "residual": 32, "group_size": 32},
    "int2 one-byte statistics": {"bits": 2, "residual": 32, "group_size": 32, "scale_bytes": 1},
    "fp8": {"bits": 8, "fmt": "fp8"},
}


@contextlib.contextmanager
def planted(model: Any) -> Iterator[None]:
    """The model with outlier key channels (see the module docstring), restored exactly on exit."""
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    group = config.num_attention_heads // config.num_key_value_heads
    half = head_dim // 2

    def scale(factor: float) -> None:
        for layer in model.model.layers:
            attention = layer.self_attn
            for kv_head in range(config.num_key_value_heads):
                rows = [kv_head * head_dim + CHANNEL, kv_head * head_dim + CHANNEL + half]
                attention.k_proj.weight.data[rows] *= factor
                for q_head in range(kv_head * group, (kv_head + 1) * group):
                    attention.q_proj.weight.data[[q_head * head_dim + CHANNEL, q_head * head_dim + CHANNEL + half]] /= (
                        factor
                    )

    saved = [(layer.self_attn.k_proj.weight.detach().clone(), layer.self_attn.q_proj.weight.detach().clone())
             for layer in model.model.layers]  # fmt: skip
    scale(FACTOR)
    try:
        yield
    finally:
        for layer, (k, q) in zip(model.model.layers, saved, strict=True):
            layer.self_attn.k_proj.weight.data.copy_(k)
            layer.self_attn.q_proj.weight.data.copy_(q)


def increases(model: Any, ids: torch.Tensor) -> tuple[dict[str, float], float]:
    """Each format's perplexity increase, and the full cache's perplexity."""
    builders = {
        name: (lambda o=options: QuantizedCache(model, block_size=BLOCK, **o)) for name, options in FORMATS.items()
    }
    result = score_in_lockstep(model, ids, builders, BLOCK, BLOCK, max_rows=len(FORMATS))
    scores = result.scores
    return {name: scores[name].ppl_increase_pct for name in FORMATS}, scores["int8"].reference_perplexity


@pytest.fixture(scope="module")
def measured(smollm2: Any, austen_text: str) -> dict[str, Any]:
    model, tokenizer = smollm2
    ids = tokenizer(austen_text[30_000:40_000], return_tensors="pt")["input_ids"][:, :TOKENS]
    with torch.inference_mode():
        plain, plain_ppl = increases(model, ids)
        with planted(model):
            keys = model(ids[:, :64], output_hidden_states=False, use_cache=True).past_key_values.layers[3].keys
            planted_increases, planted_ppl = increases(model, ids)
    return {"plain": plain, "planted": planted_increases, "ppl": (plain_ppl, planted_ppl), "keys": keys}


def test_planting_leaves_the_model_unchanged_and_the_keys_outlying(measured: dict[str, Any]) -> None:
    plain_ppl, planted_ppl = measured["ppl"]
    assert planted_ppl == pytest.approx(plain_ppl, rel=1e-4)  # the same logits, up to float32 rounding
    magnitude = measured["keys"].abs().amax(dim=2)  # [batch, heads, head_dim]: each channel's largest |key|
    ratio = magnitude[..., CHANNEL] / magnitude.median(dim=-1).values
    assert bool((ratio > 20).all())  # the planted channel towers over the others in every head


@pytest.mark.parametrize("name", list(FORMATS))
def test_each_format_stays_within_twice_its_unplanted_loss(measured: dict[str, Any], name: str) -> None:
    plain, planted_loss = measured["plain"][name], measured["planted"][name]
    print(f"{name}: {plain:+.3f}% unplanted -> {planted_loss:+.3f}% planted")  # the docstring's figures (-s)
    assert planted_loss <= 2 * max(plain, 0.0) + 0.05, f"{name}: {plain:+.3f}% unplanted, {planted_loss:+.3f}% planted"


def test_int2_with_one_byte_statistics_stays_within_ten_percent(measured: dict[str, Any]) -> None:
    """The issue's int2 bound, on the unplanted model against its own full cache (+6.30% measured, 2 threads)."""
    assert measured["plain"]["int2 one-byte statistics"] <= 10.0
