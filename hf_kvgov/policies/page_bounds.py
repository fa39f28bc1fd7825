"""Quest's page bound: how much a query can attend to a page of keys, from the page's per-channel min/max.

For a query ``q`` and a page whose keys lie in the box ``min <= k <= max`` (per channel), no key scores more than::

    bound(q, page) = sum_d max(q_d * min_d, q_d * max_d) = q+ . max + q- . min      (q+ = max(q, 0), q- = min(q, 0))

(Tang et al., 2024, "Quest"). It is two matrix products, so ranking thousands of pages per step is cheap, and exact
for a page of one key; `Recall(summary="bounds")` ranks by it (`hf_kvgov.engine.slots.recall`). It sums a worst
case over every channel, so with wide heads (Gemma-3's 256 channels) a page whose keys spread widely outranks the
page a query really attends to; the centroid score ``q . mean(k)`` (`page_centroid_scores`) is no bound but tracks
where attention goes, so it is the recall tier's default (eval/RESULTS.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

QUERY_ROWS = 1024  # query rows (query heads x queries) bounded at a time: memory O(rows x pages)


def page_upper_bounds(query: Tensor, page_min: Tensor, page_max: Tensor, valid: Tensor) -> Tensor:
    """The most any query of a KV head's group can score on each of its pages (before scaling).

    Args:
        query: ``[batch, q_heads, q_len, head_dim]`` after RoPE; query head ``i`` reads KV head
            ``i // (q_heads // kv_heads)`` (transformers' ``repeat_kv`` layout).
        page_min, page_max: ``[batch, kv_heads, pages, head_dim]``: each page's per-channel key range.
        valid: bool ``[batch, kv_heads, pages]``: pages that may be recalled (False: empty table slots).

    Returns:
        float ``[batch, kv_heads, pages]``: the largest ``bound(q, page)`` over the group's query heads and
        the step's queries; ``-inf`` where ``valid`` is False.
    """
    q_heads, head_dim = query.shape[1], query.shape[-1]
    kv_heads = page_min.shape[1]
    if page_min.shape != page_max.shape or page_min.shape[-1] != head_dim or q_heads % kv_heads:
        raise ValueError(
            f"page bounds need query [batch, q_heads, q_len, head_dim] and page ranges [batch, kv_heads, pages, "
            f"head_dim] with q_heads a multiple of kv_heads; got query {tuple(query.shape)}, min "
            f"{tuple(page_min.shape)}, max {tuple(page_max.shape)}."
        )
    work = torch.promote_types(query.dtype, torch.float32)
    low, high = page_min.to(work).transpose(-1, -2), page_max.to(work).transpose(-1, -2)  # [b, hk, d, pages]
    return _best_over_group(query, kv_heads, valid, lambda rows: rows.clamp(min=0) @ high + rows.clamp(max=0) @ low)


def page_centroid_scores(query: Tensor, centroids: Tensor, valid: Tensor) -> Tensor:
    """The largest ``q . mean(k)`` over a KV head's group of query heads and the step's queries, per page.

    Args:
        query: ``[batch, q_heads, q_len, head_dim]`` after RoPE (the layout of `page_upper_bounds`).
        centroids: ``[batch, kv_heads, pages, head_dim]``: each page's mean key.
        valid: bool ``[batch, kv_heads, pages]``.

    Returns:
        float ``[batch, kv_heads, pages]``; ``-inf`` where ``valid`` is False.
    """
    q_heads, head_dim = query.shape[1], query.shape[-1]
    kv_heads = centroids.shape[1]
    if centroids.shape[-1] != head_dim or q_heads % kv_heads:
        raise ValueError(
            f"page centroid scores need query [batch, q_heads, q_len, head_dim] and centroids [batch, kv_heads, "
            f"pages, head_dim] with q_heads a multiple of kv_heads; got query {tuple(query.shape)}, centroids "
            f"{tuple(centroids.shape)}."
        )
    means = centroids.to(torch.promote_types(query.dtype, torch.float32)).transpose(-1, -2)  # [b, hk, d, pages]
    return _best_over_group(query, kv_heads, valid, lambda rows: rows @ means)


def _best_over_group(query: Tensor, kv_heads: int, valid: Tensor, score: Callable[[Tensor], Tensor]) -> Tensor:
    """The largest ``score(rows)`` ``[b, hk, rows, pages]`` over each KV head's query rows (its group's query heads
    times the step's queries, `QUERY_ROWS` at a time, in float32 or wider); ``-inf`` where ``valid`` is False."""
    batch, q_heads, q_len, head_dim = query.shape
    work = torch.promote_types(query.dtype, torch.float32)
    rows = query.reshape(batch, kv_heads, (q_heads // kv_heads) * q_len, head_dim).to(work)
    best = torch.full(valid.shape, float("-inf"), dtype=work, device=query.device)
    for start in range(0, rows.shape[2], QUERY_ROWS):
        best = torch.maximum(best, score(rows[:, :, start : start + QUERY_ROWS]).amax(dim=2))
    return best.masked_fill(~valid, float("-inf"))
