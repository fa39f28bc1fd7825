"""Attention mass per KV head: hand-made sums, and the chunked prefill against a dense reference."""

from __future__ import annotations

import pytest
import torch

from hf_kvgov.policies import accumulate_attention, attention_mass_chunked


def dense_mass(query, key, scale, allowed=None, softcap=None):
    """Reference: repeat each KV head for its query heads, softmax all queries at once, then sum.

    ``allowed`` is bool ``[batch, q_heads, q_len, k_len]``; fully masked query rows add nothing.
    """
    group = query.shape[1] // key.shape[1]
    keys = key.repeat_interleave(group, dim=1).double()
    logits = query.double() @ keys.transpose(-1, -2) * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    probs = torch.nan_to_num(logits.softmax(dim=-1), nan=0.0)
    total = torch.zeros(key.shape[0], key.shape[1], key.shape[2], dtype=torch.float64)
    for head in range(query.shape[1]):
        total[:, head // group] += probs[:, head].sum(dim=1)
    return total


def causal(q_len: int, k_len: int, offset: int) -> torch.Tensor:
    """Bool ``[q_len, k_len]``: query ``i`` sits at absolute position ``offset + i``."""
    return torch.tensor([[j <= offset + i for j in range(k_len)] for i in range(q_len)])


def random_qk(batch=2, q_heads=4, kv_heads=2, q_len=37, k_len=53, head_dim=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, q_heads, q_len, head_dim, generator=gen)
    key = torch.randn(batch, kv_heads, k_len, head_dim, generator=gen)
    return query, key


def test_accumulate_sums_the_query_heads_of_each_kv_head() -> None:
    weights = torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.2, 0.7], [1.0, 0.0, 0.0], [0.0, 0.5, 0.5]])
    weights = weights.view(1, 4, 1, 3)
    mass = accumulate_attention(None, weights, group_size=2)
    torch.testing.assert_close(mass, torch.tensor([[[0.6, 0.45, 0.95], [1.0, 0.5, 0.5]]]))
    # Running scores for two older slots; the third slot is the key appended this step.
    running = torch.tensor([[[1.0, 2.0], [3.0, 4.0]]])
    mass = accumulate_attention(running, weights, group_size=2)
    torch.testing.assert_close(mass, torch.tensor([[[1.6, 2.45, 0.95], [4.0, 4.5, 0.5]]]))


def test_accumulate_sums_query_tokens_and_skips_masked_ones() -> None:
    weights = torch.tensor([[[[0.5, 0.5], [0.0, 1.0], [0.25, 0.75]]]])  # [1, 1, 3, 2]
    torch.testing.assert_close(accumulate_attention(None, weights, 1), torch.tensor([[[0.75, 2.25]]]))
    query_valid = torch.tensor([[False, True, True]])
    mass = accumulate_attention(None, weights, 1, query_valid=query_valid)
    torch.testing.assert_close(mass, torch.tensor([[[0.25, 1.75]]]))


def test_accumulate_keeps_float32_for_half_precision_attention() -> None:
    weights = torch.full((1, 2, 1, 4), 0.25, dtype=torch.bfloat16)
    mass = accumulate_attention(None, weights, 2)
    assert mass.dtype == torch.float32
    torch.testing.assert_close(mass, torch.full((1, 1, 4), 0.5))


@pytest.mark.parametrize(
    ("scores", "weights", "group", "message"),
    [
        (None, torch.zeros(1, 3, 1, 4), 2, "3 query heads, which is not a multiple of group_size=2"),
        (None, torch.zeros(1, 4, 4), 1, r"\[batch, q_heads, q_len, slots\]"),
        (None, torch.zeros(1, 2, 1, 4), 0, "group_size must be a positive int"),
        (torch.zeros(1, 2, 5), torch.zeros(1, 2, 1, 4), 1, "may not hold more slots"),
        (torch.zeros(1, 1, 4), torch.zeros(1, 2, 1, 4), 1, "kv_heads must match"),
    ],
)
def test_accumulate_refuses_mismatched_shapes(scores, weights, group, message) -> None:
    with pytest.raises(ValueError, match=message):
        accumulate_attention(scores, weights, group)


@pytest.mark.parametrize("chunk", [1, 8, 37, 512])
def test_chunked_equals_dense_causal_prefill(chunk: int) -> None:
    query, key = random_qk()
    expected = dense_mass(query, key, 0.25, causal(37, 53, offset=53 - 37))
    mass = attention_mass_chunked(query, key, chunk=chunk)
    torch.testing.assert_close(mass.double(), expected, rtol=1e-5, atol=1e-5)


def test_chunked_causal_with_an_explicit_offset() -> None:
    query, key = random_qk(q_len=20, k_len=53)
    # Queries at positions 5..24: keys 25..52 are in their future and receive nothing.
    expected = dense_mass(query, key, 0.3, causal(20, 53, offset=5))
    mass = attention_mass_chunked(query, key, 0.3, offset=5, chunk=6)
    torch.testing.assert_close(mass.double(), expected, rtol=1e-5, atol=1e-5)
    assert mass[..., 25:].abs().max() == 0


def test_chunked_with_left_padding() -> None:
    query, key = random_qk(q_len=30, k_len=30, seed=1)
    key_valid = torch.ones(2, 30, dtype=torch.bool)
    key_valid[1, :7] = False
    allowed = causal(30, 30, 0)[None, None] & key_valid[:, None, None, :]
    mass = attention_mass_chunked(query, key, 0.25, key_valid=key_valid, chunk=4)
    torch.testing.assert_close(mass.double(), dense_mass(query, key, 0.25, allowed), rtol=1e-5, atol=1e-5)
    assert mass[1, :, :7].abs().max() == 0
    # Each real query spreads a mass of 1 per query head: 2 heads per KV head x (30 - 7) queries.
    torch.testing.assert_close(mass[1].sum(dim=-1), torch.full((2,), 2.0 * 23))


def test_chunked_with_a_sliding_window_mask_fn_sees_only_chunk_sized_ranges() -> None:
    query, key = random_qk(q_len=25, k_len=40, seed=2)
    offset, window = 15, 6
    calls: list[tuple[int, int]] = []

    def sliding(start: int, end: int) -> torch.Tensor:
        calls.append((start, end))
        q_pos = torch.arange(start, end)[:, None] + offset
        return q_pos - torch.arange(40)[None, :] < window

    allowed = causal(25, 40, offset) & sliding(0, 25)
    calls.clear()
    mass = attention_mass_chunked(query, key, 0.25, mask_fn=sliding, chunk=10)
    torch.testing.assert_close(mass.double(), dense_mass(query, key, 0.25, allowed), rtol=1e-5, atol=1e-5)
    assert calls == [(0, 10), (10, 20), (20, 25)]


def test_chunked_without_causal_mask_and_with_softcap() -> None:
    query, key = random_qk(q_heads=3, kv_heads=3, q_len=11, k_len=17, seed=3)
    query = query * 4  # large logits, so the soft cap matters
    mass = attention_mass_chunked(query, key, 0.25, causal=False, softcap=5.0, chunk=4)
    expected = dense_mass(query, key, 0.25, softcap=5.0)
    torch.testing.assert_close(mass.double(), expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(expected, dense_mass(query, key, 0.25))


def test_chunked_float64_is_exact_to_float64_rounding() -> None:
    query, key = random_qk()
    mass = attention_mass_chunked(query.double(), key.double(), 0.25, chunk=5)
    expected = dense_mass(query, key, 0.25, causal(37, 53, 16))
    assert mass.dtype == torch.float64
    torch.testing.assert_close(mass, expected, rtol=1e-12, atol=1e-12)


class GroupedAttention(torch.nn.Module):
    num_key_value_groups = 2


def test_chunked_matches_accumulating_transformers_eager_attention() -> None:
    modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    query, key = random_qk(q_len=12, k_len=12, seed=4)
    module = GroupedAttention().eval()
    additive = torch.zeros(12, 12).masked_fill(~causal(12, 12, 0), torch.finfo(torch.float32).min)
    _, weights = modeling_llama.eager_attention_forward(
        module, query, key, torch.zeros_like(key), additive[None, None], scaling=0.25
    )
    expected = accumulate_attention(None, weights, group_size=2)
    torch.testing.assert_close(attention_mass_chunked(query, key, 0.25, chunk=5), expected)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"causal": False, "offset": 3}, "offset only applies to a causal mask"),
        ({"chunk": 0}, "chunk must be a positive int"),
        (
            {"key_valid": torch.ones(2, 5, dtype=torch.bool)},
            r"key_valid must be a bool tensor of shape \(2, 53\)",
        ),
    ],
)
def test_chunked_refuses_bad_arguments(kwargs: dict, message: str) -> None:
    query, key = random_qk()
    with pytest.raises(ValueError, match=message):
        attention_mass_chunked(query, key, **kwargs)


def test_chunked_refuses_heads_that_do_not_group() -> None:
    query, key = random_qk(q_heads=3, kv_heads=2)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        attention_mass_chunked(query, key)
