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
"""

from __future__ import annotations

import contextlib
from typing import Any, Literal

import torch

from hf_kvgov.chain.parts import ChainParts, Paging
from hf_kvgov.hf import paged_prefix, prefix_groups
from hf_kvgov.hf.block_tier import BlockTier
from hf_kvgov.hf.compat import (
    CacheLayerMixin,
    decoder_config,
    kv_heads_and_head_dim,
    layer_kinds,
    model_dtype_and_device,
    model_layer_devices,
)
from hf_kvgov.hf.governed import GovernedCache
from hf_kvgov.hf.paged_stats import CacheStats, paged_cache_stats
from hf_kvgov.hf.paged_view import PAGED_VIEW_KEY, PagedView
from hf_kvgov.hf.prefix_layout import RowLayout
from hf_kvgov.prefix.sharing import PrefixCache
from hf_kvgov.storage.block_table import BlockTables
from hf_kvgov.storage.geometry import check_placement
from hf_kvgov.storage.layer_groups import GroupLayout, LayerGroup, layer_groups, single_group
from hf_kvgov.storage.pool import DEFAULT_BLOCK_SIZE, BlockPool, KVGeometry
from hf_kvgov.tiers.block_table import TieredBlockTables
from hf_kvgov.tiers.disk_tier import DiskTier
from hf_kvgov.tiers.prefetch import LayerPrefetcher
from hf_kvgov.tiers.spill_config import DiskCacheConfig

AttentionPath = Literal["contiguous", "paged"]
ATTENTION_PATHS: tuple[str, ...] = ("contiguous", "paged")


class PagedLayer(CacheLayerMixin):
    """One decoder layer's view of a `PagedCache`; the blocks themselves belong to the pool."""

    is_compileable = False
    is_croppable = True
    is_sliding = False
    supports_early_init = False

    def __init__(self, owner: PagedCache, index: int) -> None:
        super().__init__()
        self.owner = owner
        self.index = index
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.owner._ensure_pool(key_states)
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self.owner._update_layer(self, key_states, value_states, kwargs.get("kwargs"))

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        first = self.owner._first_kept_token(self.index, self.length)
        return self.length + query_length - first, first

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.length = 0


def resolve_block_size(block_size: int | None, given: BlockPool | None) -> int:
    """The block size of a cache: the one asked for, else the given pool's, else `DEFAULT_BLOCK_SIZE`.

    A size that differs from the pool the cache draws from (its own `pool=`, or its prefix tree's) is refused
    rather than silently replaced: the caller would plan memory and kernels for blocks it does not get.
    """
    if block_size is None:
        return given.block_size if given is not None else DEFAULT_BLOCK_SIZE
    if given is not None and block_size != given.block_size:
        raise ValueError(
            f"block_size={block_size}, but the cache draws its blocks from a pool (pool= or the prefix tree's) of "
            f"{given.block_size}-token blocks; pass block_size={given.block_size} or leave it unset."
        )
    return block_size


class PagedCache(GovernedCache):
    """KV cache in fixed-size blocks from a `BlockPool`; token-for-token equal to `DynamicCache`.

    The chain with paged blocks only (and prefix sharing when `prefix` is given): a `GovernedCache` preset.

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
    """

    # Whether the pool this cache creates groups layers by window (see the module docstring); False keeps one
    # group of every layer, every token in every layer (the benchmarks measure the two side by side).
    groups_layers = True
    # The disk link (`hf_kvgov.hf.block_tier`): a cache that spills sets it before this `__init__`, which may
    # create the pool, and attaches it with the pool; None keeps every block in memory.
    spill_link: BlockTier | None = None

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
    ) -> None:
        block_size = resolve_block_size(block_size, pool if pool is not None else prefix.pool if prefix else None)
        if attention not in ATTENTION_PATHS:
            raise ValueError(f"attention must be one of {ATTENTION_PATHS}; got {attention!r}.")
        config = decoder_config(model_or_config)
        windows = [kind.sliding_window for kind in layer_kinds(config)]  # refuses layer types it cannot serve
        self.num_kv_heads, self.head_dim = kv_heads_and_head_dim(config)
        self.num_layers = int(config.num_hidden_layers)
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
        # The chain as the caller wrote it: a pool they passed, else the paging that sizes the pool.
        self.parts = ChainParts(
            pool=Paging(block_size, max_tokens, max_bytes) if pool is None else pool,
            prefix=prefix,
            namespace=namespace,
            attention=attention,
        )
        if prefix is not None:
            if pool is not None and pool is not prefix.pool:
                raise ValueError("Pass either pool= or prefix= (whose pool is used), or the same pool to both.")
            pool = prefix.pool
        self._layer_devices = model_layer_devices(model_or_config, self.num_layers)  # None: the first K/V tells
        groups = pool.groups if pool is not None else self._layer_groups(windows)
        self.layout = GroupLayout.of(groups, self.num_layers)
        if pool is not None:
            self._adopt_pool(pool)
        else:
            dtype_device = model_dtype_and_device(model_or_config)
            if dtype_device is not None and None not in self._layer_devices:
                self._create_pool(*dtype_device)
        layers: list[Any] = [PagedLayer(self, i) for i in range(self.num_layers)]
        for layer in layers:
            layer.is_sliding = self._group(layer.index).window is not None
        super().__init__(layers=layers)

    # ------------------------------------------------------------------ layer groups

    def _layer_groups(self, windows: list[int | None]) -> tuple[LayerGroup, ...]:
        """The groups of the pool this cache creates: by window, unless this cache cannot free windows (a split
        model's positions would span devices)."""
        known = {device for device in self._layer_devices if device is not None}
        if not self.groups_layers or len(known) > 1:
            return single_group(len(windows))
        return layer_groups(windows)

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

    def _geometry(self, dtype: torch.dtype, device: torch.device) -> KVGeometry:
        """Each layer's blocks on the device the model runs it on; `device` for layers not known yet."""
        devices = tuple(device if known is None else known for known in self._layer_devices)
        return KVGeometry(self.num_layers, self.num_kv_heads, self.head_dim, dtype, devices[0], devices)

    def _create_pool(self, dtype: torch.dtype, device: torch.device) -> None:
        geometry = self._geometry(dtype, device)
        if self.spill_link is not None:
            self.spill_link.check_pool_budget(self, geometry)
        self._adopt_pool(self._new_pool(geometry))
        # Layers whose device the model did not tell go where their first K/V arrive.
        self._placeable = frozenset(i for i, known in enumerate(self._layer_devices) if known is None)

    def _new_pool(self, geometry: KVGeometry) -> BlockPool:
        """The pool this cache creates when none was given (a subclass storing blocks differently overrides it)."""
        return BlockPool(geometry, groups=self.groups, **self._pool_args)  # type: ignore[arg-type]

    def _adopt_pool(self, pool: BlockPool) -> None:
        g = pool.geometry
        wanted = (self.num_layers, self.num_kv_heads, self.head_dim)
        if (g.num_layers, g.num_kv_heads, g.head_dim) != wanted:
            raise ValueError(
                f"The pool's geometry (layers, kv heads, head dim) = {(g.num_layers, g.num_kv_heads, g.head_dim)} "
                f"does not match the model's {wanted}; create the pool from this model's geometry."
            )
        check_placement(self._layer_devices, [pool.layer_device(i) for i in range(self.num_layers)])
        self.pool = pool
        self.tables = BlockTables(pool, pool.groups[0])
        self._other_tables = [BlockTables(pool, group) for group in pool.groups[1:]]
        self._placeable = frozenset[int]()  # an adopted pool's placement is its owner's choice

    def _ensure_pool(self, key_states: torch.Tensor) -> None:
        if self.pool is None:
            self._create_pool(key_states.dtype, key_states.device)

    def _check_layer_device(self, layer: int, device: torch.device) -> None:
        """K/V of `layer` arrived on `device`, not where its blocks are: place an unknown layer, else refuse."""
        assert self.pool is not None
        if layer in self._placeable and not self.pool.is_written(layer):
            self.pool.place_layer(layer, device)
            return
        raise ValueError(
            f"Layer {layer} stored K/V on {device}, but this cache keeps layer {layer}'s blocks on "
            f"{self.pool.layer_device(layer)} and never moves K/V between devices. Build the cache from the "
            "model after placing it (from_pretrained(device_map=...) or dispatch_model), so each layer's "
            "blocks follow model.hf_device_map, or pass a pool whose KVGeometry.layer_devices match it."
        )

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
        if self._expand_rows_on_next_forward:
            self._expand_matched_rows(batch)
        if layer.index == 0:  # every group still holds the prompt blocks the previous step computed
            prefix_groups.publish_computed(self)
            if self.spill_link is not None:  # after publishing: blocks the tree holds stay resident
                self.spill_link.spill_cold_blocks(self)
        if key_states.device != self.pool.layer_device(layer.index):
            self._check_layer_device(layer.index, key_states.device)
        tables = self._tables_of(layer.index)
        tables.slots_for(batch, layer.length, q_len)
        slots = tables.slots_on(key_states.device)  # one copy per device per step, not per layer
        self._write_tokens(layer, slots, key_states, value_states)
        layer.length += q_len
        if self.attention == "contiguous":
            return self._contiguous_kv(layer)
        return self._hand_view_to_attention(layer, attn_kwargs, key_states, value_states)

    def _expand_matched_rows(self, batch: int) -> None:
        """generate expands inputs for beams / num_return_sequences but not a cache it was given."""
        assert self.tables is not None
        self._expand_rows_on_next_forward = False
        rows = self.tables.batch_size
        if batch != rows and batch % rows == 0:
            self.batch_repeat_interleave(batch // rows)
            if self._row_layouts is not None:
                self._row_layouts = [row for row in self._row_layouts for _ in range(batch // rows)]

    # Extension points: a cache that stores blocks differently (quantized codes, a disk tier) overrides
    # these two and inherits the block tables, generate's bookkeeping and the accounting.

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
        """Drop the last `-tokens_to_remove` tokens (negative, as transformers >= 5 passes it)."""
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
        for layer in self.layers:
            assert isinstance(layer, PagedLayer)
            layer.length = min(layer.length, length)
        self._pending_view = None

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

    # ------------------------------------------------------------------ prefix sharing

    def match(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, pad_token_id: int = 0
    ) -> dict[str, torch.Tensor]:
        """Fill this empty cache with each row's longest cached prefix; returns the inputs for generate.

        See `hf_kvgov.hf.paged_prefix.match`. With a disk tier, the matched blocks stay in memory for as long as
        this cache holds them.
        """
        inputs = paged_prefix.match(self, input_ids, attention_mask, pad_token_id)
        if self.spill_link is not None:
            self.spill_link.after_match(self)
        return inputs

    def publish(self, sequences: torch.Tensor, attention_mask: torch.Tensor | None = None) -> int:
        """Offer this cache's full blocks (prompt and generated) to the prefix tree; returns blocks offered.

        With a disk tier, the spilled blocks it offers come back into memory first. If they cannot
        (`PoolExhausted`, a store that cannot grow, `SpillCorrupted`), that error is raised and nothing has
        changed: no block brought back, none published.
        """
        if self.spill_link is not None:
            self.spill_link.before_publish(self, sequences, attention_mask)
        return paged_prefix.publish(self, sequences, attention_mask)

    def _publish_tokens(self, rows: list[list[int]], sliding_only: bool) -> int:
        """Publish row r's full blocks of `rows[r]` (`sliding_only`: the prompt as computed, `prefix_groups`)."""
        return paged_prefix.publish_tokens(self, rows, self.namespace, sliding_only=sliding_only)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.release()

    # ------------------------------------------------------------------ the disk link's state

    @property
    def _link(self) -> BlockTier:
        """The disk link of a cache that has one (its spilling subclasses)."""
        assert self.spill_link is not None, f"this {type(self).__name__} has no disk tier"
        return self.spill_link

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

    def stats(self) -> CacheStats:
        return paged_cache_stats(self)
