"""`PagedCache`: a lossless transformers `Cache` whose K/V live in blocks of a shared `BlockPool`.

Two attention paths (see `hf_kvgov.hf.attention`):

- ``attention="contiguous"`` (default): `update` gathers the layer's blocks into contiguous K/V, so any
  attention implementation (sdpa, eager, flash) runs unchanged. Cost: one copy per layer per step, the
  same as DynamicCache's `torch.cat`.
- ``attention="paged"``: `update` only stores the new tokens and hands attention a view of the block
  tables; the hf_kvgov attention implementation reads blocks directly. Requires
  ``hf_kvgov.paged_attention(model)`` (or ``use_paged_attention``) so the model calls that attention.

Hybrid models (sliding-window layers beside full-attention ones, or every layer sliding): the layers are
grouped by what they keep (`hf_kvgov.storage.layer_groups`), each group has its own block tables over the
one pool, and a sliding group frees the blocks that left its window before each step. A sliding layer then
reports `is_sliding` and the position of its first kept token to the mask, as DynamicCache's sliding layers
do. A prefix tree over such a pool shares blocks per group (`hf_kvgov.hf.prefix_groups`).

This class is the one block store of every block-storing chain. Its links are objects it calls at fixed
points of its lifetime, each None when the chain leaves it out: the codec link (`BlockSealer`: full blocks
sealed into codes) and the disk link (`BlockTier`: cold blocks spilled to a file and read back ahead of
need). The named caches are its configurations: `QuantizedCache` sets a codec, `DiskOffloadCache` a disk
tier, `QuantizedDiskCache` both; ``GovernedCache(model, pool=..., prefix=..., codec=..., spill=...)`` builds
the same store from the chain's parts.
"""

from __future__ import annotations

import contextlib
from typing import Any, Literal, Self

import torch

from hf_kvgov.chain.parts import ChainParts, Paging
from hf_kvgov.hf import disk_prefix, paged_pool, paged_prefix, prefix_groups
from hf_kvgov.hf.block_sealer import BlockSealer
from hf_kvgov.hf.block_tier import BlockTier
from hf_kvgov.hf.compat import (
    decoder_config,
    kv_heads_and_head_dim,
    layer_kinds,
    model_dtype_and_device,
    model_layer_devices,
)
from hf_kvgov.hf.governed import GovernedCache
from hf_kvgov.hf.paged_layer import PagedLayer, check_spill_pool, resolve_block_size
from hf_kvgov.hf.paged_stats import CacheStats, paged_cache_stats
from hf_kvgov.hf.paged_view import PAGED_VIEW_KEY, PagedView
from hf_kvgov.hf.prefix_layout import RowLayout
from hf_kvgov.hf.quant_config import QuantConfig
from hf_kvgov.prefix.sharing import PrefixCache
from hf_kvgov.storage.block_table import BlockTables
from hf_kvgov.storage.layer_groups import GroupLayout, LayerGroup, layer_groups, single_group
from hf_kvgov.storage.pool import BlockPool
from hf_kvgov.tiers.block_table import TieredBlockTables
from hf_kvgov.tiers.disk_tier import DiskTier
from hf_kvgov.tiers.prefetch import LayerPrefetcher
from hf_kvgov.tiers.spill_config import DiskCacheConfig

# The names other modules take from here (the layer, view and stats live in their own modules).
__all__ = ["ATTENTION_PATHS", "PAGED_VIEW_KEY", "AttentionPath", "CacheStats", "PagedCache", "PagedLayer", "PagedView"]

AttentionPath = Literal["contiguous", "paged"]
ATTENTION_PATHS: tuple[str, ...] = ("contiguous", "paged")


class PagedCache(GovernedCache):
    """KV cache in fixed-size blocks from a `BlockPool`; without a codec, token-for-token equal to `DynamicCache`.

    The chain with paged blocks only (and prefix sharing when `prefix` is given): a `GovernedCache` preset. With
    ``codec=`` and / or ``spill=`` it is the block store of every chain without an eviction policy.

    Args:
        model_or_config: the model (its dtype and device are used) or its config (dtype and device are
            then taken from the first K/V the model stores).
        block_size: tokens per block (None: the pool's or the prefix tree's, else 16); a size that differs
            from the pool the cache draws from is refused.
        max_tokens / max_bytes: cap of the pool it creates; exceeding it raises `PoolExhausted`.
        pool: an existing pool to draw blocks from (shared by many caches); its geometry must match.
        attention: "contiguous" or "paged" (see the module docstring).
        prefix: a `PrefixCache` shared across requests; enables `match` and `publish` (its pool is used).
        namespace: prefix-sharing namespace (tenant salt): caches only reuse blocks of the same namespace.
        codec: the codec link, a `QuantConfig` (what `QuantizedCache` sets): full blocks are sealed into codes
            in a `QuantizedBlockPool`; None keeps every block in full precision.
        spill: the disk link, a `DiskCacheConfig` (what `DiskOffloadCache` sets): cold blocks spill to a file.
            The cache then creates its pool capped by ``spill.max_resident_bytes`` (or draws from the prefix
            tree's), so it refuses ``pool=``, ``max_tokens=`` and ``max_bytes=``; None keeps every block in memory.
    """

    # Whether the pool this cache creates groups layers by window (see the module docstring); False keeps one
    # group of every layer, every token in every layer (the benchmarks measure the two side by side).
    groups_layers = True

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
        spill: DiskCacheConfig | None = None,
    ) -> None:
        # The links come first: the pool may be created below, and each link shapes it.
        self.sealer = None if codec is None else BlockSealer(codec)
        self.spill_link = None if spill is None else BlockTier(spill, sealed=codec)
        if spill is not None:
            check_spill_pool(None if prefix is not None and pool is prefix.pool else pool, max_tokens, max_bytes)
            block_size = disk_prefix.cache_block_size(prefix, spill, block_size, sealed=codec)
            max_bytes = spill.pool_bytes
        block_size = resolve_block_size(block_size, pool if pool is not None else prefix.pool if prefix else None)
        if attention not in ATTENTION_PATHS:
            raise ValueError(f"attention must be one of {ATTENTION_PATHS}; got {attention!r}.")
        config = decoder_config(model_or_config)
        windows = [kind.sliding_window for kind in layer_kinds(config)]  # refuses layer types it cannot serve
        self.num_kv_heads, self.head_dim = kv_heads_and_head_dim(config)
        self.num_layers = int(config.num_hidden_layers)
        if codec is not None:
            codec.check_model(self.num_layers, self.num_kv_heads, self.head_dim, block_size)
        self.attention: AttentionPath = attention
        self._pool_args = {"block_size": block_size, "max_tokens": max_tokens, "max_bytes": max_bytes}
        self.pool: BlockPool | None = None
        self.tables: BlockTables | None = None  # the first layer group's (the only one without sliding groups)
        self._other_tables: list[BlockTables] = []  # the other groups', in `groups` order
        self._pending_view: PagedView | None = None
        self.prefix = prefix
        self.namespace = namespace
        self._prefix_locks: list[int] = []
        self._row_layouts: list[RowLayout] | None = None
        self._published_blocks = 0  # prompt blocks published as computed (a tree over layer groups)
        self._expand_rows_on_next_forward = False
        # The chain as the caller wrote it: a pool they passed, else the paging that sizes the pool (a disk
        # tier's cap is its own part's).
        paging = Paging(block_size) if spill is not None else Paging(block_size, max_tokens, max_bytes)
        self.parts = ChainParts(
            pool=paging if pool is None else pool,
            prefix=prefix,
            namespace=namespace,
            codec=codec,
            spill=spill,
            attention=attention,
        )
        if prefix is not None:
            if pool is not None and pool is not prefix.pool:
                raise ValueError("Pass either pool= or prefix= (whose pool is used), or the same pool to both.")
            pool = prefix.pool
        self._layer_devices = model_layer_devices(model_or_config, self.num_layers)  # None: the first K/V tells
        self._placeable = frozenset[int]()  # layers placed where their first K/V arrive (`paged_pool`)
        groups = pool.groups if pool is not None else self._layer_groups(windows)
        self.layout = GroupLayout.of(groups, self.num_layers)
        if pool is not None:
            paged_pool.adopt_pool(self, pool)
        else:
            dtype_device = model_dtype_and_device(model_or_config)
            if dtype_device is not None and None not in self._layer_devices:
                paged_pool.create_pool(self, *dtype_device)
        layers: list[Any] = [PagedLayer(self, i) for i in range(self.num_layers)]
        for layer in layers:
            layer.is_sliding = self._group(layer.index).window is not None
        super().__init__(layers=layers)

    @classmethod
    def from_parts(cls, model_or_config: Any, parts: ChainParts) -> Self:
        """This configuration of the block store, built from a chain's parts (what `GovernedCache` returns).

        The parts are checked by `hf_kvgov.chain.rules` first; the named caches differ only in their constructor's
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

    # ------------------------------------------------------------------ layer groups

    def _layer_groups(self, windows: list[int | None]) -> tuple[LayerGroup, ...]:
        """The groups of the pool this cache creates: by window, unless this cache cannot free windows (a split
        model's positions would span devices)."""
        known = {device for device in self._layer_devices if device is not None}
        if not self.groups_layers or len(known) > 1:
            return single_group(len(windows))
        groups = layer_groups(windows)
        return groups if self.sealer is None else self.sealer.layer_groups(groups)

    @property
    def groups(self) -> tuple[LayerGroup, ...]:
        return self.layout.groups

    def _group(self, layer: int) -> LayerGroup:
        return self.layout.groups[self.layout.group_of[layer]]

    def _tables_of(self, layer: int) -> BlockTables:
        assert self.tables is not None
        group = self.layout.group_of[layer]
        return self.tables if group == 0 else self._other_tables[group - 1]

    @property
    def all_tables(self) -> list[BlockTables]:
        """The block tables of every layer group (one group: `[self.tables]`)."""
        return [] if self.tables is None else [self.tables, *self._other_tables]

    def _first_kept_token(self, layer: int, position: int) -> int:
        """The first token layer `layer` keeps while queries start at `position` (0 outside sliding groups); known
        before the pool exists (the mask asks first), from the block size the pool gets."""
        return self._group(layer).first_kept(position, self._pool_args["block_size"])  # type: ignore[arg-type]

    # ------------------------------------------------------------------ pool

    def _ensure_pool(self, key_states: torch.Tensor) -> None:
        if self.pool is None:
            paged_pool.create_pool(self, key_states.dtype, key_states.device)

    # ------------------------------------------------------------------ the hot path

    def _update_layer(
        self,
        layer: PagedLayer,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        attn_kwargs: dict[str, Any] | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store `[batch, kv_heads, q_len, head_dim]` new K/V and return what attention must use."""
        assert self.pool is not None and self.tables is not None
        batch, heads, q_len, head_dim = key_states.shape
        if (heads, head_dim) != (self.num_kv_heads, self.head_dim):
            raise ValueError(
                f"Layer {layer.index} stored K/V with {heads} heads of dim {head_dim}; this cache was built "
                f"for {self.num_kv_heads} KV heads of dim {self.head_dim}."
            )
        if layer.index == 0 and self.sealer is not None:
            # Normally a no-op: the previous step's last layer sealed already. This catches a model whose
            # last layer does not call update (shared-KV layers) or a step that was interrupted.
            self.sealer.seal_ready_blocks(self)
        if self._expand_rows_on_next_forward:
            self._expand_matched_rows(batch)
        if layer.index == 0:  # every group still holds the prompt blocks the previous step computed
            prefix_groups.publish_computed(self)
            if self.spill_link is not None:  # after publishing: blocks the tree holds stay resident
                self.spill_link.spill_cold_blocks(self)
        if key_states.device != self.pool.layer_device(layer.index):
            paged_pool.check_layer_device(self, layer.index, key_states.device)
        tables = self._tables_of(layer.index)
        tables.slots_for(batch, layer.length, q_len)
        slots = tables.slots_on(key_states.device)  # one copy per device per step, not per layer
        self._write_tokens(layer, slots, key_states, value_states)
        layer.length += q_len
        if self.attention == "paged":
            return self._hand_view_to_attention(layer, attn_kwargs, key_states, value_states)
        kv = self._contiguous_kv(layer)
        if self.sealer is not None and layer.index == self.num_layers - 1:
            self.sealer.seal_ready_blocks(self)  # kv is already a copy: sealing cannot change what attention reads
        return kv

    def _expand_matched_rows(self, batch: int) -> None:
        """generate expands inputs for beams / num_return_sequences but not a cache it was given."""
        assert self.tables is not None
        self._expand_rows_on_next_forward = False
        rows = self.tables.batch_size
        if batch != rows and batch % rows == 0:
            self.batch_repeat_interleave(batch // rows)
            if self._row_layouts is not None:
                self._row_layouts = [row for row in self._row_layouts for _ in range(batch // rows)]

    def _write_tokens(
        self, layer: PagedLayer, slots: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> None:
        """Store `[batch, kv_heads, q_len, head_dim]` K/V into `slots` (long `[batch * q_len]`)."""
        assert self.pool is not None
        heads, head_dim = key_states.shape[1], key_states.shape[3]
        new_k = key_states.transpose(1, 2).reshape(-1, heads, head_dim)
        new_v = value_states.transpose(1, 2).reshape(-1, heads, head_dim)
        self.pool.write(layer.index, slots, new_k, new_v)

    def layer_kv(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V layer `index` holds, `[batch, kv_heads, tokens, head_dim]` (a copy): every token, or from
        the first kept block on in a sliding-window layer group."""
        layer = self.layers[index]
        assert isinstance(layer, PagedLayer)
        return self._contiguous_kv(layer)

    def _contiguous_kv(self, layer: PagedLayer) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K/V as `[batch, kv_heads, length, head_dim]` for any attention implementation."""
        if self.sealer is not None:  # sealed blocks decoded, spilled ones read back
            return self.sealer.contiguous_kv(self, layer)
        if self.spill_link is not None and (kv := self.spill_link.raw_kv(self, layer)) is not None:
            return kv
        assert self.pool is not None
        table, first = self._tables_of(layer.index).live_tensor(self.pool.layer_device(layer.index))
        return self.pool.gather(layer.index, table, layer.length - first)

    def _hand_view_to_attention(
        self,
        layer: PagedLayer,
        attn_kwargs: dict[str, Any] | None,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.pool is not None and self.tables is not None
        if self._pending_view is not None and not self._pending_view.consumed:
            raise RuntimeError(
                "PagedCache(attention='paged') handed its block tables to attention, but the model's attention "
                "implementation did not read them, so attention saw only the newest tokens. Wrap generation "
                "in `with hf_kvgov.paged_attention(model):` or build the cache with attention='contiguous'."
            )
        if attn_kwargs is None:
            raise RuntimeError(
                "PagedCache(attention='paged') needs the model to pass its attention kwargs to cache.update "
                "(transformers >= 5 models do); use attention='contiguous' with this model."
            )
        table, first = self._tables_of(layer.index).live_tensor(self.pool.layer_device(layer.index))
        view = PagedView(self.pool.keys[layer.index], self.pool.values[layer.index], table, layer.length - first)
        if self.sealer is not None:  # a view that decodes sealed entries (spilled ones read back)
            view = self.sealer.paged_view(self, layer, view)
        elif self.spill_link is not None:
            self.spill_link.add_raw_to_view(self, layer, view)
        attn_kwargs[PAGED_VIEW_KEY] = view
        self._pending_view = view
        return key_states, value_states

    # ------------------------------------------------------------------ generate's bookkeeping

    def get_seq_length(self, layer_idx: int = 0) -> int:
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        return layer.length if isinstance(layer, PagedLayer) else 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i becomes old row beam_idx[i]; blocks are shared, copied only when written."""
        self._reorder_rows(beam_idx.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.tables is not None:
            self._reorder_rows([i for i in range(self.tables.batch_size) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._reorder_rows(torch.as_tensor(indices).tolist())

    def _reorder_rows(self, indices: list[int]) -> None:
        for tables in self.all_tables:
            if tables.rows:
                tables.reorder(indices)

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` tokens (negative, as transformers >= 5 passes it); a spilled block the
        new tail falls in comes back, and a sealed one is decoded (the next write lands there)."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop expects a negative number of tokens to remove; got {tokens_to_remove}. "
                "Pass -n to drop the last n tokens."
            )
        length = max(0, self.get_seq_length() + tokens_to_remove)
        for tables in self.all_tables:  # a sliding group refuses before any group changes (it is checked first)
            tables.check_truncate(length)
        if self.spill_link is not None and self.tables is not None and self.tables.rows:
            self.spill_link.before_truncate(self, length)
        for tables in self.all_tables:
            tables.truncate(length)
        if self.spill_link is not None:
            self.spill_link.after_truncate()
        for layer in self.paged_layers:
            layer.length = min(layer.length, length)
        self._pending_view = None
        if self.sealer is not None:
            self.sealer.after_crop(self)

    def reset(self) -> None:
        """Forget every token and return every block to the pool (the cache stays usable); with a disk tier, disk
        slots return to the spill file, which stays."""
        self._forget(close_tier=False)

    def release(self) -> None:
        """Return every block this cache holds to the pool (blocks published to a prefix cache stay there); with a
        disk tier, also stop its reader thread and delete the spill file (and a private directory)."""
        self._forget(close_tier=True)

    def _forget(self, close_tier: bool) -> None:
        if self.spill_link is not None:
            self.spill_link.before_release()
        for tables in self.all_tables:
            tables.release()
        paged_prefix.release_prefix_locks(self)
        self._expand_rows_on_next_forward = False
        for layer in self.layers:
            layer.reset()
        self._pending_view = None
        if self.spill_link is not None:
            self.spill_link.after_release(close=close_tier)
        if self.sealer is not None:
            self.sealer.forget()

    # ------------------------------------------------------------------ prefix sharing

    def match(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, pad_token_id: int = 0
    ) -> dict[str, torch.Tensor]:
        """Fill this empty cache with each row's longest cached prefix; returns the inputs for generate.

        See `hf_kvgov.hf.paged_prefix.match`. With a codec, the matched prefix is then sealed as if this cache had
        computed it. With a disk tier, the matched blocks stay in memory for as long as this cache holds them.
        """
        inputs = paged_prefix.match(self, input_ids, attention_mask, pad_token_id, namespace=self.sharing_namespace)
        if self.sealer is not None:
            # A cache that computed the prefix would have sealed its ready blocks at the end of that step: rows'
            # padding blocks (masked, zeroed) and any full-precision block past the sink that the tree holds
            # (published without `publish`'s sealed copies). Sealing them before the prefill frees their
            # full-precision memory before the prefill needs its own, and the suffix reads what that cache would.
            self.sealer.seal_ready_blocks(self)
        if self.spill_link is not None:
            self.spill_link.after_match(self)
        return inputs

    def publish(self, sequences: torch.Tensor, attention_mask: torch.Tensor | None = None) -> int:
        """Offer this cache's full blocks (prompt and generated) to the prefix tree; returns blocks offered.

        With a codec, full blocks still in full precision past the sink go to the tree sealed. With a disk tier,
        the spilled blocks it offers come back into memory first. If they cannot (`PoolExhausted`, a store that
        cannot grow, `SpillCorrupted`), that error is raised and nothing has changed: no block brought back, none
        published.
        """
        if self.spill_link is not None:
            self.spill_link.before_publish(self, sequences, attention_mask)
        return paged_prefix.publish(
            self, sequences, attention_mask, namespace=self.sharing_namespace, sealed_from=self._sealed_from
        )

    def _publish_tokens(self, rows: list[list[int]], sliding_only: bool) -> int:
        """Publish row r's full blocks of `rows[r]` (`sliding_only`: the prompt as computed, `prefix_groups`)."""
        return paged_prefix.publish_tokens(
            self, rows, self.sharing_namespace, sealed_from=self._sealed_from, sliding_only=sliding_only
        )

    @property
    def sharing_namespace(self) -> str:
        """The tree namespace of `match` / `publish`: `namespace`, plus how this cache seals blocks with a codec
        (caches sealing differently never share a block, nor does a cache without a codec on the same pool)."""
        return self.namespace if self.sealer is None else self.sealer.namespace(self.namespace)

    @property
    def _sealed_from(self) -> int | None:
        """The first block column `publish` offers sealed (past the sink); None without a codec."""
        return None if self.sealer is None else self.sealer.quant.sink_blocks

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.release()

    # ------------------------------------------------------------------ the disk link's state

    @property
    def disk(self) -> DiskCacheConfig:
        """The disk tier's settings (a cache with a disk link only)."""
        assert self.spill_link is not None, f"a {type(self).__name__} without a disk tier has no disk settings"
        return self.spill_link.disk

    @property
    def tier(self) -> DiskTier | None:
        """The spill file (None before the pool exists, or without a disk link)."""
        return None if self.spill_link is None else self.spill_link.tier

    @property
    def prefetcher(self) -> LayerPrefetcher | None:
        return None if self.spill_link is None else self.spill_link.prefetcher

    @property
    def stop_reason(self) -> str | None:
        """Why spilling stopped (a full disk, the write budget), or None."""
        return None if self.spill_link is None else self.spill_link.stop_reason

    @property
    def blocks_spilled(self) -> int:
        """Distinct blocks written to the disk tier since construction (0 without a disk link)."""
        return 0 if self.spill_link is None else self.spill_link.blocks_spilled

    @property
    def tiered_tables(self) -> list[TieredBlockTables]:
        """Every layer group's block tables whose blocks may spill (none without a disk link)."""
        return BlockTier.tiered_tables(self)

    def drop_page_cache(self) -> None:
        """Make the next reads of spilled blocks come from the device, not the OS page cache (benchmarks)."""
        if self.spill_link is not None:
            self.spill_link.drop_page_cache()

    # ------------------------------------------------------------------ accounting

    @property
    def paged_layers(self) -> list[PagedLayer]:
        return [layer for layer in self.layers if isinstance(layer, PagedLayer)]

    def stats(self) -> CacheStats:
        """What this cache holds: blocks and bytes (`CacheStats`); with a codec, the bytes as stored
        (`QuantizedCacheStats`); with a disk tier, memory only plus the tier's counters (`DiskCacheStats`, or
        `QuantizedDiskCacheStats` with both links)."""
        base = paged_cache_stats(self)
        if self.spill_link is not None:
            return self.spill_link.stats(self, base)
        return base if self.sealer is None else self.sealer.stats(self, base)
