"""`PagedCache`: a lossless transformers `Cache` whose K/V live in blocks of a shared `BlockPool`.

The store itself, its layer groups and its codec, disk and prefix links are `hf_kvgov.engine.block_store`'s;
this class reads the model's geometry and puts transformers' `Cache` interface on it. The named caches are its
configurations: `QuantizedCache` sets a codec, `DiskOffloadCache` a disk tier, `QuantizedDiskCache` both.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any, Self

import torch

from hf_kvgov.engine.block_stats import CacheStats
from hf_kvgov.engine.block_store import AttentionPath, BlockStore
from hf_kvgov.engine.paged_view import PagedView
from hf_kvgov.engine.parts import ATTENTION_PATHS, ChainParts, Paging
from hf_kvgov.engine.quant_config import QuantConfig
from hf_kvgov.hf.compat import (
    cached_layer_count,
    check_attention_view,
    decoder_config,
    kv_heads_and_head_dim,
    layer_kinds,
    model_dtype_and_device,
    model_layer_devices,
)
from hf_kvgov.hf.governed import GovernedCacheBase
from hf_kvgov.hf.paged_layer import PagedLayer
from hf_kvgov.prefix.sharing import PrefixCache
from hf_kvgov.storage.pool import BlockPool
from hf_kvgov.tiers.spill_config import Disk

# The names other modules take from here (the layer, view and stats live in their own modules).
__all__ = ["ATTENTION_PATHS", "AttentionPath", "CacheStats", "PagedCache", "PagedLayer", "PagedView"]


class PagedCache(GovernedCacheBase, BlockStore):
    """KV cache in fixed-size blocks from a `BlockPool`; without a codec, token-for-token equal to `DynamicCache`.

    The chain with paged blocks only (and prefix sharing when `prefix` is given): a `GovernedCache` preset. With
    ``codec=`` and / or ``spill=`` it is the block store of every chain without an eviction policy.

    Two attention paths (see `hf_kvgov.hf.attention`):

    - ``attention="contiguous"`` (default): `update` gathers the layer's blocks into contiguous K/V, so any
      attention implementation (sdpa, eager, flash) runs unchanged. Cost: one copy per layer per step, the
      same as DynamicCache's `torch.cat`.
    - ``attention="paged"``: `update` only stores the new tokens and hands attention a view of the block
      tables; the hf_kvgov attention implementation reads blocks directly. Requires
      ``hf_kvgov.paged_attention(model)`` (or ``use_paged_attention``) so the model calls that attention.

    Args:
        model_or_config: the model (its dtype and device are used) or its config (dtype and device are
            then taken from the first K/V the model stores).
        block_size: tokens per block (None: the pool's or the prefix tree's, else 16); a size that differs
            from the pool the cache draws from is refused.
        max_tokens / max_bytes: cap of the pool it creates; exceeding it raises `PoolExhausted`.
        pool: an existing pool to draw blocks from (shared by many caches); its geometry must match.
        attention: "contiguous" or "paged" (see above).
        prefix: a `PrefixCache` shared across requests; enables `match` and `publish` (its pool is used).
        namespace: prefix-sharing namespace (tenant salt): caches only reuse blocks of the same namespace.
        codec: the codec link, a `QuantConfig` (what `QuantizedCache` sets): full blocks are sealed into codes
            in a `QuantizedBlockPool`; None keeps every block in full precision.
        spill: the disk link, a `Disk` (what `DiskOffloadCache` sets): cold blocks spill to a file.
            The cache then creates its pool capped by ``spill.max_resident_bytes`` (or draws from the prefix
            tree's), so it refuses ``pool=``, ``max_tokens=`` and ``max_bytes=``; None keeps every block in memory.
    """

    def __init__(
        self,
        model_or_config: Any,
        block_size: int | None = None,
        max_tokens: int | None = None,
        max_bytes: int | None = None,
        pool: BlockPool | None = None,
        attention: AttentionPath = "contiguous",
        prefix: PrefixCache | None = None,
        namespace: str = "",
        *,
        codec: QuantConfig | None = None,
        spill: Disk | None = None,
    ) -> None:
        config = decoder_config(model_or_config)
        windows = [kind.sliding_window for kind in layer_kinds(config)]  # refuses layer types it cannot serve
        num_kv_heads, head_dim = kv_heads_and_head_dim(config)
        if attention == "paged":
            check_attention_view(model_or_config, "attention='paged'")
        num_layers = cached_layer_count(config)  # layers sharing an earlier layer's K/V hold no blocks
        windows = windows[:num_layers]
        BlockStore.__init__(
            self,
            num_layers,
            num_kv_heads,
            head_dim,
            windows,
            model_layer_devices(model_or_config, num_layers),
            model_dtype_and_device(model_or_config),
            block_size=block_size,
            max_tokens=max_tokens,
            max_bytes=max_bytes,
            pool=pool,
            attention=attention,
            prefix=prefix,
            namespace=namespace,
            codec=codec,
            spill=spill,
        )
        # The chain as the caller wrote it: a pool they passed, else the paging that sizes the pool (a disk
        # tier's cap is its own part's).
        size = self.pool_args["block_size"]
        assert size is not None
        paging = Paging(size) if spill is not None else Paging(size, max_tokens, max_bytes)
        self.parts = ChainParts(
            pool=paging if pool is None else pool,
            prefix=prefix,
            namespace=namespace,
            codec=codec,
            spill=spill,
            attention=attention,
        )
        self.model_config = config  # what a copy is built from (`__deepcopy__`)
        layers = [PagedLayer(self, i) for i in range(num_layers)]
        for layer in layers:
            layer.is_sliding = self.group(layer.index).window is not None
        self.store_layers = list(layers)
        GovernedCacheBase.__init__(self, layers=list(layers))

    @classmethod
    def from_parts(cls, model_or_config: Any, parts: ChainParts) -> Self:
        """This configuration of the block store, built from a chain's parts (what `GovernedCache` returns).

        The parts are checked by `hf_kvgov.engine.rules` first; the named caches differ only in their constructor's
        arguments, so each is built here by the one store's.
        """
        cache = cls.__new__(cls)
        pool = parts.pool
        paging = pool if isinstance(pool, Paging) else Paging()  # its caps as given: a disk tier refuses a cap
        PagedCache.__init__(
            cache,
            model_or_config,
            block_size=None if pool is None else pool.block_size,  # None: the tree's blocks, else the default
            max_tokens=paging.max_tokens,
            max_bytes=paging.max_bytes,
            pool=pool if isinstance(pool, BlockPool) else None,
            attention=parts.attention,  # type: ignore[arg-type]
            prefix=parts.prefix,
            namespace=parts.namespace,
            codec=parts.codec,
            spill=parts.spill,
        )
        return cache

    # ------------------------------------------------------------------ generate's bookkeeping

    def get_seq_length(self, layer_idx: int = 0) -> int:
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        return layer.length if isinstance(layer, PagedLayer) else 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i becomes old row beam_idx[i]; blocks are shared, copied only when written."""
        self.reorder_rows(beam_idx.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.tables is not None:
            self.reorder_rows([i for i in range(self.tables.batch_size) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.reorder_rows(torch.as_tensor(indices).tolist())

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` tokens (negative, as transformers >= 5 passes it); a spilled block the
        new tail falls in comes back, and a sealed one is decoded (the next write lands there)."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop expects a negative number of tokens to remove; got {tokens_to_remove}. "
                "Pass -n to drop the last n tokens."
            )
        self.truncate(max(0, self.get_seq_length() + tokens_to_remove))

    def reset(self) -> None:
        """Forget every token and return every block to the pool (the cache stays usable); with a disk tier, disk
        slots return to the spill file, which stays."""
        self.forget(close_tier=False)

    def __deepcopy__(self, memo: dict[int, Any]) -> Self:
        """A copy holding the same tokens, for transformers' prompt reuse (``copy.deepcopy(prompt_cache)`` before each
        `generate` that continues the prompt). The copy draws from the same pool and shares every block (one more
        reference each, copied only when a copy writes into one), so the prompt is stored once for every copy."""
        if self.spill_link is not None:
            raise TypeError(
                f"{type(self).__name__} cannot be copied: its cold blocks live in its own spill file. To reuse a "
                "prompt's K/V across requests, build the caches on a prefix tree (prefix=prefix_tree(model, ...)) "
                "and call cache.match(input_ids) before generate, publish after."
            )
        # A pool this cache created is shared through its object; one from a prefix tree comes with the tree.
        parts = self.parts if self.pool is None or self.prefix is not None else replace(self.parts, pool=self.pool)
        copy = type(self).from_parts(self.model_config, parts)
        copy.parts = self.parts
        memo[id(self)] = copy
        self.fork_into(copy)
        for layer, copied in zip(self.store_layers, copy.store_layers, strict=True):
            assert isinstance(layer, PagedLayer) and isinstance(copied, PagedLayer)
            copied.is_initialized = layer.is_initialized
        return copy

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.release()
