"""Prefix sharing for the disk caches: which blocks may spill, and what a publish must bring back first.

`DiskOffloadCache` (raw blocks) and `QuantizedDiskCache` (codes) share these rules. The tree hands the pool ids it
holds to any request that matches, so a block it holds must stay resident; a row's blocks split::

    row:   [ 0 | d1 d2 d3 (matched) | p4 p5 p6 p7 (private, cold) | p8 p9 (hot) | tail ]
             |        stay resident             spill to disk           stay resident
             +-- first block: read by every query, never worth a round trip

`private_blocks` keeps the tree's blocks resident; `bring_back_offered` says what a publish brings back first.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

import torch

from hf_kvgov.engine import paged_prefix
from hf_kvgov.engine.prefix_layout import publishable_tokens
from hf_kvgov.engine.quant_config import QuantConfig
from hf_kvgov.prefix.sharing import PrefixCache
from hf_kvgov.storage.block_table import BlockTable
from hf_kvgov.storage.pool import DEFAULT_BLOCK_SIZE, BlockPool
from hf_kvgov.storage.quantized_pool import QuantizedBlockPool
from hf_kvgov.tiers.moves import TierBlocks
from hf_kvgov.tiers.spill_config import Disk
from hf_kvgov.tiers.tiered_tables import TieredBlockTable, TieredBlockTables

if TYPE_CHECKING:
    from hf_kvgov.engine.block_store import BlockStore


def cache_block_size(
    prefix: PrefixCache | None, disk: Disk, block_size: int | None, sealed: QuantConfig | None = None
) -> int:
    """The block size of a disk cache: `shared_pool_block_size` with a tree, else `block_size` (default 16)."""
    if prefix is not None:
        return shared_pool_block_size(prefix, disk, block_size, sealed)
    return DEFAULT_BLOCK_SIZE if block_size is None else block_size


def shared_pool_block_size(
    prefix: PrefixCache, disk: Disk, block_size: int | None, sealed: QuantConfig | None = None
) -> int:
    """The block size of a disk cache drawing from `prefix`'s pool; refuses settings that cannot apply.

    Args:
        prefix: the tree whose pool the cache draws from.
        disk: the cache's disk settings.
        block_size: the block size the caller asked for; None takes the tree's.
        sealed: the codec of a cache that spills sealed blocks (`QuantizedDiskCache`); None for raw blocks.
    """
    pool = prefix.pool
    _check_pool_kind(pool, sealed)
    # A per-cache cap or another block size with a tree is refused by the chain's rules (`hf_kvgov.engine.rules`).
    needed, _, kept = resident_need(pool.block_size, disk, sealed)
    if pool.max_blocks is not None and pool.max_blocks < needed:
        raise ValueError(
            f"The prefix tree's pool holds at most {pool.max_blocks} blocks, but one sequence keeps {kept} in "
            f"memory: {needed} blocks of {pool.block_size} tokens. Give the pool a larger cap, or lower "
            f"{'residual' if sealed is not None else 'hot_tokens'}."
        )
    return pool.block_size


def _check_pool_kind(pool: BlockPool, sealed: QuantConfig | None) -> None:
    """A raw disk tier needs a plain pool, a tier of codes a quantized one (whose formats the cache checks)."""
    if sealed is None and isinstance(pool, QuantizedBlockPool):
        raise ValueError(
            "DiskOffloadCache(prefix=...) got a tree over a QuantizedBlockPool, whose sealed blocks are codes the "
            "disk tier does not spill; build the tree over a plain BlockPool (prefix_tree(model) without a codec)."
        )
    if sealed is not None and not isinstance(pool, QuantizedBlockPool):
        raise TypeError(
            f"QuantizedDiskCache(prefix=...) got a tree over a {type(pool).__name__}, which cannot hold the sealed "
            f"blocks a {sealed.codec_name} cache stores and spills; build the tree with the same codec "
            f"(prefix_tree(model, codec={sealed.codec_name!r}))."
        )


def resident_need(block_size: int, disk: Disk, sealed: QuantConfig | None) -> tuple[int, int, str]:
    """(full-precision blocks, sealed blocks, what they are) one sequence keeps in memory, against the pool's cap."""
    hot = math.ceil(disk.hot_tokens / block_size)
    if sealed is None:
        needed = 1 + hot + 2  # first block + hot window + tail + one step
        return needed, 0, f"the first block, a {disk.hot_tokens}-token hot window and one decode step"
    # With a codec the hot window is codes, in the sealed store, which the cap counts too.
    needed = sealed.sink_blocks + math.ceil(sealed.residual / block_size) + 2  # + tail + one step
    return (
        needed,
        hot,
        (
            f"{sealed.sink_blocks} sink block(s), a {sealed.residual}-token residual window and one decode step "
            f"in full precision, and a {disk.hot_tokens}-token hot window in codes"
        ),
    )


def tree_held(cache: BlockStore) -> frozenset[int]:
    """Pool ids this cache holds that the tree also holds: the blocks it matched or published.

    Each carries a tree lock taken by this cache (released with the cache), so the set is exact: a block
    the tree holds in one of this cache's rows can only have come in through `match` or `publish`.
    """
    return frozenset() if cache.prefix is None else cache.prefix.pool_blocks_of(cache.prefix_locks)


def private_blocks(kind: TierBlocks, shared: Collection[int]) -> TierBlocks:
    """`kind`, except that the blocks in `shared` (the tree's, see `tree_held`) never move to disk.

    Tree-held blocks are locked by this cache until released, so the tree can neither evict nor reuse them, and
    they are hot in aggregate (every matching request reads them).
    """
    return dataclasses.replace(kind, movable=lambda entry: entry not in shared and kind.movable(entry))


def make_rows_tiered(tables: TieredBlockTables) -> None:
    """After `match`: the rows it built become tiered tables (their references carry over unchanged).

    `match` builds plain block tables from the tree's hits; a row must be tiered before any of its blocks
    can spill, since only a tiered row knows how to fork, truncate and release spilled entries.
    """
    tables.rows = [row if isinstance(row, TieredBlockTable) else _tiered(tables, row) for row in tables.rows]
    tables.invalidate_views()


def _tiered(tables: TieredBlockTables, row: BlockTable) -> TieredBlockTable:
    """`row` as a tiered row, its freed leading entries (a sliding group's) still freed."""
    tiered = TieredBlockTable(tables.pool, tables.tier, row.block_ids, tables.ids)
    tiered.freed = row.freed
    return tiered


def bring_back_offered(
    cache: BlockStore,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor | None,
    bring_back: Callable[[int, int], None],
) -> None:
    """Before `publish`: the spilled blocks it would offer come back (`bring_back(first, stop)` on block columns).

    All of them at once, or `bring_back` raises (`PoolExhausted`) and nothing has changed, so the tree only
    references resident blocks; publishing just the resident leading run would stop at block 0, as a document
    spills during its first request's own decode. With a codec they come back as codes into the sealed store,
    under the same cap as the full-precision blocks. Nothing to do without a tree or rows, or with a row count
    `publish` refuses (it says why).

    Args:
        sequences: long `[batch, length]`, as for `publish`.
        attention_mask: long `[batch, prompt length]` or None, as for `publish`.
    """
    tables = cache.tables
    if cache.prefix is not None and tables is not None and tables.batch_size == sequences.shape[0] > 0:
        bring_back(0, publish_stop(cache, sequences, attention_mask))


def publish_stop(cache: BlockStore, sequences: torch.Tensor, attention_mask: torch.Tensor | None) -> int:
    """Block columns [0, stop) hold every full block `publish` would offer, over all rows.

    Args:
        sequences: long `[batch, length]`, as for `publish`.
        attention_mask: long `[batch, prompt length]` or None, as for `publish`.
    """
    assert cache.pool is not None, "publishing needs the tree's pool"
    stored, bs = cache.stored_tokens(), cache.pool.block_size
    first_pads = paged_prefix.first_pads_of(cache, sequences, attention_mask)  # the rows' limits, as publish sets them
    pairs = zip(sequences, first_pads, strict=True)
    return max((len(publishable_tokens(row, stored, pad)) // bs for row, pad in pairs), default=0)
