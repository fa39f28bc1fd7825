"""Attention over block tables in plain torch: the specification every fast kernel is tested against.

Keys are never gathered into one copy of the whole cache: they are read in chunks of whole blocks (at most
`chunk_tokens` tokens) and combined with an online softmax, as FlashAttention does across tiles (`chunked_attention`),
so peak extra memory is O(batch × heads × queries × chunk_tokens) whatever the context length. GQA groups the
query heads of each KV head, never repeating K/V.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hf_kvgov.kernels.sinks import checked_sinks

DEFAULT_CHUNK_TOKENS = 2048


def paged_attention_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_length: int,
    scale: float,
    mask: torch.Tensor | None = None,
    softcap: float | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of `query` over the first `kv_length` tokens held by `block_table`.

    Args:
        query: `[batch, q_heads, q_len, head_dim]`; the queries are the last `q_len` of the `kv_length`
            tokens when `mask` is None (causal), or any positions when a mask is given.
        key_cache, value_cache: `[num_blocks, block_size, kv_heads, head_dim]` (one layer of the pool).
        block_table: long `[batch, blocks]` with `blocks * block_size >= kv_length`.
        mask: `[batch, 1, q_len, kv_length]`, bool (True = attend) or additive float; None means causal.
        softcap: optional tanh soft-capping of the logits (Gemma-2 style).
        sinks: optional learned sink logit per query head `[q_heads]` (GPT-OSS, transformers' ``s_aux``): it joins
            each softmax's denominator and reads no value.
    Returns:
        `[batch, q_len, q_heads, head_dim]` (the layout transformers' attention functions return).
    """
    block_size = key_cache.shape[1]

    def read(first: int, num_blocks: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _read_chunk(key_cache, value_cache, block_table, first, num_blocks, length)

    kv_heads = key_cache.shape[2]
    return chunked_attention(query, kv_heads, block_size, kv_length, read, scale, mask, softcap, chunk_tokens, sinks)


# read(first block, number of blocks, tokens) -> K, V float32 `[batch, kv_heads, tokens, head_dim]`.
ChunkReader = Callable[[int, int, int], tuple[torch.Tensor, torch.Tensor]]


def chunked_attention(
    query: torch.Tensor,
    kv_heads: int,
    block_size: int,
    kv_length: int,
    read_chunk: ChunkReader,
    scale: float,
    mask: torch.Tensor | None,
    softcap: float | None,
    chunk_tokens: int,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The online softmax over chunks of whole blocks that every torch reference shares; how a chunk's
    K/V are read (full-precision blocks, or sealed ones decoded) is `read_chunk`'s business::

        m, l, acc = sink, 1, 0                  (without sinks: -inf, 0, 0)
        for each chunk c of blocks:
            s_c   = q · k_cᵀ · scale            (masked entries = -inf)
            m_new = max(m, rowmax(s_c))
            l     = l · e^(m - m_new) + rowsum(e^(s_c - m_new))
            acc   = acc · e^(m - m_new) + e^(s_c - m_new) · v_c
        out = acc / l

    Returns `[batch, q_len, q_heads, head_dim]` in the query's dtype (math in float32).
    """
    batch, q_heads, q_len, head_dim = query.shape
    if q_heads % kv_heads:
        raise ValueError(f"q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads}) for grouped attention.")
    group = q_heads // kv_heads
    # [batch, kv_heads, group * q_len, head_dim]: the queries of one KV head side by side.
    q = query.reshape(batch, kv_heads, group * q_len, head_dim).float()
    m = torch.full((batch, kv_heads, group * q_len, 1), float("-inf"), device=query.device)
    denom = torch.zeros_like(m)
    if sinks is not None:  # a sink is a logit with no value: it starts the running max and denominator
        per_row = checked_sinks(sinks, q_heads, query.device).view(kv_heads, group, 1).expand(kv_heads, group, q_len)
        m = per_row.reshape(1, kv_heads, group * q_len, 1).expand(batch, -1, -1, -1).clone()
        denom = torch.ones_like(m)
    acc = torch.zeros((batch, kv_heads, group * q_len, head_dim), device=query.device)
    blocks_per_chunk = max(1, chunk_tokens // block_size)
    for first in range(0, -(-kv_length // block_size), blocks_per_chunk):
        start = first * block_size
        stop = min(kv_length, start + blocks_per_chunk * block_size)
        k, v = read_chunk(first, blocks_per_chunk, stop - start)
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = _apply_mask(scores, mask, start, stop, kv_length, group, q_len)
        m, denom, acc = _online_softmax_step(scores, v, m, denom, acc)
    out = acc / denom.clamp_min(torch.finfo(acc.dtype).tiny)
    out = out.reshape(batch, q_heads, q_len, head_dim).transpose(1, 2)
    return out.to(query.dtype)


def _read_chunk(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    first: int,
    num_blocks: int,
    length: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of `num_blocks` blocks from block `first` on, as `[batch, kv_heads, length, head_dim]`."""
    ids = block_table[:, first : first + num_blocks]
    batch, n = ids.shape
    _, block_size, kv_heads, head_dim = key_cache.shape
    shape = (batch, n * block_size, kv_heads, head_dim)
    k = key_cache.index_select(0, ids.reshape(-1)).view(shape)[:, :length].transpose(1, 2).float()
    v = value_cache.index_select(0, ids.reshape(-1)).view(shape)[:, :length].transpose(1, 2).float()
    return k, v


def _apply_mask(
    scores: torch.Tensor,
    mask: torch.Tensor | None,
    start: int,
    stop: int,
    kv_length: int,
    group: int,
    q_len: int,
) -> torch.Tensor:
    """Mask one chunk of scores `[batch, kv_heads, group * q_len, chunk]`."""
    if mask is None:
        if q_len == 1:
            return scores
        query_pos = torch.arange(kv_length - q_len, kv_length, device=scores.device)
        key_pos = torch.arange(start, stop, device=scores.device)
        allowed = (key_pos[None, :] <= query_pos[:, None]).repeat(group, 1)
        return scores.masked_fill(~allowed, float("-inf"))
    chunk = mask[..., start:stop]  # [batch, 1, q_len, chunk]
    chunk = chunk.unsqueeze(2).expand(-1, -1, group, -1, -1).reshape(chunk.shape[0], 1, group * q_len, -1)
    if chunk.dtype == torch.bool:
        return scores.masked_fill(~chunk, float("-inf"))
    return scores + chunk.float()


def _online_softmax_step(
    scores: torch.Tensor,
    v: torch.Tensor,
    m: torch.Tensor,
    denom: torch.Tensor,
    acc: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m_new = torch.maximum(m, scores.amax(dim=-1, keepdim=True))
    # Rows with every key masked so far have m_new = -inf; shift by 0 there to avoid inf - inf.
    shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
    p = torch.exp(scores - shift)
    correction = torch.exp(m - shift)
    denom = denom * correction + p.sum(dim=-1, keepdim=True)
    acc = acc * correction + torch.matmul(p, v)
    return m_new, denom, acc
