"""`BlockStore`: the block store every block-storing chain keeps its K/V in, without a model.

Per layer group, block tables over one `BlockPool` (a sliding group frees the blocks that left its window);
the links it calls at fixed points of its lifetime, each None when the chain leaves it out: the codec link
(`BlockSealer`: full blocks sealed into codes), the disk link (`BlockTier`: cold blocks spilled to a file) and
prefix sharing (`paged_prefix`, `prefix_groups`: rows start from a tree's blocks). `hf_kvgov.hf.paged_cache`
puts the transformers `Cache` interface on it; nothing here knows a model, only its geometry.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

import torch

from hf_kvgov.engine import disk_prefix, paged_pool, paged_prefix, prefix_groups
from hf_kvgov.engine.attention_view import VIEW_KEY
from hf_kvgov.engine.block_sealer import BlockSealer
from hf_kvgov.engine.block_stats import CacheStats, block_cache_stats
from hf_kvgov.engine.block_tier import BlockTier
from hf_kvgov.engine.paged_view import PagedView
from hf_kvgov.engine.parts import ChainParts, Paging
from hf_kvgov.engine.prefix_layout import RowLayout
from hf_kvgov.engine.quant_config import QuantConfig
from hf_kvgov.engine.rules import layout_for
from hf_kvgov.prefix.sharing import PrefixCache
from hf_kvgov.storage.block_table import BlockTables
from hf_kvgov.storage.layer_groups import GroupLayout, LayerGroup, layer_groups, single_group
from hf_kvgov.storage.pool import DEFAULT_BLOCK_SIZE, BlockPool, KVGeometry
from hf_kvgov.tiers.disk_tier import DiskTier
from hf_kvgov.tiers.prefetch import LayerPrefetcher
from hf_kvgov.tiers.spill_config import Disk
from hf_kvgov.tiers.tiered_tables import TieredBlockTables

AttentionPath = Literal["contiguous", "paged"]


class StoreLayer(Protocol):
    """One layer's tokens as the store counts them (`hf_kvgov.hf.paged_layer.PagedLayer` is one)."""

    index: int
    length: int

    def reset(self) -> None: ...


class BlockStore:
    """K/V in fixed-size blocks of a `BlockPool`, per layer group, with the chain's codec, disk and prefix links.

    Args:
        num_layers, num_kv_heads, head_dim: the model's K/V geometry.
        windows: each layer's sliding window (None: full attention); layers are grouped by it.
        layer_devices: where each layer runs (None: where its first K/V arrive).
        dtype_device: the dtype and first device of the model's K/V, to create the pool at once (None: at the
            first K/V).
        block_size, max_tokens, max_bytes, pool, attention, prefix, namespace, codec, spill: as `PagedCache`.
    """

    # Whether the pool this store creates groups layers by window; False keeps one group of every layer, every
    # token in every layer (the benchmarks measure the two side by side).
    groups_layers = True

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        windows: list[int | None],
        layer_devices: tuple[torch.device | None, ...],
        dtype_device: tuple[torch.dtype, torch.device] | None,
        *,
        block_size: int | None,
        max_tokens: int | None,
        max_bytes: int | None,
        pool: BlockPool | None,
        attention: AttentionPath,
        prefix: PrefixCache | None,
        namespace: str,
        codec: QuantConfig | None,
        spill: Disk | None,
    ) -> None:
        # The chain's rules refuse what cannot work before anything is built, as for a chain built by name.
        size = block_size if block_size is not None else prefix.block_size if prefix else DEFAULT_BLOCK_SIZE
        asked = Paging(size, max_tokens, max_bytes) if pool is None else pool
        layout_for(ChainParts(pool=asked, prefix=prefix, codec=codec, spill=spill, attention=attention))
        # The links come first: the pool may be created below, and each link shapes it.
        self.sealer = None if codec is None else BlockSealer(codec)
        self.spill_link = None if spill is None else BlockTier(spill, sealed=codec)
        if spill is not None:
            block_size = disk_prefix.cache_block_size(prefix, spill, block_size, sealed=codec)
            max_bytes = spill.max_resident_bytes  # blocks and read-ahead rows (charged to the pool) together
        block_size = resolve_block_size(block_size, pool if pool is not None else prefix.pool if prefix else None)
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.windows = tuple(windows)  # each layer's sliding window, None for full attention
        if codec is not None:
            codec.check_model(num_layers, num_kv_heads, head_dim, block_size)
        self.attention: AttentionPath = attention
        self.pool_args: dict[str, int | None] = {
            "block_size": block_size,
            "max_tokens": max_tokens,
            "max_bytes": max_bytes,
        }
        self.pool: BlockPool | None = None
        self.tables: BlockTables | None = None  # the first layer group's (the only one without sliding groups)
        self.other_tables: list[BlockTables] = []  # the other groups', in `groups` order
        self._pending_view: PagedView | None = None
        self.prefix = prefix
        self.namespace = namespace
        self.store_layers: list[StoreLayer] = []  # each layer's token count, kept by the adapter's layer objects
        # Prefix sharing's state (`paged_prefix`): the tree locks this store holds, each row's layout after a
        # match, prompt blocks published as computed (a tree over layer groups), and whether generate's
        # expansion of the matched rows is still to come.
        self.prefix_locks: list[int] = []
        self.row_layouts: list[RowLayout] | None = None
        self.published_blocks = 0
        self.expand_rows_on_next_forward = False
        if prefix is not None:
            pool = prefix.pool  # the rules refused any other
        self.layer_devices = layer_devices  # None: the first K/V tells
        self.placeable = frozenset[int]()  # layers placed where their first K/V arrive (`paged_pool`)
        groups = pool.groups if pool is not None else self._layer_groups(windows)
        self.layout = GroupLayout.of(groups, num_layers)
        if pool is not None:
            paged_pool.adopt_pool(self, pool)
        elif dtype_device is not None and None not in layer_devices:
            paged_pool.create_pool(self, *dtype_device)

    def stored_tokens(self) -> int:
        """Tokens every layer has stored (the absolute position of the next token)."""
        layers = self.store_layers
        return layers[0].length if layers else 0

    # ------------------------------------------------------------------ layer groups

    def _layer_groups(self, windows: list[int | None]) -> tuple[LayerGroup, ...]:
        """The groups of the pool this store creates: by window, unless it cannot free windows (a split model's
        positions would span devices)."""
        known = {device for device in self.layer_devices if device is not None}
        if not self.groups_layers or len(known) > 1:
            return single_group(len(windows))
        groups = layer_groups(windows)
        return groups if self.sealer is None else self.sealer.layer_groups(groups)

    @property
    def groups(self) -> tuple[LayerGroup, ...]:
        return self.layout.groups

    def group(self, layer: int) -> LayerGroup:
        return self.layout.groups[self.layout.group_of[layer]]

    def tables_of(self, layer: int) -> BlockTables:
        assert self.tables is not None
        group = self.layout.group_of[layer]
        return self.tables if group == 0 else self.other_tables[group - 1]

    @property
    def all_tables(self) -> list[BlockTables]:
        """The block tables of every layer group (one group: `[self.tables]`)."""
        return [] if self.tables is None else [self.tables, *self.other_tables]

    def first_kept_token(self, layer: int, position: int) -> int:
        """The first token layer `layer` keeps while queries start at `position` (0 outside sliding groups); known
        before the pool exists (the mask asks first), from the block size the pool gets."""
        return self.group(layer).first_kept(position, self.pool_args["block_size"])  # type: ignore[arg-type]

    def block_bytes(self, geometry: KVGeometry) -> int:
        """Bytes of one full-precision block of the pool this store creates: one position of every layer group."""
        block_size = self.pool_args["block_size"]
        assert block_size is not None
        return geometry.bytes_per_token // geometry.num_layers * len(self.layout.heads) * block_size

    def ensure_pool(self, key_states: torch.Tensor) -> None:
        if self.pool is None:
            paged_pool.create_pool(self, key_states.dtype, key_states.device)

    # ------------------------------------------------------------------ the hot path

    def update_layer(
        self,
        layer: StoreLayer,
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
        if self.expand_rows_on_next_forward:
            self._expand_matched_rows(batch)
        if layer.index == 0:  # every group still holds the prompt blocks the previous step computed
            prefix_groups.publish_computed(self)
            if self.spill_link is not None:  # after publishing: blocks the tree holds stay resident
                self.spill_link.spill_cold_blocks(self)
        if key_states.device != self.pool.layer_device(layer.index):
            paged_pool.check_layer_device(self, layer.index, key_states.device)
        tables = self.tables_of(layer.index)
        tables.slots_for(batch, layer.length, q_len)
        slots = tables.slots_on(key_states.device)  # one copy per device per step, not per layer
        self._write_tokens(layer, slots, key_states, value_states)
        layer.length += q_len
        if self.attention == "paged":
            return self._hand_view_to_attention(layer, attn_kwargs, key_states, value_states)
        kv = self.contiguous_kv(layer)
        if self.sealer is not None and layer.index == self.num_layers - 1:
            self.sealer.seal_ready_blocks(self)  # kv is already a copy: sealing cannot change what attention reads
        return kv

    def _expand_matched_rows(self, batch: int) -> None:
        """generate expands inputs for beams / num_return_sequences but not a cache it was given."""
        assert self.tables is not None
        self.expand_rows_on_next_forward = False
        rows = self.tables.batch_size
        if batch != rows and batch % rows == 0:
            self.reorder_rows([i for i in range(rows) for _ in range(batch // rows)])
            if self.row_layouts is not None:
                self.row_layouts = [row for row in self.row_layouts for _ in range(batch // rows)]

    def _write_tokens(
        self, layer: StoreLayer, slots: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor
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
        return self.contiguous_kv(self.store_layers[index])

    def contiguous_kv(self, layer: StoreLayer) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K/V as `[batch, kv_heads, length, head_dim]` for any attention implementation."""
        if self.sealer is not None:  # sealed blocks decoded, spilled ones read back
            return self.sealer.contiguous_kv(self, layer)
        if self.spill_link is not None and (kv := self.spill_link.raw_kv(self, layer)) is not None:
            return kv
        assert self.pool is not None
        table, first = self.tables_of(layer.index).live_tensor(self.pool.layer_device(layer.index))
        return self.pool.gather(layer.index, table, layer.length - first)

    def _hand_view_to_attention(
        self,
        layer: StoreLayer,
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
        table, first = self.tables_of(layer.index).live_tensor(self.pool.layer_device(layer.index))
        view = PagedView(self.pool.keys[layer.index], self.pool.values[layer.index], table, layer.length - first)
        if self.sealer is not None:  # a view that decodes sealed entries (spilled ones read back)
            view = self.sealer.paged_view(self, layer, view)
        elif self.spill_link is not None:
            self.spill_link.add_raw_to_view(self, layer, view)
        attn_kwargs[VIEW_KEY] = view
        self._pending_view = view
        return key_states, value_states

    # ------------------------------------------------------------------ rows and lengths

    def reorder_rows(self, indices: list[int]) -> None:
        """Row i becomes old row indices[i]; blocks are shared, copied only when written."""
        for tables in self.all_tables:
            if tables.rows:
                tables.reorder(indices)

    def fork_into(self, copy: BlockStore) -> None:
        """Give `copy`, a new store of this configuration on the same pool, every token this one holds.

        Each row's blocks are shared (one more reference each, copied only when a row writes into one, as beams
        share them) and the prefix tree's blocks locked once more. A disk tier's cold blocks live in this store's
        own spill file, so a store with one is not forked (its cache refuses first).
        """
        assert self.spill_link is None and copy.pool is self.pool
        if self.tables is not None:
            copy.tables = self.tables.fork()
            copy.other_tables = [tables.fork() for tables in self.other_tables]
        for layer, copied in zip(self.store_layers, copy.store_layers, strict=True):
            copied.length = layer.length
        if self.prefix is not None and self.prefix_locks:
            self.prefix.lock(self.prefix_locks)
            copy.prefix_locks = list(self.prefix_locks)
        copy.row_layouts = None if self.row_layouts is None else list(self.row_layouts)
        copy.published_blocks = self.published_blocks
        copy.expand_rows_on_next_forward = self.expand_rows_on_next_forward
        if self.sealer is not None and copy.sealer is not None:
            copy.sealer.sealed_columns = self.sealer.sealed_columns

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens of every row; a spilled block the new tail falls in comes back, and a
        sealed one is decoded (the next write lands there)."""
        for tables in self.all_tables:  # a sliding group refuses before any group changes (it is checked first)
            tables.check_truncate(length)
        if self.spill_link is not None and self.tables is not None and self.tables.rows:
            self.spill_link.before_truncate(self, length)
        for tables in self.all_tables:
            tables.truncate(length)
        if self.spill_link is not None:
            self.spill_link.after_truncate()
        for layer in self.store_layers:
            layer.length = min(layer.length, length)
        self._pending_view = None
        if self.sealer is not None:
            self.sealer.after_crop(self)

    def forget(self, close_tier: bool) -> None:
        """Every token forgotten and every block back to the pool; `close_tier` also closes the spill file."""
        if self.spill_link is not None:
            self.spill_link.before_release()
        for tables in self.all_tables:
            tables.release()
        paged_prefix.release_prefix_locks(self)
        self.expand_rows_on_next_forward = False
        for layer in self.store_layers:
            layer.reset()
        self._pending_view = None
        if self.spill_link is not None:
            self.spill_link.after_release(close=close_tier)
        if self.sealer is not None:
            self.sealer.forget()

    def release(self) -> None:
        """Return every block this cache holds to the pool (blocks published to a prefix cache stay there); with a
        disk tier, also stop its reader thread and delete the spill file (and a private directory)."""
        self.forget(close_tier=True)

    # ------------------------------------------------------------------ prefix sharing

    def match(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, pad_token_id: int = 0
    ) -> dict[str, torch.Tensor]:
        """Fill this empty cache with each row's longest cached prefix; returns the inputs for generate.

        See `hf_kvgov.engine.paged_prefix.match`. With a codec, the matched prefix is then sealed as if this cache had
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
            self, sequences, attention_mask, namespace=self.sharing_namespace, sealed_from=self.sealed_from
        )

    def publish_tokens(self, rows: list[list[int]], sliding_only: bool) -> int:
        """Publish row r's full blocks of `rows[r]` (`sliding_only`: the prompt as computed, `prefix_groups`)."""
        return paged_prefix.publish_tokens(
            self, rows, self.sharing_namespace, sealed_from=self.sealed_from, sliding_only=sliding_only
        )

    @property
    def sharing_namespace(self) -> str:
        """The tree namespace of `match` / `publish`: `namespace`, plus how this cache seals blocks with a codec
        (caches sealing differently never share a block, nor does a cache without a codec on the same pool)."""
        return self.namespace if self.sealer is None else self.sealer.namespace(self.namespace)

    @property
    def sealed_from(self) -> int | None:
        """The first block column `publish` offers sealed (past the sink); None without a codec."""
        return None if self.sealer is None else self.sealer.quant.sink_blocks

    # ------------------------------------------------------------------ the disk link's state

    @property
    def disk(self) -> Disk:
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
        """What this cache holds: blocks and bytes (`CacheStats`); with a codec, the bytes as stored
        (`QuantizedCacheStats`); with a disk tier, memory only plus the tier's counters (`DiskCacheStats`, or
        `QuantizedDiskCacheStats` with both links)."""
        return block_cache_stats(self)


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
