"""Learned attention sinks (GPT-OSS; transformers' ``s_aux``) in every torch path that attends: a sink is one more
logit per query head in each softmax's denominator, reading no value.

Each path is compared with the definition, GPT-OSS's eager attention in float64: the sink column is appended to the
masked logits, the softmax taken, the column dropped. The sinks range from -1 to 3 so they take a visible share
(a path that ignores them misses by far more than the tolerance: `test_the_sinks_change_the_result`).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from hf_kvgov.engine.slots.slot_attention import attend_slots
from hf_kvgov.kernels import dispatch
from hf_kvgov.kernels.block_mass import attention_mass
from hf_kvgov.kernels.quantized_reference import quantized_paged_attention_reference
from hf_kvgov.kernels.reference import paged_attention_reference
from tests.kernels.test_reference import causal, left_padding, scatter_into_blocks

BATCH, KV_HEADS, GROUP, DIM, LENGTH, BLOCK = 2, 2, 2, 16, 37, 4
SCALE = DIM**-0.5
SINKS = torch.linspace(-1.0, 3.0, KV_HEADS * GROUP)


def sink_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor, sinks: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output `[batch, q_len, q_heads, dim]`, probabilities `[batch, q_heads, q_len, length]`) in float64."""
    k = keys.double().repeat_interleave(GROUP, dim=1)
    v = values.double().repeat_interleave(GROUP, dim=1)
    logits = (query.double() @ k.transpose(-1, -2) * SCALE).masked_fill(~allowed[:, None], float("-inf"))
    if sinks is not None:
        column = sinks.double().view(1, -1, 1, 1).expand(*logits.shape[:-1], 1)
        probs = torch.cat((logits, column), dim=-1).softmax(dim=-1)[..., :-1]
    else:
        probs = logits.softmax(dim=-1)
    return (probs @ v).transpose(1, 2), probs


def inputs(q_len: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(BATCH, KV_HEADS * GROUP, q_len, DIM, generator=generator)
    keys = torch.randn(BATCH, KV_HEADS, LENGTH, DIM, generator=generator)
    values = torch.randn(BATCH, KV_HEADS, LENGTH, DIM, generator=generator)
    return query, keys, values


def paged(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return scatter_into_blocks(keys, values, BLOCK, torch.Generator().manual_seed(1))


@pytest.fixture(autouse=True)
def automatic_backend() -> Iterator[None]:
    dispatch.set_backend(None)
    yield
    dispatch.set_backend(None)


MASKS = {
    "decode": (1, lambda q: None),
    "prefill, causal": (9, lambda q: None),
    "prefill, left padding": (9, lambda q: left_padding(BATCH, q, LENGTH, [0, 5])[:, None]),
}


@pytest.mark.parametrize("case", list(MASKS), ids=list(MASKS))
def test_the_paged_reference_and_dispatch_add_the_sinks(case: str) -> None:
    q_len, mask_of = MASKS[case]
    query, keys, values = inputs(q_len)
    mask = mask_of(q_len)
    allowed = causal(BATCH, q_len, LENGTH) if mask is None else mask[:, 0]
    expected, _ = sink_attention(query, keys, values, allowed, SINKS)
    key_cache, value_cache, table = paged(keys, values)
    out = paged_attention_reference(
        query, key_cache, value_cache, table, LENGTH, SCALE, mask=mask, chunk_tokens=8, sinks=SINKS
    )
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    # On the CPU dispatch prefers gathered sdpa, which has no sinks: the call goes to the reference instead.
    via = dispatch.paged_attention(query, key_cache, value_cache, table, LENGTH, SCALE, mask=mask, sinks=SINKS)
    assert dispatch.last_backend() == "torch"
    torch.testing.assert_close(via.double(), expected, atol=1e-5, rtol=1e-5)
    dispatch.paged_attention(query, key_cache, value_cache, table, LENGTH, SCALE, mask=mask)
    assert dispatch.last_backend() == "sdpa"  # without sinks, the fast backend as before


def test_a_forced_backend_without_sinks_falls_back_to_the_reference() -> None:
    query, keys, values = inputs(1)
    key_cache, value_cache, table = paged(keys, values)
    dispatch.set_backend("sdpa")
    out = dispatch.paged_attention(query, key_cache, value_cache, table, LENGTH, SCALE, sinks=SINKS)
    assert dispatch.last_backend() == "torch"
    expected, _ = sink_attention(query, keys, values, causal(BATCH, 1, LENGTH), SINKS)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_the_quantized_path_adds_the_sinks() -> None:
    query, keys, values = inputs(1)
    key_cache, value_cache, table = paged(keys, values)

    def no_sealed_blocks(entries: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        raise AssertionError("this table holds full-precision blocks only")

    expected, _ = sink_attention(query, keys, values, causal(BATCH, 1, LENGTH), SINKS)
    out = quantized_paged_attention_reference(
        query, key_cache, value_cache, table, LENGTH, SCALE, no_sealed_blocks, sinks=SINKS
    )
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    via = dispatch.quantized_paged_attention(
        query, key_cache, value_cache, table, LENGTH, SCALE, no_sealed_blocks, sinks=SINKS
    )
    assert dispatch.last_backend() == "torch"
    torch.testing.assert_close(via.double(), expected, atol=1e-5, rtol=1e-5)


def test_the_sinks_change_the_result() -> None:
    query, keys, values = inputs(1)
    key_cache, value_cache, table = paged(keys, values)
    with_sinks = paged_attention_reference(query, key_cache, value_cache, table, LENGTH, SCALE, sinks=SINKS)
    without = paged_attention_reference(query, key_cache, value_cache, table, LENGTH, SCALE)
    assert (with_sinks - without).abs().max() > 0.1


def test_sinks_of_another_shape_are_refused() -> None:
    query, keys, values = inputs(1)
    key_cache, value_cache, table = paged(keys, values)
    with pytest.raises(ValueError, match=r"one logit per query head, shape \(4,\); got \(2,\)"):
        paged_attention_reference(query, key_cache, value_cache, table, LENGTH, SCALE, sinks=SINKS[:2])


def test_slot_attention_adds_the_sinks_and_keeps_them_out_of_the_mass() -> None:
    """An eviction cache's slots: the kept ones (some invalid), then this step's, causal among themselves."""
    q_len, kept = 3, LENGTH - 3
    query, keys, values = inputs(q_len)
    kept_valid = torch.rand(BATCH, KV_HEADS, kept, generator=torch.Generator().manual_seed(2)) > 0.3
    out, mass, _ = attend_slots(query, keys, values, kept_valid, None, SCALE, sinks=SINKS, want_scores=True, chunk=2)
    new = torch.ones(q_len, q_len, dtype=torch.bool).tril()
    allowed = torch.cat(
        (kept_valid[:, :, None, :].expand(-1, -1, q_len, -1), new.expand(BATCH, KV_HEADS, q_len, q_len)), dim=-1
    )  # [batch, kv_heads, q_len, slots]: per KV head, so the definition runs per KV head
    for head in range(KV_HEADS):
        heads = slice(head * GROUP, (head + 1) * GROUP)
        one = slice(head, head + 1)
        expected, probs = sink_attention(query[:, heads], keys[:, one], values[:, one], allowed[:, head], SINKS[heads])
        torch.testing.assert_close(out[:, :, heads].double(), expected, atol=1e-5, rtol=1e-5)
        assert mass is not None
        torch.testing.assert_close(mass[:, head].double(), probs.sum(dim=(1, 2)), atol=1e-5, rtol=1e-5)


def test_the_engines_block_mass_gives_the_sinks_their_share() -> None:
    q_len = 5
    query, keys, _ = inputs(q_len)
    mass = attention_mass(query, keys, SCALE, None, None, BLOCK, SINKS)
    _, probs = sink_attention(query, keys, keys, causal(BATCH, q_len, LENGTH), SINKS)
    per_token = probs.sum(dim=(1, 2))
    padded = torch.nn.functional.pad(per_token, (0, -LENGTH % BLOCK))
    torch.testing.assert_close(mass.double(), padded.view(BATCH, -1, BLOCK).sum(-1), atol=1e-5, rtol=1e-5)
    assert float(mass.sum()) < BATCH * q_len * KV_HEADS * GROUP - 1  # the sinks took their share
