"""Attention over an eviction cache's slots, with each KV head keeping different tokens.

After an eviction, KV head 0 of a row may keep tokens {0, 1, 7, 9} and head 1 {0, 4, 8, 9}, so no single
``[batch, 1, q_len, kv_len]`` mask (what transformers builds) can describe them. The cache knows instead, per slot,
the kept slots' validity and that the newest ``q_len`` slots are this step's tokens::

    slots of one (row, KV head):   kept slots (any order)  |  new slots (this step)
    query i attends to:            every valid kept slot   |  new slot j if j <= i and j is not padding

Queries go ``chunk`` at a time, so memory is O(chunk x slots) whatever the prompt length; each chunk's probabilities
feed :func:`hf_kvgov.policies.accumulate_attention`, so the mass (and the last queries' attention) is exact.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hf_kvgov.kernels.sinks import softmax_with_sinks
from hf_kvgov.policies import accumulate_attention

DEFAULT_QUERY_CHUNK = 256


def attend_slots(
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    kept_valid: Tensor,
    new_mask: Tensor | None,
    scale: float,
    *,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    scores: Tensor | None = None,
    want_scores: bool = False,
    recent_queries: int = 0,
    chunk: int = DEFAULT_QUERY_CHUNK,
    window: tuple[int, Tensor] | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Attention of this step's queries over kept + new slots, optionally with the attention facts.

    Explicit logits only where a fact needs them: queries whose weights no policy reads (no mass asked for, before
    the last ``recent_queries``) go through torch's fused sdpa.

    Args:
        query: ``[batch, q_heads, q_len, head_dim]`` after RoPE; query head ``i`` reads KV head
            ``i // (q_heads // kv_heads)`` (transformers' ``repeat_kv`` layout).
        keys, values: ``[batch, kv_heads, kept + q_len, head_dim]``: the kept slots, then the new ones.
        kept_valid: bool ``[batch, kv_heads, kept]``; False slots are never attended.
        new_mask: bool ``[batch, q_len, q_len]``: may query ``i`` attend new slot ``j`` (causal and padding,
            as transformers' sdpa mask builds it), or None for a plain causal mask without padding. A query
            whose own slot is masked (its diagonal entry is False) is padding and attends to nothing.
        scale: logit scale (usually ``head_dim ** -0.5``).
        softcap: optional logit soft-capping, ``softcap * tanh(logits / softcap)``.
        sinks: optional learned sink logit per query head ``[q_heads]`` (transformers' ``s_aux``): it joins each
            softmax's denominator, reads no value and is no slot's mass.
        scores: running mass ``[batch, kv_heads, kept]`` of the kept slots, or None (zero).
        want_scores: whether to return the updated mass.
        recent_queries: return the attention of the last ``recent_queries`` queries (0: do not).
        chunk: queries per chunk.
        window: for a sliding-window layer, ``(w, positions)`` with positions long ``[batch, kv_heads, kept +
            q_len]``: query at position ``q`` also needs kept slot position ``> q - w`` (transformers' sliding
            mask, which already limits the new slots ``new_mask``).

    Returns:
        ``[batch, q_len, q_heads, head_dim]`` in the query's dtype; the mass and the last queries' attention,
        each float ``[batch, kv_heads, kept + q_len]`` summed over a KV head's query heads, or None when not
        asked for. Padding queries return zeros and add nothing.
    """
    batch, q_heads, q_len, head_dim = query.shape
    kv_heads, slots = keys.shape[1], keys.shape[2]
    group = q_heads // kv_heads
    work = torch.promote_types(query.dtype, torch.float32)
    grouped = query.reshape(batch, kv_heads, group, q_len, head_dim).to(work)
    # A KV head's query heads and a chunk's queries go in one matrix, so each product reads K/V once: a product
    # broadcast over the query heads would first copy K and V once per query head.
    keys_w, vals = keys.to(work), values.to(work)  # [b, hk, slots, d]
    keys_t = keys_w.transpose(-1, -2)  # [b, hk, d, slots]
    out = torch.empty(batch, kv_heads, group, q_len, head_dim, dtype=work, device=query.device)
    first_recent = max(q_len - recent_queries, 0) if recent_queries else q_len
    explicit_from = 0  # the queries from here on attend through explicit logits
    if not want_scores and softcap is None and sinks is None:  # the queries before the last ones: fused
        _attend_fused(grouped, keys_w, vals, kept_valid, new_mask, scale, chunk, window, out, first_recent)
        explicit_from = first_recent
    running = scores if want_scores else None
    recent: Tensor | None = None
    for start in range(explicit_from, q_len, chunk):
        end = min(start + chunk, q_len)
        allowed = _chunk_allowed(kept_valid, new_mask, window, start, end, q_len)  # [b, hk, 1, c, seen]
        seen = allowed.shape[-1]
        size = end - start
        stacked = grouped[:, :, :, start:end].reshape(batch, kv_heads, group * size, head_dim)
        logits = (stacked @ keys_t[..., :seen]).view(batch, kv_heads, group, size, seen) * scale
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        probs = softmax_with_sinks(logits.masked_fill(~allowed, float("-inf")), sinks)
        # A row with every slot masked (a padding query) is NaN after softmax; it reads and adds nothing. Most
        # chunks have none, and on a CPU the check is cheaper than the rewrite of every probability (elsewhere it
        # would wait for the device, or find no values: the rewrite always runs there).
        reads = allowed.any(dim=-1, keepdim=True)
        if probs.device.type != "cpu" or not bool(reads.all()):
            probs = torch.where(reads, probs, 0.0)
        out[:, :, :, start:end] = (probs.reshape(batch, kv_heads, group * size, seen) @ vals[:, :, :seen]).view(
            batch, kv_heads, group, size, head_dim
        )
        weights = probs.reshape(batch, q_heads, size, seen)
        if want_scores:
            running = _add_mass(running, weights, group, slots)
        if end > first_recent:
            recent = _add_mass(recent, weights[:, :, max(first_recent - start, 0) :], group, slots)
    result = out.reshape(batch, q_heads, q_len, head_dim).transpose(1, 2).to(query.dtype)
    return result, running, recent


def _chunk_allowed(
    kept_valid: Tensor,
    new_mask: Tensor | None,
    window: tuple[int, Tensor] | None,
    start: int,
    end: int,
    q_len: int,
) -> Tensor:
    """Bool ``[batch, kv_heads, 1, end - start, seen]``: which slots queries ``start..end-1`` may read, over the
    kept slots and the new ones up to the last any of them reads: ``end`` under a causal mask (a chunk reads no
    later token), every new slot when a query reads a later one."""
    rows = _mask_rows(new_mask, start, end, q_len, kept_valid.shape[0], kept_valid.device)
    if new_mask is None or end == q_len or not bool(rows[:, :, end:].any()):
        rows = rows[:, :, :end]
    return _allowed(_in_window(kept_valid, window, start, end), rows, start)


def _add_mass(running: Tensor | None, weights: Tensor, group: int, slots: int) -> Tensor:
    """`accumulate_attention` for weights over the first of `slots` slots: the mass of every slot, ``[batch,
    kv_heads, slots]``, the later ones adding nothing (never a copy of the weights padded to `slots`)."""
    if weights.shape[-1] == slots:  # every slot (a decode step, a chunk that reads all): as it always was
        return accumulate_attention(running, weights, group)
    step = accumulate_attention(None, weights, group)
    step = torch.nn.functional.pad(step, (0, slots - step.shape[-1]))
    if running is None:
        return step
    total = running.to(torch.promote_types(running.dtype, step.dtype))
    return torch.nn.functional.pad(total, (0, slots - total.shape[-1])) + step


def _attend_fused(
    grouped: Tensor,
    keys: Tensor,
    values: Tensor,
    kept_valid: Tensor,
    new_mask: Tensor | None,
    scale: float,
    chunk: int,
    window: tuple[int, Tensor] | None,
    out: Tensor,
    until: int,
) -> None:
    """`attend_slots` for queries ``0..until-1``, of which no attention fact is asked: each chunk one fused
    attention (sinks and softcapping stay with the explicit logits), into ``out`` ``[batch, kv_heads, group, q_len,
    head_dim]``."""
    if until == 0:
        return
    batch, kv_heads, group, q_len, head_dim = grouped.shape
    slots = keys.shape[2]
    attention = torch.nn.functional.scaled_dot_product_attention
    if slots == q_len and new_mask is None and window is None:  # a first chunk, causal, no padding: no mask at all
        flat = grouped[:, :, :, :until].reshape(batch, kv_heads * group, until, head_dim)
        read = attention(
            flat, keys[:, :, :until], values[:, :, :until], is_causal=True, scale=scale, enable_gqa=group > 1
        )
        out[:, :, :, :until] = read.view(batch, kv_heads, group, until, head_dim)
        return
    for start in range(0, until, chunk):
        end = min(start + chunk, until)
        allowed = _chunk_allowed(kept_valid, new_mask, window, start, end, q_len)  # [b, hk, 1, c, seen]
        seen = allowed.shape[-1]
        size = end - start
        stacked = grouped[:, :, :, start:end].reshape(batch, kv_heads, group * size, head_dim)
        mask = allowed.expand(batch, kv_heads, group, size, seen).reshape(batch, kv_heads, group * size, seen)
        read = attention(stacked, keys[:, :, :seen], values[:, :, :seen], attn_mask=mask, scale=scale).view(
            batch, kv_heads, group, size, head_dim
        )
        reads = allowed.any(dim=-1, keepdim=True)  # a padding query reads nothing: zeros, as `attend_slots` gives
        if read.device.type != "cpu" or not bool(reads.all()):
            read = torch.where(reads, read, 0.0)
        out[:, :, :, start:end] = read


def new_tokens_valid(new_mask: Tensor | None, batch: int, q_len: int, device: torch.device) -> Tensor:
    """Bool ``[batch, q_len]``: which of this step's tokens are real (a token attends to itself unless padding)."""
    if new_mask is None:
        return torch.ones(batch, q_len, dtype=torch.bool, device=device)
    return new_mask.diagonal(dim1=-2, dim2=-1)


def _mask_rows(new_mask: Tensor | None, start: int, end: int, q_len: int, batch: int, device: torch.device) -> Tensor:
    """Bool ``[batch, end - start, q_len]``: the new-slot mask of queries ``start..end-1`` (causal if None)."""
    if new_mask is not None:
        return new_mask[:, start:end]
    rows = torch.arange(start, end, device=device)[:, None] >= torch.arange(q_len, device=device)[None, :]
    return rows.expand(batch, end - start, q_len)


def _in_window(kept_valid: Tensor, window: tuple[int, Tensor] | None, start: int, end: int) -> Tensor:
    """Bool ``[batch, kv_heads, kept]`` (any layer) or ``[batch, kv_heads, chunk, kept]`` (window layer):
    the kept slots that queries ``start..end-1`` may read."""
    if window is None:
        return kept_valid
    size, positions = window
    kept = kept_valid.shape[-1]
    queries = positions[:, :, kept + start : kept + end, None]  # [b, hk, c, 1]
    return kept_valid[:, :, None, :] & (positions[:, :, None, :kept] > queries - size)


def _allowed(kept_valid: Tensor, rows: Tensor, start: int) -> Tensor:
    """Bool ``[batch, kv_heads, 1, chunk, slots]``: which slots each query of the chunk may read.

    ``rows`` is the chunk's new-slot mask ``[batch, chunk, q_len]``; the chunk starts at query ``start``;
    ``kept_valid`` is ``[batch, kv_heads, kept]``, or ``[batch, kv_heads, chunk, kept]`` per query.
    """
    batch, kv_heads, kept = kept_valid.shape[0], kept_valid.shape[1], kept_valid.shape[-1]
    chunk = rows.shape[1]
    own = rows.diagonal(offset=start, dim1=-2, dim2=-1)  # [b, c]: is each query itself a real token
    per_query = kept_valid if kept_valid.dim() == 4 else kept_valid[:, :, None, :]
    old = per_query[:, :, None] & own[:, None, None, :, None]
    new = rows[:, None, None].expand(batch, kv_heads, 1, chunk, rows.shape[-1])
    return torch.cat((old.expand(batch, kv_heads, 1, chunk, kept), new), dim=-1)
