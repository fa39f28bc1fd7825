"""`attend_slots`, the eviction caches' attention, against its definition in float64 (a masked softmax per query,
query head ``i`` reading KV head ``i // group``): with the attention facts asked for (the explicit logits), and
without (one fused attention per chunk, or none but a causal one for a first chunk), on kept slots some of which
are invalid, left padding, several chunks and a sliding window. Padding queries read nothing (zeros)."""

from __future__ import annotations

import pytest
import torch

from hf_kvgov.engine.slots.slot_attention import attend_slots

BATCH, KV_HEADS, GROUP, DIM = 2, 2, 3, 8
SCALE = DIM**-0.5


def definition(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(`[batch, q_len, q_heads, dim]`, probabilities `[batch, q_heads, q_len, slots]`); `allowed` `[batch, kv_heads,
    q_len, slots]`; a query allowed nothing reads 0."""
    k, v = (t.double().repeat_interleave(GROUP, dim=1) for t in (keys, values))
    mask = allowed.repeat_interleave(GROUP, dim=1)
    logits = (query.double() @ k.transpose(-1, -2) * SCALE).masked_fill(~mask, float("-inf"))
    probs = torch.nan_to_num(logits.softmax(dim=-1), nan=0.0)
    return (probs @ v).transpose(1, 2), probs


def case(kept: int, q_len: int, padding: int, window: int | None, bidirectional: int = 0):  # type: ignore[no-untyped-def]
    generator = torch.Generator().manual_seed(kept * 100 + q_len)
    query = torch.randn(BATCH, KV_HEADS * GROUP, q_len, DIM, generator=generator)
    keys = torch.randn(BATCH, KV_HEADS, kept + q_len, DIM, generator=generator)
    values = torch.randn(BATCH, KV_HEADS, kept + q_len, DIM, generator=generator)
    kept_valid = torch.rand(BATCH, KV_HEADS, kept, generator=generator) > 0.3  # heads keep different slots
    real = torch.ones(BATCH, q_len, dtype=torch.bool)
    real[1, :padding] = False  # row 1's first tokens are padding
    causal = torch.ones(q_len, q_len, dtype=torch.bool).tril()
    if window is not None:  # the new slots' window is the caller's mask, as transformers' sliding mask is
        causal &= torch.arange(q_len)[None, :] > torch.arange(q_len)[:, None] - window
    causal[:bidirectional, :bidirectional] = True  # the first tokens read each other (a prefix-LM mask)
    new_part = causal & real[:, None, :] & real[:, :, None]  # [batch, q_len, q_len]
    new_mask = new_part if padding or window is not None or bidirectional else None
    positions = torch.arange(kept + q_len).expand(BATCH, KV_HEADS, -1)  # kept slots at 0..kept-1, then the new
    old_part = kept_valid[:, :, None, :] & real[:, None, :, None]
    if window is not None:
        old_part &= positions[:, :, None, :kept] > positions[:, :, kept:, None] - window
    allowed = torch.cat((old_part, new_part[:, None].expand(BATCH, KV_HEADS, q_len, q_len)), dim=-1)
    windowing = None if window is None else (window, positions)
    return (query, keys, values, kept_valid, new_mask, windowing), allowed


@pytest.mark.parametrize(
    ("want_scores", "recent_queries"),
    [(True, 0), (False, 0), (False, 3), (False, 20)],
    ids=["explicit logits", "fused", "fused, then the last 3 queries explicit", "more last queries than queries"],
)
@pytest.mark.parametrize(
    ("kept", "q_len", "padding", "window", "bidirectional"),
    [(0, 13, 0, None, 0), (0, 13, 4, None, 0), (9, 13, 4, None, 0), (9, 1, 0, None, 0), (9, 13, 0, 6, 0),
     (0, 13, 3, 5, 0), (9, 13, 0, None, 7)],
    ids=["first causal chunk", "first chunk, padding", "kept and padding", "decode", "window", "window, padding",
         "first queries read later slots"],
)  # fmt: skip
def test_every_path_equals_the_definition(
    want_scores: bool, recent_queries: int, kept: int, q_len: int, padding: int, window: int | None, bidirectional: int
) -> None:
    """Chunks of 5 queries: a causal chunk reads no slot past its last query, and a chunk whose queries read later
    slots (7 tokens that read each other, across the first chunk's end) reads them."""
    (query, keys, values, kept_valid, new_mask, windowing), allowed = case(kept, q_len, padding, window, bidirectional)
    scores = torch.zeros(BATCH, KV_HEADS, kept) if want_scores else None
    out, mass, recent = attend_slots(
        query, keys, values, kept_valid, new_mask, SCALE, scores=scores, want_scores=want_scores,
        recent_queries=recent_queries, chunk=5, window=windowing,
    )  # fmt: skip
    expected, probs = definition(query, keys, values, allowed)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    per_kv_head = probs.view(BATCH, KV_HEADS, GROUP, q_len, -1).sum(dim=2)  # [batch, kv_heads, q_len, slots]
    assert (mass is not None) == want_scores
    if want_scores:
        torch.testing.assert_close(mass.double(), per_kv_head.sum(dim=2), rtol=1e-5, atol=1e-5)
    if recent_queries:
        last = per_kv_head[:, :, max(q_len - recent_queries, 0) :].sum(dim=2)
        torch.testing.assert_close(recent.double(), last, rtol=1e-5, atol=1e-5)
    else:
        assert recent is None
    if padding:
        assert torch.equal(out[1, :padding], torch.zeros_like(out[1, :padding]))
