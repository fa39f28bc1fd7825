"""Accumulated attention mass per KV head: the score H2O ranks slots by.

Query head ``i`` reads KV head ``i // group_size`` (the layout of transformers' ``repeat_kv``), so the mass
of a KV head is the sum over its group of query heads and over query tokens of the softmax probabilities.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

MaskFn = Callable[[int, int], Tensor]


def accumulate_attention(
    scores: Tensor | None,
    attn_weights: Tensor,
    group_size: int,
    *,
    query_valid: Tensor | None = None,
) -> Tensor:
    """Add one attention step's mass to the running per-slot scores.

    Args:
        scores: running mass, float ``[batch, kv_heads, prev_slots]`` with ``prev_slots <= slots``, or
            None to start from zero. Slots ``prev_slots..slots-1`` are taken to be keys appended this step
            (same slot order as ``attn_weights``) and start at zero mass.
        attn_weights: probabilities ``[batch, q_heads, q_len, slots]`` after softmax, as eager attention
            returns them; ``q_heads = kv_heads * group_size``.
        group_size: query heads per KV head (1 for multi-head attention).
        query_valid: optional bool ``[batch, q_len]``; False rows (left-padding queries, whose softmax
            over a fully masked row is uniform in eager attention) add nothing.

    Returns:
        float ``[batch, kv_heads, slots]``: the updated mass, in float32 or wider (never the attention's
        bf16/fp16, so small per-step masses are not rounded away over a long decode).
    """
    _check_weights(attn_weights, group_size)
    batch, q_heads, q_len, slots = attn_weights.shape
    dtype = torch.promote_types(attn_weights.dtype, torch.float32)
    weights = attn_weights.to(dtype)
    if query_valid is not None:
        if query_valid.shape != (batch, q_len) or query_valid.dtype != torch.bool:
            raise ValueError(
                f"query_valid must be a bool tensor of shape {(batch, q_len)}; "
                f"got {query_valid.dtype} {tuple(query_valid.shape)}."
            )
        weights = weights * query_valid[:, None, :, None].to(dtype)
    step = weights.reshape(batch, q_heads // group_size, group_size * q_len, slots).sum(dim=2)
    if scores is None:
        return step
    _check_running(scores, step.shape)
    running = scores.to(torch.promote_types(scores.dtype, dtype))
    return torch.nn.functional.pad(running, (0, slots - scores.shape[-1])) + step


def attention_mass_chunked(
    query: Tensor,
    key: Tensor,
    scale: float | None = None,
    *,
    causal: bool = True,
    offset: int | None = None,
    key_valid: Tensor | None = None,
    mask_fn: MaskFn | None = None,
    softcap: float | None = None,
    chunk: int = 512,
) -> Tensor:
    """Attention mass of a whole prefill, computed ``chunk`` queries at a time.

    Equal, up to float rounding, to ``accumulate_attention(None, softmax(mask(q @ k^T * scale)), group)``,
    but never holds more than ``[batch, q_heads, chunk, k_len]`` logits: memory is O(chunk x keys), not
    O(q_len x keys).

    Args:
        query: ``[batch, q_heads, q_len, head_dim]`` (after RoPE).
        key: ``[batch, kv_heads, k_len, head_dim]`` (after RoPE); ``q_heads`` a multiple of ``kv_heads``.
        scale: logit scale; defaults to ``head_dim ** -0.5``.
        causal: query ``i`` sees key ``j`` only if ``j <= offset + i``.
        offset: absolute position of the first query among the keys; defaults to ``k_len - q_len``
            (the queries are the last ``q_len`` keys).
        key_valid: optional bool ``[batch, k_len]`` (a 2-D attention mask); False keys are masked.
        mask_fn: optional ``mask_fn(start, end)`` returning a bool mask broadcastable to
            ``[batch, q_heads, end - start, k_len]`` (True = attend) for queries ``start..end-1``, e.g. a
            sliding window. It is ANDed with the causal and key masks.
        softcap: optional logit soft-capping (``softcap * tanh(logits / softcap)``, Gemma-2 style).
        chunk: queries per chunk.

    Returns:
        float ``[batch, kv_heads, k_len]`` (float32 or wider). A query whose every key is masked (a
        left-padding query under a causal mask) adds nothing.
    """
    _check_query_key(query, key, chunk)
    batch, _, q_len, head_dim = query.shape
    if offset is not None and not causal:
        raise ValueError("offset only applies to a causal mask; pass causal=True or leave offset=None.")
    if key_valid is not None and (key_valid.shape != (batch, key.shape[2]) or key_valid.dtype != torch.bool):
        raise ValueError(
            f"key_valid must be a bool tensor of shape {(batch, key.shape[2])}; "
            f"got {key_valid.dtype} {tuple(key_valid.shape)}."
        )
    dtype = torch.promote_types(query.dtype, torch.float32)
    keys_t = key.to(dtype).transpose(-1, -2)
    first = key.shape[2] - q_len if offset is None else offset
    scale = head_dim**-0.5 if scale is None else scale
    mass = query.new_zeros(batch, key.shape[1], key.shape[2], dtype=dtype)
    for start in range(0, q_len, chunk):
        end = min(start + chunk, q_len)
        allowed = _chunk_mask(start, end, first if causal else None, key_valid, mask_fn, query, key)
        logits = _chunk_logits(query[:, :, start:end].to(dtype), keys_t, scale, softcap)
        mass += _chunk_mass(logits, allowed)
    return mass


def _chunk_logits(query: Tensor, keys_t: Tensor, scale: float, softcap: float | None) -> Tensor:
    """``[b, hq, c, d]`` queries x ``[b, hk, d, k]`` keys -> ``[b, hk, group, c, k]`` logits, without
    repeating keys per query head."""
    batch, q_heads, c, head_dim = query.shape
    kv_heads = keys_t.shape[1]
    grouped = query.reshape(batch, kv_heads, (q_heads // kv_heads) * c, head_dim)
    logits = (grouped @ keys_t) * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return logits.reshape(batch, kv_heads, q_heads // kv_heads, c, keys_t.shape[-1])


def _chunk_mask(
    start: int,
    end: int,
    first: int | None,
    key_valid: Tensor | None,
    mask_fn: MaskFn | None,
    query: Tensor,
    key: Tensor,
) -> Tensor | None:
    """Bool mask broadcastable to ``[b, hk, group, c, k]`` (True = attend), or None when nothing is masked."""
    batch, q_heads, _, _ = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    allowed: Tensor | None = None
    if first is not None:
        q_pos = torch.arange(first + start, first + end, device=query.device)
        allowed = torch.arange(k_len, device=query.device)[None, :] <= q_pos[:, None]
    if key_valid is not None:
        kv = key_valid[:, None, None, None, :]
        allowed = kv if allowed is None else allowed & kv
    if mask_fn is not None:
        custom = torch.broadcast_to(mask_fn(start, end), (batch, q_heads, end - start, k_len))
        custom = custom.reshape(batch, kv_heads, q_heads // kv_heads, end - start, k_len)
        allowed = custom if allowed is None else allowed & custom
    return allowed


def _chunk_mass(logits: Tensor, allowed: Tensor | None) -> Tensor:
    """Softmax over keys, then sum over the query heads of a group and over queries -> ``[b, hk, k]``."""
    if allowed is None:
        return logits.softmax(dim=-1).sum(dim=(2, 3))
    probs = logits.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    # A fully masked row is all -inf, whose softmax is NaN; it attends to nothing, so it adds nothing.
    probs = torch.where(allowed.any(dim=-1, keepdim=True), probs, 0.0)
    return probs.sum(dim=(2, 3))


def _check_weights(attn_weights: Tensor, group_size: int) -> None:
    if attn_weights.dim() != 4:
        raise ValueError(
            f"attn_weights must have shape [batch, q_heads, q_len, slots]; got shape {tuple(attn_weights.shape)}."
        )
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int (query heads per KV head); got {group_size!r}.")
    if attn_weights.shape[1] % group_size:
        raise ValueError(
            f"attn_weights has {attn_weights.shape[1]} query heads, which is not a multiple of group_size={group_size}."
        )


def _check_running(scores: Tensor, step_shape: torch.Size) -> None:
    if scores.dim() != 3 or scores.shape[:2] != step_shape[:2] or scores.shape[2] > step_shape[2]:
        raise ValueError(
            f"scores of shape {tuple(scores.shape)} do not fit attention over {tuple(step_shape)} "
            "[batch, kv_heads, slots]: batch and kv_heads must match and scores may not hold more slots."
        )


def _check_query_key(query: Tensor, key: Tensor, chunk: int) -> None:
    if query.dim() != 4 or key.dim() != 4:
        raise ValueError(
            "query must be [batch, q_heads, q_len, head_dim] and key [batch, kv_heads, k_len, head_dim]; "
            f"got shapes {tuple(query.shape)} and {tuple(key.shape)}."
        )
    if query.shape[0] != key.shape[0] or query.shape[3] != key.shape[3] or query.shape[1] % key.shape[1]:
        raise ValueError(
            "query and key must share batch and head_dim, and q_heads must be a multiple of kv_heads; "
            f"got query {tuple(query.shape)} and key {tuple(key.shape)}."
        )
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive int number of queries; got {chunk!r}.")
