"""`QuantizedCache`: a `PagedCache` whose full blocks are sealed into int8 / int4 / fp8 codes.

Keys are quantized per channel over a block's tokens and values per token (KIVI), by the codecs in
`hf_kvgov.codecs`. What stays in full precision, per row::

    block:    0        1        2       ...      n-2      n-1       n
           [ sink ][ sealed ][ sealed ]  ...  [ sealed ][ resid. ][ tail ]
             fp       codes + scales (one id: a group's layers)     fp      fp: being written

A block is sealed when it is full and older than the `residual` window, at the end of the forward step
that filled it (after the last layer attended, so every layer of one step sees the same K/V). Sealing
encodes the block once, even when beams share it, and hands its full-precision memory back to the pool;
`stats()` counts what is really held: codes + scales + the remaining full-precision blocks.

Hybrid models (sliding-window layers): layers are grouped by window as in PagedCache, each group with its
own tables, and a sliding group frees its blocks, sealed or full precision (the sink too), once no query can
see them; a sealed id, like a block id, spans one group's layers. Sealing walks every group's tables. With
`full_precision_layers` that would share a position of the groups with quantized layers the cache keeps one
group (see `_layer_groups`).

Everything else is PagedCache's: block tables, beams (sealed blocks are immutable and stay shared),
left padding, crop (a crop into a sealed block decodes it back into a writable full-precision block),
and both attention paths. The paged path decodes one chunk of blocks at a time
(`kernels.quantized_reference`); it never builds a full-precision copy of the cache.

Memory: a step holds its own new tokens in full precision until it ends, so a long prompt fed in one
forward briefly needs full-precision blocks for all of it; `generate(..., prefill_chunk_size=n)` bounds
that peak. `max_tokens` / `max_bytes` cap those full-precision blocks; sealed blocks are not capped.
Known limit: the sink is the first block of every row, so a row with more than a block of left padding
has its first real tokens quantized.

Prefix sharing (`prefix=PrefixCache(pool)` on a `QuantizedBlockPool`, `match` / `publish` as PagedCache's):
the tree holds each prefix's sink in full precision and its other blocks as codes, shared by every request
that matches them. Sealing is deterministic, so a request served from the tree reads exactly what it would
have read had it fed the matched prefix itself in one forward and the rest in the next (a chunked prefill
at the match boundary). It is not bit-equal to a one-forward prefill of the whole prompt, whose suffix
attends to the prefix in full precision during that step: the full-precision K/V of a sealed prefix no
longer exist. For the same reason, with `residual` > 0 the newest matched blocks are served sealed where a
cache computing them would still hold them in full precision. Caches sharing a tree share its pool, hence
its formats; `sharing_namespace` keeps caches with other sink blocks apart.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from hf_kvgov.hf import paged_prefix
from hf_kvgov.hf.compat import decoder_config, kv_heads_and_head_dim
from hf_kvgov.hf.paged_cache import (
    PAGED_VIEW_KEY,
    AttentionPath,
    CacheStats,
    PagedCache,
    PagedLayer,
    PagedView,
    resolve_block_size,
)
from hf_kvgov.hf.quant_config import QuantConfig
from hf_kvgov.kernels import dispatch
from hf_kvgov.kernels.quantized_reference import SealedReader, gather_quantized
from hf_kvgov.kernels.sealed_blocks import SealedBlocks
from hf_kvgov.prefix.sharing import PrefixCache
from hf_kvgov.storage.block_table import BlockTables
from hf_kvgov.storage.layer_groups import LayerGroup, single_group
from hf_kvgov.storage.pool import BlockPool, KVGeometry
from hf_kvgov.storage.quantized_pool import QuantizedBlockPool, is_sealed


@dataclass
class QuantizedView(PagedView):
    """The paged attention's view of one layer whose table holds sealed (negative) entries."""

    read_sealed: SealedReader | None = None
    sealed: SealedBlocks | None = None  # the same blocks as stored, for kernels that read codes in place
    after_attend: Callable[[], None] | None = None  # the last layer seals the blocks this step filled

    def attend(
        self, query: torch.Tensor, mask: torch.Tensor | None, scale: float, softcap: float | None
    ) -> torch.Tensor:
        """Attention of `query` `[batch, q_heads, q_len, head_dim]`; returns `[batch, q_len, q_heads, head_dim]`."""
        assert self.read_sealed is not None, "a QuantizedView is built with its sealed-block reader"
        self.consumed = True
        out = dispatch.quantized_paged_attention(
            query,
            self.key_cache,
            self.value_cache,
            self.block_table,
            self.kv_length,
            scale,
            self.read_sealed,
            self.sealed,
            mask=mask,
            softcap=softcap,
        )
        if self.after_attend is not None:
            self.after_attend()
        return out


@dataclass(frozen=True)
class QuantizedCacheStats(CacheStats):
    """`CacheStats` whose bytes are the real bytes held: codes + scales + full-precision blocks."""

    codec: str
    full_precision_blocks: int
    sealed_blocks: int
    full_precision_bytes: int
    sealed_bytes: int
    unquantized_bytes: int  # what a PagedCache would hold for the same blocks
    compression: float  # unquantized_bytes / bytes_used


class QuantizedCache(PagedCache):
    """KV cache in blocks; full blocks are stored as int8 / int4 / fp8 codes plus scales.

    Args:
        model_or_config: the model (its dtype and device are used) or its config.
        bits, fmt, residual, sink_blocks, full_precision_layers, group_size, layer_formats, scale_bytes: see
            `QuantConfig` (``layer_formats={0: "full", 7: "int2"}`` gives layers their own format;
            `QuantConfig.load` reads the map ``kvgov check-quant --recommend`` writes,
            ``QuantizedCache.from_config`` builds from it).
        block_size, max_tokens, max_bytes, attention: as `PagedCache` (the cap bounds full-precision blocks).
        pool: a `QuantizedBlockPool` shared by several caches with the same configuration.
        prefix: a `PrefixCache` over such a pool (its pool is used); enables `match` and `publish`.
        namespace: prefix-sharing namespace; the sealing configuration is added to it (`sharing_namespace`).
    """

    def __init__(
        self,
        model_or_config: Any,
        bits: int = 8,
        fmt: str = "int",
        block_size: int | None = None,
        residual: int = 0,
        sink_blocks: int = 1,
        full_precision_layers: Iterable[int] = (),
        group_size: int | None = None,
        layer_formats: Mapping[int, str] | Iterable[tuple[int, str]] = (),
        scale_bytes: int = 2,
        max_tokens: int | None = None,
        max_bytes: int | None = None,
        pool: BlockPool | None = None,
        attention: AttentionPath = "contiguous",
        prefix: PrefixCache | None = None,
        namespace: str = "",
    ) -> None:
        self.quant = QuantConfig(
            bits, fmt, residual, sink_blocks, tuple(full_precision_layers), group_size, layer_formats, scale_bytes
        )
        config = decoder_config(model_or_config)
        kv_heads, head_dim = kv_heads_and_head_dim(config)
        block_size = resolve_block_size(block_size, pool if pool is not None else prefix.pool if prefix else None)
        self.quant.check_model(int(config.num_hidden_layers), kv_heads, head_dim, block_size)
        # Block columns [sink_blocks, _sealed_columns) are sealed in every row; columns past it may be sealed
        # in some rows only (a matched prefix), so sealing checks each id.
        self._sealed_columns = sink_blocks
        super().__init__(model_or_config, block_size, max_tokens, max_bytes, pool, attention, prefix, namespace)
        self.parts = dataclasses.replace(self.parts, codec=self.quant)

    @classmethod
    def from_config(cls, model_or_config: Any, quant: QuantConfig | str | Path, **kwargs: Any) -> QuantizedCache:
        """A cache sealing blocks as ``quant`` says: a `QuantConfig`, or the path of the JSON file
        ``kvgov check-quant --recommend`` writes (`QuantConfig.load`); ``kwargs`` as for the constructor."""
        q = quant if isinstance(quant, QuantConfig) else QuantConfig.load(quant)
        fields = {
            "bits": q.bits, "fmt": q.fmt, "residual": q.residual, "sink_blocks": q.sink_blocks,
            "full_precision_layers": q.full_precision_layers, "group_size": q.group_size,
            "layer_formats": q.layer_formats, "scale_bytes": q.scale_bytes,
        }  # fmt: skip
        return cls(model_or_config, **fields, **kwargs)

    # ------------------------------------------------------------------ pool

    def _layer_groups(self, windows: list[int | None]) -> tuple[LayerGroup, ...]:
        """PagedCache's groups, unless two layers at one position of them are sealed differently.

        The layers at one position share the sealed store's tensors, so they need one format. A layer kept in full
        precision among quantized ones would either force its whole position, in every group, into full precision
        (changing what the other layers store) or need the full-precision layers to fill whole positions of every
        group, which a handful of layers rarely do. So such a configuration keeps one group, as before layer
        groups: every layer keeps every token, and what each layer stores is what it asked for.
        """
        groups = super()._layer_groups(windows)
        for position in range(len(groups[0].layers)):
            if len({self.quant.layer_format(group.layers[position]) for group in groups}) > 1:
                return single_group(len(windows))
        return groups

    def _new_pool(self, geometry: KVGeometry) -> BlockPool:
        formats = self.quant.formats(self.num_layers, geometry.dtype)
        return QuantizedBlockPool(geometry, formats, groups=self.groups, **self._pool_args)  # type: ignore[arg-type]

    def _adopt_pool(self, pool: BlockPool) -> None:
        if not isinstance(pool, QuantizedBlockPool):
            raise TypeError(
                f"QuantizedCache stores sealed blocks in a QuantizedBlockPool; got a {type(pool).__name__}. "
                "Pass a QuantizedBlockPool built with the same formats (as pool=, or as the pool of prefix=), "
                "or no pool."
            )
        wanted = tuple(f.name for f in self.quant.formats(self.num_layers, pool.geometry.dtype))
        if pool.format_names != wanted:
            raise ValueError(
                f"The pool stores layers as {pool.format_names} but this cache's configuration "
                f"({self.quant.describe()}) needs {wanted}; share a pool only between caches configured alike."
            )
        super()._adopt_pool(pool)

    @property
    def _quantized_pool(self) -> QuantizedBlockPool:
        assert isinstance(self.pool, QuantizedBlockPool), "the pool is created before any K/V is stored"
        return self.pool

    def _reader(self, layer: int) -> SealedReader:
        return functools.partial(self._quantized_pool.read_sealed, layer)

    def _sealed_blocks(self, layer: int) -> SealedBlocks:
        store = self._quantized_pool.sealed
        return SealedBlocks(store.formats[layer].name, store.pieces[layer])

    # ------------------------------------------------------------------ the hot path

    def _update_layer(
        self,
        layer: PagedLayer,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        attn_kwargs: dict[str, Any] | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if layer.index == 0:
            # Normally a no-op: the previous step's last layer sealed already. This catches a model whose
            # last layer does not call update (shared-KV layers) or a step that was interrupted.
            self._seal_ready_blocks()
        kv = super()._update_layer(layer, key_states, value_states, attn_kwargs)
        if self.attention == "contiguous" and layer.index == self.num_layers - 1:
            self._seal_ready_blocks()  # kv is already a copy: sealing cannot change what attention reads
        return kv

    def _contiguous_kv(self, layer: PagedLayer) -> tuple[torch.Tensor, torch.Tensor]:
        pool = self._quantized_pool
        table, first = self._tables_of(layer.index).live_tensor(pool.layer_device(layer.index))
        return gather_quantized(
            pool.keys[layer.index],
            pool.values[layer.index],
            table,
            layer.length - first,
            self._reader(layer.index),
            pool.geometry.dtype,
        )

    def _hand_view_to_attention(
        self,
        layer: PagedLayer,
        attn_kwargs: dict[str, Any] | None,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # PagedCache checks the previous view was read and puts a plain view in the kwargs; replace it by
        # one that decodes sealed blocks.
        kv = super()._hand_view_to_attention(layer, attn_kwargs, key_states, value_states)
        assert attn_kwargs is not None
        plain: PagedView = attn_kwargs[PAGED_VIEW_KEY]
        last = layer.index == self.num_layers - 1
        view = QuantizedView(
            plain.key_cache,
            plain.value_cache,
            plain.block_table,
            plain.kv_length,
            read_sealed=self._reader(layer.index),
            sealed=self._sealed_blocks(layer.index),
            after_attend=self._seal_ready_blocks if last else None,
        )
        attn_kwargs[PAGED_VIEW_KEY] = view
        self._pending_view = view
        return kv

    def _seal_ready_blocks(self) -> None:
        """Seal, in every row of every layer group, the full blocks that left the residual window since the last
        call (and are still in the group's window: a sliding group freed the blocks before `first_block`)."""
        if not any(tables.rows for tables in self.all_tables):
            return
        length = min(layer.length for layer in self.layers if isinstance(layer, PagedLayer))
        ready = max(0, length - self.quant.residual) // self._quantized_pool.block_size
        if ready <= self._sealed_columns:
            return
        for tables in self.all_tables:
            self._seal_columns(tables, max(self._sealed_columns, tables.first_block), ready)
        self._sealed_columns = ready

    def _seal_columns(self, tables: BlockTables, first: int, ready: int) -> None:
        """Seal block columns [first, ready) of one group's rows."""
        if first >= ready or not tables.rows:
            return
        # A row that matched a cached prefix may hold sealed blocks past the frontier already (they are the
        # tree's, encoded by the request that published them); only its full-precision blocks are sealed.
        # A full-precision block the tree also holds would be correct too: seal moves only this row's
        # reference, so the tree keeps the full-precision block and the row gets a private sealed copy. The
        # cost, both copies held and one encode per row that seals it, is why `publish` offers codes instead.
        spots = [(row, c) for row in tables.rows for c in range(first, ready) if not is_sealed(row.block_ids[c])]
        sealed = self._quantized_pool.seal([row.block_ids[c] for row, c in spots])
        for (row, c), block in zip(spots, sealed, strict=True):
            row.block_ids[c] = block
        tables._changed()  # the cached block-table tensor names the released full-precision blocks

    # ------------------------------------------------------------------ generate's bookkeeping

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` tokens; a sealed block that must take writes again is decoded."""
        super().crop(tokens_to_remove)
        if self.tables is None or self.pool is None:
            return
        length = self.get_seq_length()
        whole = length // self.pool.block_size
        if length % self.pool.block_size:
            # Per row: a matched row may hold a sealed block where another row still has a full-precision one.
            # Never a sink column: sinks are not sealed here, and a matched sink is a full-precision block. A
            # sliding group still holds that block: crop refused to go back before what it kept.
            pool = self._quantized_pool
            for tables in self.all_tables:
                for row in tables.rows:
                    if is_sealed(row.block_ids[whole]):
                        row.block_ids[whole] = pool.unseal(row.block_ids[whole])
                tables._changed()
        self._sealed_columns = max(self.quant.sink_blocks, min(self._sealed_columns, whole))

    def _forget(self, close_tier: bool) -> None:
        super()._forget(close_tier)
        self._sealed_columns = self.quant.sink_blocks

    # ------------------------------------------------------------------ prefix sharing

    @property
    def sharing_namespace(self) -> str:
        """The tree namespace of `match` / `publish`: `namespace` plus how this cache seals blocks.

        Caches that seal differently (codec, value groups, statistics' bytes, layers in full precision, sink
        blocks) never share a block; nor does a `PagedCache` on the same pool, which cannot read sealed blocks.
        """
        q = self.quant
        layers = ",".join(map(str, q.full_precision_layers))
        own = ",".join(f"{layer}={name}" for layer, name in q.layer_formats)
        stats = f":s={q.scale_bytes}" if q.scale_bytes != 2 else ""  # the fp16 default keeps its old namespace
        return (
            f"{self.namespace}\x00sealed:{q.codec_name}:g={q.group_size}{stats}:fp=[{layers}]:sink={q.sink_blocks}"
            + (f":layers=[{own}]" if own else "")
        )

    def match(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, pad_token_id: int = 0
    ) -> dict[str, torch.Tensor]:
        """As `PagedCache.match`; the matched prefix is then sealed as if this cache had computed it."""
        inputs = paged_prefix.match(self, input_ids, attention_mask, pad_token_id, namespace=self.sharing_namespace)
        # A cache that computed the prefix would have sealed its ready blocks at the end of that step: rows'
        # padding blocks (masked, zeroed) and any full-precision block past the sink that the tree holds
        # (published without `publish`'s sealed copies). Sealing them before the prefill frees their
        # full-precision memory before the prefill needs its own, and the suffix reads what that cache would.
        self._seal_ready_blocks()
        if self.spill_link is not None:
            self.spill_link.after_match(self)
        return inputs

    def publish(self, sequences: torch.Tensor, attention_mask: torch.Tensor | None = None) -> int:
        """As `PagedCache.publish`; full blocks still in full precision past the sink go to the tree sealed."""
        if self.spill_link is not None:
            self.spill_link.before_publish(self, sequences, attention_mask)
        return paged_prefix.publish(
            self, sequences, attention_mask, namespace=self.sharing_namespace, sealed_from=self.quant.sink_blocks
        )

    def _publish_tokens(self, rows: list[list[int]], sliding_only: bool) -> int:
        return paged_prefix.publish_tokens(
            self, rows, self.sharing_namespace, sealed_from=self.quant.sink_blocks, sliding_only=sliding_only
        )

    # ------------------------------------------------------------------ accounting

    def stats(self) -> QuantizedCacheStats:
        base = super().stats()
        pool = self.pool if isinstance(self.pool, QuantizedBlockPool) else None
        distinct = {block for tables in self.all_tables for row in tables.rows for block in row.live_ids}
        sealed = sum(1 for block in distinct if is_sealed(block))
        full_bytes = (len(distinct) - sealed) * (pool.bytes_per_block if pool else 0)
        sealed_bytes = sealed * (pool.sealed.bytes_per_block if pool else 0)
        used = full_bytes + sealed_bytes
        store = pool.sealed_stats() if pool else None
        fields = asdict(base)
        fields.update(
            bytes_used=used,
            bytes_per_token=used / base.tokens if base.tokens else 0.0,
            pool_blocks_reserved=base.pool_blocks_reserved + (store.capacity_blocks if store else 0),
            pool_bytes_reserved=base.pool_bytes_reserved + (store.bytes_reserved if store else 0),
        )
        return QuantizedCacheStats(
            **fields,
            codec=self.quant.codec_name,
            full_precision_blocks=len(distinct) - sealed,
            sealed_blocks=sealed,
            full_precision_bytes=full_bytes,
            sealed_bytes=sealed_bytes,
            unquantized_bytes=base.bytes_used,
            compression=base.bytes_used / used if used else 1.0,
        )
