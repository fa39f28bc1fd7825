"""Prefix reuse for `PagedCache`: fill a cache from the prefix tree, publish what it computed.

    prefix = PrefixCache(pool)
    cache = PagedCache(model, prefix=prefix, namespace="tenant-a")
    inputs = cache.match(input_ids, attention_mask)      # cached prefix already in the cache
    out = model.generate(**inputs, past_key_values=cache)  # computes only the uncached suffix
    cache.publish(out)                                    # prompt + answer blocks, for the next turn
    cache.release()

`match` always leaves at least one prompt token uncached: generate needs one to produce logits, and a
cache holding the whole prompt would make it re-feed everything (see DESIGN.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hf_kvgov.hf.prefix_layout import RowLayout, layouts, middle_padded, publishable_tokens, real_tokens
from hf_kvgov.storage.block_table import BlockTable

if TYPE_CHECKING:
    from hf_kvgov.hf.paged_cache import PagedCache
    from hf_kvgov.prefix.sharing import PrefixCache


def match(
    cache: PagedCache,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    pad_token_id: int = 0,
) -> dict[str, torch.Tensor]:
    """Put each row's longest cached prefix into this (empty) cache; return generate's inputs.

    Args:
        input_ids, attention_mask: long `[batch, length]`, left-padded as a tokenizer returns them.
    Returns:
        `{"input_ids", "attention_mask"}` to pass to `generate` (or the model) with this cache.
        When no row hits, these are the inputs unchanged.
    """
    prefix = _require_prefix(cache, "match")
    if cache.get_seq_length() or (cache.tables is not None and cache.tables.rows):
        raise ValueError("match() needs an empty cache; call it before generate, or reset() first.")
    rows = real_tokens(input_ids, attention_mask)
    hits = [prefix.match(tokens, cache.namespace, max_tokens=len(tokens) - 1) for tokens in rows]
    cache._prefix_locks.extend(block for hit in hits for block in hit)
    plan = layouts(rows, [len(hit) * prefix.block_size for hit in hits])
    if not any(hits):
        cache._row_layouts = plan if attention_mask is None else _left_padded(rows, input_ids.shape[1])
        return {"input_ids": input_ids, "attention_mask": _ones_like(input_ids, attention_mask)}
    _fill_from_hits(cache, hits, plan)
    cache._row_layouts = plan
    ids, mask = middle_padded(plan, pad_token_id)
    return {"input_ids": ids.to(input_ids.device), "attention_mask": mask.to(input_ids.device)}


def _fill_from_hits(cache: PagedCache, hits: list[list[int]], plan: list[RowLayout]) -> None:
    assert cache.pool is not None and cache.tables is not None
    bs = cache.pool.block_size
    longest = max(row.cached for row in plan)
    pads = [(longest - row.cached) // bs for row in plan]
    fresh = iter(cache.pool.allocate(sum(pads)))  # all-or-nothing, like every allocation
    cache.tables.rows = []
    for hit, count in zip(hits, pads, strict=True):
        pad_blocks = [next(fresh) for _ in range(count)]
        cache.pool.zero_blocks(pad_blocks)  # masked, but must never hold stale non-finite values
        cache.tables.rows.append(BlockTable(cache.pool, hit + pad_blocks))
    cache.tables.num_tokens = longest
    cache.tables._changed()
    for paged_layer in cache.layers:
        paged_layer.length = longest  # type: ignore[union-attr]
    cache._expand_rows_on_next_forward = True


def publish(cache: PagedCache, sequences: torch.Tensor, attention_mask: torch.Tensor | None = None) -> int:
    """Offer this cache's full blocks (prompt and generated tokens) to the prefix tree.

    Args:
        sequences: long `[batch, length]` — what generate returned (the cache holds its first
            `get_seq_length()` tokens), one row per cache row.
        attention_mask: the prompt's mask, needed only when `match` was not called and the rows are
            left-padded: a row's blocks are published only up to its first padded slot, since
            blocks after padding hold keys at positions that differ from their slots.
    Returns:
        The number of blocks offered.
    """
    prefix = _require_prefix(cache, "publish")
    if cache.tables is None or not cache.tables.rows:
        return 0
    if sequences.shape[0] != cache.tables.batch_size:
        raise ValueError(
            f"publish() needs one sequence per cache row: the cache holds {cache.tables.batch_size} rows, "
            f"got {sequences.shape[0]} (beam search returns only the best beams; publish those caches' "
            "rows before generate reorders them, or use one cache per request)."
        )
    first_pads = _first_pads(cache, sequences, attention_mask)
    stored, offered = cache.get_seq_length(), 0
    for row, sequence, first_pad in zip(cache.tables.rows, sequences, first_pads, strict=True):
        tokens = publishable_tokens(sequence, stored, first_pad)
        if len(tokens) < prefix.block_size:
            continue
        row.block_ids, locked = prefix.publish(tokens, row.block_ids, cache.namespace)
        cache._prefix_locks.extend(locked)
        offered += len(locked)
    cache.tables._changed()
    return offered


def _first_pads(cache: PagedCache, sequences: torch.Tensor, mask: torch.Tensor | None) -> list[int | None]:
    if mask is not None:
        return [None if bool(row.all()) else int((row == 0).nonzero()[0]) for row in mask]
    if cache._row_layouts is not None and len(cache._row_layouts) == sequences.shape[0]:
        return [row.first_pad for row in cache._row_layouts]
    return [None] * sequences.shape[0]


def _require_prefix(cache: PagedCache, action: str) -> PrefixCache:
    if cache.prefix is None:
        raise ValueError(f"{action}() needs a prefix cache: build PagedCache(model, prefix=PrefixCache(pool)).")
    return cache.prefix


def release_prefix_locks(cache: PagedCache) -> None:
    if cache.prefix is not None and cache._prefix_locks:
        cache.prefix.unlock(cache._prefix_locks)
    cache._prefix_locks = []
    cache._row_layouts = None


def _left_padded(rows: list[list[int]], width: int) -> list[RowLayout]:
    return [RowLayout(tokens, 0, 0 if len(tokens) < width else None) for tokens in rows]


def _ones_like(input_ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return mask if mask is not None else torch.ones_like(input_ids)
