"""The rows of the chain benchmark (`hf_kvgov.bench.chain`): what each step builds, probes and fills.

Cumulative steps, then side rows that compose a disk tier with one link each::

    paged -> + prefix sharing -> + int8 -> + H2O -> + disk spill with recall
    side rows: paged + disk spill, int8 + disk spill, prefix sharing + disk spill, prefix + int8 + disk spill

A disk row computes what paged does (with int8: what int8 does), because spilled blocks, codes as stored, come back
bit for bit. A composition the chain's rules refuse shows their sentence instead of numbers. The eviction steps are
the whole chain: request 1 reads the document from the tree as computed, and H2O's budget governs its own tokens,
int8 slots in an eviction pool's blocks; their numerics are the registry cache's on one sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hf_kvgov.bench import allocation as alloc
from hf_kvgov.bench.chain_steps import (
    Capacity,
    Context,
    Parts,
    Probe,
    disk_parts,
    evicting,
    h2o_parts,
    measured_bytes,
    pool_refused,
    recall_parts,
    shared,
    shared_disk_parts,
    shared_eviction_bytes,
    shared_pool_refused,
    written,
)
from hf_kvgov.engine.block_stats import live_entries
from hf_kvgov.engine.disk_prefix import tree_held
from hf_kvgov.engine.parts import Paging
from hf_kvgov.prefix.sharing import PrefixCache
from hf_kvgov.registry import kv_bytes
from hf_kvgov.storage.quantized_pool import QuantizedBlockPool, is_sealed

__all__ = ["STEPS", "ChainStep"]

_MEASURED_DISK = "measured bytes (one sequence's stats: resident blocks + read-ahead buffers)"
_SHARED_MEASURED = (
    "measured bytes: (budget - the document's tree blocks a request matches) / (one request's own resident bytes "
    "+ read-ahead buffers), from its stats (not filled by allocation: each read-back step concatenates the layer's "
    "whole sealed store, and the fill slowed to 16 s a request by the 17th on SmolLM2)"
)
_SHARED_DISK = (
    "pool refused, one prefix tree; each request's last token a step of its own (its cold own blocks spill); "
    "the pool's cap counts its blocks and every request's read-ahead rows (rows it has no room for are not "
    "allocated: those requests read back on demand)"
)


# ------------------------------------------------------------------ capacity of the disk rows under a tree


def read_ahead_bytes(cache: Any) -> int:
    """The read-ahead rows a spilling cache has allocated (one per spilled block it read back, up to its cap)."""
    return int(cache.stats().read_buffer_bytes)


def shared_spill_refused(codec: str | None, parts: Callable[[Context], Parts]) -> Capacity:
    """Requests with a disk tier (`parts`) on one capped pool + tree, until the pool or the budget refuses.

    Each request writes its own part in `chunk`-token steps and then its last token alone, as a decoding
    request does: the spill at the start of that step moves its cold own blocks out of the pool and the step
    reads them back, which allocates its read-ahead rows where the pool's cap has room for them (they are
    charged to it). The held figure adds every request's allocated rows (`read_ahead_bytes`) to the pool's
    blocks in use; the planner counts those rows as one layer of each spilling sequence's spilled blocks, up to
    `spill_buffer_bytes`, for every sequence. The contiguous path
    is used: the paged one copies the whole pool layer to append read-back blocks, a cost of the bench's huge
    pool, not of a request.
    """

    def capacity(ctx: Context, probe: Probe) -> alloc.Fit:
        prefix = PrefixCache(alloc.capped_pool(probe.cache.pool, ctx.config.budget_bytes))
        c = ctx.config
        try:
            twin = ctx.sharing(codec, **parts(ctx))
            with ctx.counter("requests written") as bar:
                return alloc.fill_shared(
                    twin, prefix, ctx.kv, ctx.requests.tokens, c.chunk, bar,
                    outside_pool=read_ahead_bytes, last_token_alone=True, published=c.shared_tokens,
                )  # fmt: skip
        finally:
            prefix.close()

    return capacity


def blocks_bytes(cache: Any, blocks: frozenset[int]) -> int:
    """Bytes of `blocks`, pool ids of `cache`'s pool: full-precision and sealed blocks."""
    pool = cache.pool
    sealed = sum(1 for entry in blocks if is_sealed(entry))
    sealed_block = pool.sealed.bytes_per_block if isinstance(pool, QuantizedBlockPool) else 0
    return (len(blocks) - sealed) * pool.bytes_per_block + sealed * sealed_block


def shared_measured_bytes(ctx: Context, probe: Probe) -> alloc.Fit:
    """(budget - the document's bytes) // (one request's own resident bytes + read-ahead), from the probe's stats.

    The document is what the probe's `match` took from the tree: every full-attention block, and a sliding group's
    last window, which each request reads when it is admitted (the tree keeps it while one does). For a
    composition whose fill by allocation is too slow for the bench (see `_SHARED_MEASURED`).
    """
    matched = tree_held(probe.cache) & probe.matched
    document = blocks_bytes(probe.cache, matched)
    # The probe's stats count the tree blocks it still reads in full (not the sliding ones it moved past).
    own = kv_bytes(probe.cache) - blocks_bytes(probe.cache, matched & live_entries(probe.cache))
    if own <= 0:
        raise ValueError(
            f"A request holding {ctx.config.length} tokens reports {own} bytes of its own; it cannot be counted."
        )
    count = max(0, (ctx.config.budget_bytes - document) // own)
    return count, document + count * own, ctx.config.length


@dataclass(frozen=True)
class ChainStep:
    """One row: how its probe is built (raising `ChainRefused` when the rules refuse it) and measured.

    `label`, `numerics` and `reuses` are format strings over `ChainBenchConfig`'s fields. `numerics` is the
    registry name whose perplexity / passkey runs are this step's; `reuses` names the step whose runs it
    shares instead. `refusals` are other links tried with this step's parts, whose sentences the row shows.
    """

    name: str
    label: str
    probe: Callable[[Context], Probe]
    capacity: Capacity
    method: str
    shares_document: bool = False
    numerics: str | None = None
    reuses: str | None = None
    refusals: Callable[[Context], list[Parts]] = lambda ctx: []
    side: bool = False
    # Capacity is filled by allocation, each request's own tokens in `chunk`-token steps: the pool holds the
    # newest request's step as written (in full precision until a codec seals it), so the planner counts it.
    fills_in_steps: bool = False


_SHARED_EVICTION = (
    "measured bytes: (budget - the document's tree blocks) / one request's own bytes (stats().bytes_used: pool "
    "blocks of slot rows + per-slot metadata{recall})"
)


def _int8_disk(ctx: Context) -> Parts:
    return {"pool": Paging(ctx.config.block_size), "codec": "int8"} | disk_parts(ctx)


STEPS: tuple[ChainStep, ...] = (
    ChainStep(
        "paged", "paged ({block_size}-token blocks)", written(lambda ctx: {"pool": Paging(ctx.config.block_size)}),
        pool_refused, "pool refused", numerics="paged@{block_size}",
    ),
    ChainStep(
        "prefix", "+ prefix sharing ({shared_tokens:,} of {length:,} tokens)", shared(None),
        shared_pool_refused(None), "pool refused, one prefix tree", shares_document=True, reuses="paged",
        fills_in_steps=True,
    ),
    ChainStep(
        "int8", "+ int8 (keys per channel, values per token)", shared("int8"), shared_pool_refused("int8"),
        "pool refused, one prefix tree; the pool's cap counts its full-precision and sealed bytes",
        shares_document=True, numerics="int8@{block_size}", fills_in_steps=True,
    ),
    ChainStep(
        "h2o", "+ H2O {h2o_budget:.0%} of own tokens (int8 slots in pool blocks)", evicting(h2o_parts),
        shared_eviction_bytes, _SHARED_EVICTION.format(recall=""), shares_document=True,
        numerics="h2o@{h2o_budget}:int8",
    ),
    ChainStep(
        "spill",
        "+ disk spill with recall (evicted tokens to 16-token disk pages, 8 recalled per step, {recall_buffer} buffer)",
        evicting(recall_parts), shared_eviction_bytes,
        _SHARED_EVICTION.format(recall=", pending page, page summaries, recall buffer"), shares_document=True,
        numerics="h2o@{h2o_budget}:int8+recall",
    ),
    ChainStep(
        "disk", "side row: paged + disk spill (hot {spill_hot_tokens:,} tokens)", written(disk_parts),
        measured_bytes, _MEASURED_DISK,
        reuses="paged", side=True,  # spilled blocks come back bit for bit: PagedCache's numerics
    ),
    ChainStep(
        "int8_disk", "side row: int8 + disk spill (hot {spill_hot_tokens:,} tokens)", written(_int8_disk),
        measured_bytes, _MEASURED_DISK,
        reuses="int8", side=True,  # sealed blocks spill as their codes: QuantizedCache's numerics, bit for bit
    ),
    ChainStep(
        "prefix_disk",
        "side row: prefix sharing + disk spill (hot {spill_hot_tokens_shared:,} tokens: own blocks spill)",
        shared(None, shared_disk_parts), shared_spill_refused(None, shared_disk_parts), _SHARED_DISK,
        shares_document=True, reuses="paged", side=True, fills_in_steps=True,  # own blocks return bit for bit
    ),
    ChainStep(
        "prefix_int8_disk",
        "side row: prefix sharing + int8 + disk spill (hot {spill_hot_tokens_shared:,} tokens: own blocks spill)",
        shared("int8", shared_disk_parts), shared_measured_bytes, _SHARED_MEASURED,
        shares_document=True, reuses="int8", side=True,  # own sealed blocks spill as their codes
    ),
)  # fmt: skip
