"""`BlockSealer`: the codec link of a block cache, which seals full blocks into int8 / int4 / fp8 codes.

A `PagedCache` given a codec stores its blocks in a `QuantizedBlockPool` and calls this link where a sealing cache
differs from a full-precision one: the layer groups and pool it may have, when ready blocks are sealed (a step's
start, its last layer), how attention reads sealed entries (the reference gather, or the paged kernels through a
`QuantizedView`), what a crop into a sealed block does (decode it back), the tree namespace its blocks are shared
under, and what it counts. With a disk link its spilled blocks are codes: `tier_format` lays them out, and a
layer's reads append them after the sealed store's, so every attention path decodes them as sealed blocks.
`QuantizedCache`'s docstring says what stays in full precision.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from hf_kvgov.engine.block_tier import SpillFormat
from hf_kvgov.engine.paged_view import PagedView, QuantizedView
from hf_kvgov.engine.quant_config import QuantConfig
from hf_kvgov.kernels.quantized_reference import SealedReader, gather_quantized
from hf_kvgov.kernels.sealed_blocks import SealedBlocks
from hf_kvgov.storage.block_table import BlockTables
from hf_kvgov.storage.layer_groups import LayerGroup
from hf_kvgov.storage.pool import BlockPool, KVGeometry
from hf_kvgov.storage.quantized_pool import QuantizedBlockPool, is_sealed
from hf_kvgov.tiers.kv_segments import SEALED_SPILLED_IDS
from hf_kvgov.tiers.sealed_segments import (
    after_the_store,
    empty_pieces,
    read_store_or_stack,
    sealed_blocks,
    sealed_tier_layout,
)

if TYPE_CHECKING:
    from hf_kvgov.engine.block_store import BlockStore, StoreLayer

# What a layer reads when some of its blocks spilled: its block table, a reader of sealed entries, and (for
# kernels reading codes in place) the sealed blocks with the read-back ones after the store's.
SpilledRead = tuple[torch.Tensor, SealedReader, SealedBlocks | None]


class BlockSealer:
    """The codec link of one block cache (see the module docstring); the cache passes itself to each call."""

    def __init__(self, quant: QuantConfig) -> None:
        self.quant = quant
        # Block columns [sink_blocks, sealed_columns) are sealed in every row; columns past it may be sealed in
        # some rows only (a matched prefix), so sealing checks each id.
        self.sealed_columns = quant.sink_blocks

    # ------------------------------------------------------------------ the pool

    def layer_groups(self, groups: tuple[LayerGroup, ...]) -> tuple[LayerGroup, ...]:
        """The block cache's groups, unless its formats need one group (`QuantConfig.layer_groups` says why)."""
        return self.quant.layer_groups(groups)

    def new_pool(self, geometry: KVGeometry, groups: tuple[LayerGroup, ...], **pool_args: int | None) -> BlockPool:
        formats = self.quant.formats(geometry.num_layers, geometry.dtype)
        return QuantizedBlockPool(geometry, formats, groups=groups, **pool_args)  # type: ignore[arg-type]

    def sealed_block_bytes(self, geometry: KVGeometry, heads: Sequence[int], block_size: int) -> int:
        """Bytes of one sealed block of the pool this configuration creates: one layer of each position (`heads`)."""
        formats = self.quant.formats(geometry.num_layers, geometry.dtype)
        return sum(formats[head].block_bytes(block_size, geometry.num_kv_heads, geometry.head_dim) for head in heads)

    def check_pool(self, pool: BlockPool, num_layers: int) -> None:
        """Refuse a pool (given, or a prefix tree's) that cannot hold this configuration's sealed blocks."""
        if not isinstance(pool, QuantizedBlockPool):
            raise TypeError(
                f"A cache with a codec stores sealed blocks in a QuantizedBlockPool; got a {type(pool).__name__}. "
                "Pass a QuantizedBlockPool built with the same formats (as pool=, or as the pool of prefix=), "
                "or no pool."
            )
        wanted = tuple(f.name for f in self.quant.formats(num_layers, pool.geometry.dtype))
        if pool.format_names != wanted:
            raise ValueError(
                f"The pool stores layers as {pool.format_names} but this cache's configuration "
                f"({self.quant.describe()}) needs {wanted}; share a pool only between caches configured alike (for a "
                "prefix tree, build it with the cache's codec settings: prefix_tree(model, codec=..., layers=...))."
            )

    @staticmethod
    def pool_of(cache: BlockStore) -> QuantizedBlockPool:
        assert isinstance(cache.pool, QuantizedBlockPool), "the pool is created before any K/V is stored"
        return cache.pool

    def tier_format(self, pool: BlockPool, extent_blocks: int) -> SpillFormat:
        """Sealed blocks spill as their codes (the sink stays); their entries are numbered below -2**62."""
        assert isinstance(pool, QuantizedBlockPool)
        layout = sealed_tier_layout(pool, extent_blocks)
        return SpillFormat(layout, sealed_blocks(pool), self.quant.sink_blocks, SEALED_SPILLED_IDS)

    # ------------------------------------------------------------------ sealing

    def seal_ready_blocks(self, cache: BlockStore) -> None:
        """Seal, in every row of every layer group, the full blocks that left the residual window since the last
        call (and are still in the group's window: a sliding group freed the blocks before `first_block`)."""
        if not any(tables.rows for tables in cache.all_tables):
            return
        length = min(layer.length for layer in cache.store_layers)
        ready = max(0, length - self.quant.residual) // self.pool_of(cache).block_size
        if ready <= self.sealed_columns:
            return
        for tables in cache.all_tables:
            self._seal_columns(cache, tables, max(self.sealed_columns, tables.first_block), ready)
        self.sealed_columns = ready

    def _seal_columns(self, cache: BlockStore, tables: BlockTables, first: int, ready: int) -> None:
        """Seal block columns [first, ready) of one group's rows."""
        if first >= ready or not tables.rows:
            return
        # A row that matched a cached prefix may hold sealed blocks past the frontier already (they are the
        # tree's, encoded by the request that published them); only its full-precision blocks are sealed.
        # A full-precision block the tree also holds would be correct too: seal moves only this row's
        # reference, so the tree keeps the full-precision block and the row gets a private sealed copy. The
        # cost, both copies held and one encode per row that seals it, is why `publish` offers codes instead.
        spots = [(row, c) for row in tables.rows for c in range(first, ready) if not is_sealed(row.block_ids[c])]
        sealed = self.pool_of(cache).seal([row.block_ids[c] for row, c in spots])
        for (row, c), block in zip(spots, sealed, strict=True):
            row.block_ids[c] = block
        tables.invalidate_views()  # the cached block-table tensor names the released full-precision blocks

    # ------------------------------------------------------------------ what attention reads

    def _reader(self, cache: BlockStore, layer: int) -> SealedReader:
        return functools.partial(self.pool_of(cache).read_sealed, layer)

    def contiguous_kv(self, cache: BlockStore, layer: StoreLayer) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K/V decoded as `[batch, kv_heads, length, head_dim]`, spilled blocks read back."""
        pool, i = self.pool_of(cache), layer.index
        spilled = self._with_spilled(cache, i)
        if spilled is None:
            table, first = cache.tables_of(i).live_tensor(pool.layer_device(i))
            read = self._reader(cache, i)
        else:
            table, read, _ = spilled
            first = cache.tables_of(i).first_block * pool.block_size  # the layout starts there, as attention does
        return gather_quantized(pool.keys[i], pool.values[i], table, layer.length - first, read, pool.geometry.dtype)

    def paged_view(self, cache: BlockStore, layer: StoreLayer, plain: PagedView) -> QuantizedView:
        """`plain` as a view that decodes sealed entries; the last layer's seals the blocks the step filled."""
        i = layer.index
        store = self.pool_of(cache).sealed
        table, read, sealed = self._with_spilled(cache, i, in_place=True) or (
            plain.block_table,
            self._reader(cache, i),
            SealedBlocks(store.formats[i].name, store.pieces[i]),
        )
        last = i == cache.num_layers - 1
        return QuantizedView(
            plain.key_cache,
            plain.value_cache,
            table,
            plain.kv_length,
            read_sealed=read,
            sealed=sealed,
            after_attend=functools.partial(self.seal_ready_blocks, cache) if last else None,
        )

    def _with_spilled(self, cache: BlockStore, layer: int, in_place: bool = False) -> SpilledRead | None:
        """This layer's (block table, sealed reader, sealed blocks), its spilled blocks read back and numbered
        after the store's; None without a disk link or when nothing has spilled.

        The reader copies only the blocks it is asked for. The sealed blocks, for kernels that read codes in
        place (`in_place`, the paged path), are the store's pieces followed by the read-back ones: one copy of
        the layer's store per step.
        """
        tier = cache.spill_link
        layout = None if tier is None else tier.spilled_layout(cache, layer)
        if tier is None or layout is None:
            return None
        pool = self.pool_of(cache)
        stack = empty_pieces(pool, layer, len(layout.handles), pool.layer_device(layer))
        tier.take(cache, layer, layout.handles, list(stack.values()))
        stored, fmt = pool.sealed.pieces[layer], pool.sealed.formats[layer]

        def read(entries: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
            return fmt.decode(read_store_or_stack(stored, stack, -1 - entries), dtype)

        if not in_place:
            return after_the_store(pool, layout), read, None
        # Kernels reading codes in place take one tensor per piece: the store's, then the stack (one copy).
        pieces = {name: torch.cat([stored[name], stack[name]]) for name in stored}
        return after_the_store(pool, layout), read, SealedBlocks(fmt.name, pieces)

    # ------------------------------------------------------------------ generate's bookkeeping

    def after_crop(self, cache: BlockStore) -> None:
        """A sealed block that must take writes again (the crop ends inside it) is decoded back."""
        if cache.tables is None or cache.pool is None:
            return
        length = cache.stored_tokens()
        whole = length // cache.pool.block_size
        if length % cache.pool.block_size:
            # Per row: a matched row may hold a sealed block where another row still has a full-precision one.
            # Never a sink column: sinks are not sealed here, and a matched sink is a full-precision block. A
            # sliding group still holds that block: crop refused to go back before what it kept.
            pool = self.pool_of(cache)
            for tables in cache.all_tables:
                for row in tables.rows:
                    if is_sealed(row.block_ids[whole]):
                        row.block_ids[whole] = pool.unseal(row.block_ids[whole])
                tables.invalidate_views()
        self.sealed_columns = max(self.quant.sink_blocks, min(self.sealed_columns, whole))

    def forget(self) -> None:
        self.sealed_columns = self.quant.sink_blocks

    # ------------------------------------------------------------------ prefix sharing and accounting

    def namespace(self, base: str) -> str:
        return self.quant.namespace(base)
