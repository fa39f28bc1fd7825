"""`QuantizedCache`: the block store with a codec link, whose full blocks are sealed into int8 / int4 / fp8 codes.

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

The sealing itself is the codec link's (`hf_kvgov.engine.block_sealer.BlockSealer`), which `PagedCache` calls; this
class only configures it. Everything else is PagedCache's: block tables, beams (sealed blocks are immutable and
stay shared), left padding, crop (a crop into a sealed block decodes it back into a writable full-precision block),
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

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from hf_kvgov.engine.paged_view import QuantizedView
from hf_kvgov.engine.quant_config import QuantConfig
from hf_kvgov.engine.quantized_stats import QuantizedCacheStats
from hf_kvgov.hf.paged_cache import AttentionPath, PagedCache
from hf_kvgov.prefix.sharing import PrefixCache
from hf_kvgov.storage.pool import BlockPool
from hf_kvgov.storage.quantized_pool import QuantizedBlockPool

__all__ = ["QuantizedCache", "QuantizedCacheStats", "QuantizedView"]


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
        quant = QuantConfig(
            bits, fmt, residual, sink_blocks, tuple(full_precision_layers), group_size, layer_formats, scale_bytes
        )
        super().__init__(
            model_or_config, block_size, max_tokens, max_bytes, pool, attention, prefix, namespace, codec=quant
        )

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

    @property
    def quant(self) -> QuantConfig:
        """How this cache seals blocks (its codec link's configuration)."""
        assert self.sealer is not None, "a QuantizedCache is built with a codec link"
        return self.sealer.quant

    @property
    def _quantized_pool(self) -> QuantizedBlockPool:
        assert isinstance(self.pool, QuantizedBlockPool), "the pool is created before any K/V is stored"
        return self.pool

    def stats(self) -> QuantizedCacheStats:
        stats = super().stats()
        assert isinstance(stats, QuantizedCacheStats)
        return stats
