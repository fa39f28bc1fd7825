"""Prefix reuse for `PagedCache`: fill a cache from the prefix tree, publish what it computed.

    cache = PagedCache(model, prefix=PrefixCache(pool), namespace="tenant-a")
    out = model.generate(**cache.match(input_ids, attention_mask), cache=cache)  # only the uncached suffix
    cache.publish(out); cache.release()                  # prompt + answer blocks, for the next turn

`match` always leaves at least one prompt token uncached: generate needs one to produce logits, and a cache holding
the whole prompt would make it re-feed everything. Pools with layer groups are served by
`hf_kvgov.engine.prefix_groups`. A cache that stores blocks differently (`QuantizedCache`) passes its own
`namespace`, so that such caches never share one, and `sealed_from`: full-precision blocks from that column on are
offered to the tree as sealed copies, so the tree holds codes while the cache keeps what it reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hf_kvgov.engine import prefix_groups
from hf_kvgov.engine.prefix_layout import (
    RowLayout,
    layouts,
    middle_padded,
    padding_inside_a_window,
    publishable_tokens,
    real_tokens,
)
from hf_kvgov.errors import PoolExhausted
from hf_kvgov.storage.block_table import BlockTable, BlockTables
from hf_kvgov.storage.quantized_pool import QuantizedBlockPool, is_sealed

if TYPE_CHECKING:
    from hf_kvgov.engine.block_store import BlockStore
    from hf_kvgov.prefix.sharing import PrefixCache


def match(
    cache: BlockStore,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    pad_token_id: int = 0,
    namespace: str | None = None,
) -> dict[str, torch.Tensor]:
    """Put each row's longest cached prefix into this (empty) cache; return generate's inputs.

    Args:
        input_ids, attention_mask: long `[batch, length]`, left-padded as a tokenizer returns them.
        namespace: the tree namespace to look in (default: `cache.namespace`).
    Returns:
        `{"input_ids", "attention_mask"}` to pass to `generate` (or the model) with this cache.
        When no row hits, these are the inputs unchanged.
    """
    prefix = _require_prefix(cache, "match")
    if cache.stored_tokens() or (cache.tables is not None and cache.tables.rows):
        raise ValueError("match() needs an empty cache; call it before generate, or reset() first.")
    rows = real_tokens(input_ids, attention_mask)
    space = cache.namespace if namespace is None else namespace
    if prefix.grouped is not None:
        grouped_hits = prefix_groups.match_rows(cache, rows, space)
        hit_blocks = [len(entries) for entries, _ in grouped_hits]
    else:
        hits = [prefix.match(tokens, space, max_tokens=len(tokens) - 1) for tokens in rows]
        cache.prefix_locks.extend(block for hit in hits for block in hit)
        hit_blocks = [len(hit) for hit in hits]
    plan = layouts(rows, [count * prefix.block_size for count in hit_blocks])
    reason = padding_inside_a_window(plan, cache.windows) if any(hit_blocks) else None
    if reason is not None:
        assert cache.pool is not None
        if prefix.grouped is not None:
            held = [block for _, tables in grouped_hits for table in tables for block in table if block is not None]
        else:
            held = [block for hit in hits for block in hit]
        cache.pool.decref(held)  # no table holds them yet
        release_prefix_locks(cache)
        raise ValueError(
            f"match() cannot serve this batch exactly: {reason}. Match rows of one length together, or each row "
            "alone, or serve the requests with hf_kvgov.serving.ServingEngine, whose rows carry no padding."
        )
    if not any(hit_blocks):
        cache.row_layouts = plan if attention_mask is None else _left_padded(rows, input_ids.shape[1])
        return {"input_ids": input_ids, "attention_mask": _ones_like(input_ids, attention_mask)}
    if prefix.grouped is not None:
        prefix_groups.fill_from_hits(cache, grouped_hits, plan)
        _set_lengths(cache, max(row.cached for row in plan))
    else:
        _fill_from_hits(cache, hits, plan)
    cache.row_layouts = plan
    ids, mask = middle_padded(plan, pad_token_id)
    return {"input_ids": ids.to(input_ids.device), "attention_mask": mask.to(input_ids.device)}


def _fill_from_hits(cache: BlockStore, hits: list[list[int]], plan: list[RowLayout]) -> None:
    assert cache.pool is not None and cache.tables is not None
    bs = cache.pool.block_size
    longest = max(row.cached for row in plan)
    pads = [(longest - row.cached) // bs for row in plan]
    try:
        fresh = iter(cache.pool.allocate(sum(pads)))  # all-or-nothing, like every allocation
    except PoolExhausted:
        cache.pool.decref([block for hit in hits for block in hit])  # no table holds them yet
        raise
    cache.tables.rows = []
    for hit, count in zip(hits, pads, strict=True):
        pad_blocks = [next(fresh) for _ in range(count)]
        cache.pool.zero_blocks(pad_blocks)  # masked, but must never hold stale non-finite values
        cache.tables.rows.append(BlockTable(cache.pool, hit + pad_blocks))
    cache.tables.num_tokens = longest
    cache.tables.invalidate_views()
    _set_lengths(cache, longest)


def _set_lengths(cache: BlockStore, tokens: int) -> None:
    """Every layer holds `tokens` tokens after a hit; generate's first forward expands the rows it asks for."""
    for layer in cache.store_layers:
        layer.length = tokens
    cache.expand_rows_on_next_forward = True


def publish(
    cache: BlockStore,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    namespace: str | None = None,
    sealed_from: int | None = None,
) -> int:
    """Offer this cache's full blocks (prompt and generated tokens) to the prefix tree.

    Args:
        sequences: long `[batch, length]` — what generate returned (the cache holds its first
            `get_seq_length()` tokens), one row per cache row.
        attention_mask: the prompt's mask, needed only when `match` was not called and the rows are
            left-padded: a row's blocks are published only up to its first padded slot, since
            blocks after padding hold keys at positions that differ from their slots.
        namespace: the tree namespace to publish under (default: `cache.namespace`).
        sealed_from: offer full-precision blocks from this block column on as sealed copies (the cache's
            pool must be a `QuantizedBlockPool`); None offers every block as it is.
    Returns:
        The number of blocks offered.
    """
    _require_prefix(cache, "publish")
    if cache.tables is None or not cache.tables.rows:
        return 0
    if sequences.shape[0] != cache.tables.batch_size:
        raise ValueError(
            f"publish() needs one sequence per cache row: the cache holds {cache.tables.batch_size} rows, "
            f"got {sequences.shape[0]} (beam search returns only the best beams; publish those caches' "
            "rows before generate reorders them, or use one cache per request)."
        )
    stored = cache.stored_tokens()
    first_pads = first_pads_of(cache, sequences, attention_mask)
    pairs = zip(sequences, first_pads, strict=True)
    rows = [publishable_tokens(sequence, stored, first_pad) for sequence, first_pad in pairs]
    return publish_tokens(cache, rows, cache.namespace if namespace is None else namespace, sealed_from)


def publish_tokens(
    cache: BlockStore,
    rows: list[list[int]],
    namespace: str,
    sealed_from: int | None = None,
    sliding_only: bool = False,
) -> int:
    """`publish` of each row's publishable tokens `rows[r]` (its full blocks are offered); returns blocks offered.

    `sliding_only`: over layer groups, offer only the sliding groups' blocks (the prompt as computed).
    """
    prefix = _require_prefix(cache, "publish")
    assert cache.tables is not None
    offered_tables = [t for t in cache.all_tables if not sliding_only or (t.group and t.group.window is not None)]
    copies = _swap_in_sealed_copies(cache, sealed_from, rows, offered_tables) if sealed_from is not None else []
    offered = 0
    try:
        if prefix.grouped is not None:
            return prefix_groups.publish_rows(cache, rows, namespace, offered_tables)
        for row, tokens in zip(cache.tables.rows, rows, strict=True):
            if len(tokens) < prefix.block_size:
                continue
            row.block_ids, locked = prefix.publish(tokens, row.block_ids, namespace)
            cache.prefix_locks.extend(locked)
            offered += len(locked)
    finally:
        _restore_full_precision(cache, copies)
        for tables in cache.all_tables:
            tables.invalidate_views()
    return offered


# (row, block column, the row's own full-precision block) for each block offered as a sealed copy.
_Copies = list[tuple[BlockTable, int, int]]


def _swap_in_sealed_copies(
    cache: BlockStore, first_column: int, rows: list[list[int]], offered: list[BlockTables]
) -> _Copies:
    """Put a sealed copy in each table in place of the full-precision blocks from `first_column` it publishes.

    `rows` are the tokens each row publishes (its full blocks are offered), `offered` the groups' tables offered.

    Such blocks are the newest full ones (a quantized cache's residual window): the cache keeps reading them
    in full precision, but the tree would otherwise hold them in full precision for as long as it caches
    them, taking room in the capped full-precision part from the rows being computed, and each request
    that matched them would seal its own copy. One encode here gives the tree codes that all requests share.
    """
    pool = cache.pool
    assert isinstance(pool, QuantizedBlockPool) and cache.tables is not None, "sealed copies need a quantized pool"
    spots = [
        (row, c)
        for tables in offered  # every offered group's rows (a sliding row only from what it still holds)
        for row, tokens in zip(tables.rows, rows, strict=True)
        for c in range(max(first_column, row.freed), len(tokens) // pool.block_size)
        if not is_sealed(row.block_ids[c])
    ]
    kept = [row.block_ids[c] for row, c in spots]
    pool.incref(kept)  # the reference `seal` moves to the copy; the row's own stays on its block
    for (row, c), copy in zip(spots, pool.seal(kept), strict=True):
        row.block_ids[c] = copy
    return [(row, c, block) for (row, c), block in zip(spots, kept, strict=True)]


def _restore_full_precision(cache: BlockStore, copies: _Copies) -> None:
    """Give each row its own full-precision block back; the tree keeps its reference to the copy it cached."""
    if not copies:
        return
    assert cache.pool is not None
    offered = [row.block_ids[c] for row, c, _ in copies]
    for row, c, block in copies:
        row.block_ids[c] = block
    cache.pool.decref(offered)


def first_pads_of(cache: BlockStore, sequences: torch.Tensor, mask: torch.Tensor | None) -> list[int | None]:
    if mask is not None:
        return [None if bool(row.all()) else int((row == 0).nonzero()[0]) for row in mask]
    if cache.row_layouts is not None and len(cache.row_layouts) == sequences.shape[0]:
        return [row.first_pad for row in cache.row_layouts]
    return [None] * sequences.shape[0]


def _require_prefix(cache: BlockStore, action: str) -> PrefixCache:
    if cache.prefix is None:
        raise ValueError(f"{action}() needs a prefix cache: build PagedCache(model, prefix=PrefixCache(pool)).")
    return cache.prefix


def release_prefix_locks(cache: BlockStore) -> None:
    if cache.prefix is not None and cache.prefix_locks:
        cache.prefix.unlock(cache.prefix_locks)
    cache.prefix_locks = []
    cache.row_layouts = None
    cache.published_blocks = 0


def _left_padded(rows: list[list[int]], width: int) -> list[RowLayout]:
    return [RowLayout(tokens, 0, 0 if len(tokens) < width else None) for tokens in rows]


def _ones_like(input_ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return mask if mask is not None else torch.ones_like(input_ids)
