"""`QuantizedCache`: the block store with a codec link, whose full blocks are sealed into int8 / int4 / fp8 codes.

Keys are quantized per channel over a block's tokens, values per token (KIVI, `hf_kvgov.codecs`); `QuantizedCache`
gives a row's layout and when a block is sealed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

from hf_kvgov.engine.block_stats import QuantizedCacheStats
from hf_kvgov.engine.paged_view import QuantizedView
from hf_kvgov.engine.quant_config import QuantConfig
from hf_kvgov.hf.compat import decoder_config, kv_heads_and_head_dim
from hf_kvgov.hf.paged_cache import AttentionPath, PagedCache
from hf_kvgov.prefix.sharing import PrefixCache
from hf_kvgov.storage.pool import BlockPool
from hf_kvgov.storage.quantized_pool import QuantizedBlockPool

__all__ = ["QuantizedCache", "QuantizedCacheStats", "QuantizedView"]


def quant_config_for(
    model_or_config: Any,
    residual: int | None = None,
    group_size: int | str | None = "auto",
    scale_bytes: int | None = None,
    **fields: Any,
) -> QuantConfig:
    """`QuantConfig.filled` at this model's head_dim: the settings left out (None, group_size "auto") take the
    format's measured defaults, ``fields`` as given."""
    head_dim = kv_heads_and_head_dim(decoder_config(model_or_config))[1]
    return QuantConfig.filled(head_dim, residual, group_size, scale_bytes, **fields)


class QuantizedCache(PagedCache):
    """KV cache in blocks; full blocks are stored as int8 / int4 / fp8 codes plus scales.

    Per row::

        block:    0        1        2       ...      n-2      n-1       n
               [ sink ][ sealed ][ sealed ]  ...  [ sealed ][ resid. ][ tail ]
                 fp       codes + scales (one id: a group's layers)     fp      fp: being written

    A full block older than `residual` is sealed after the last layer of the step that filled it, so every layer
    of a step sees the same K/V; until then it is full precision, so ``prefill_chunk_size`` bounds a long prompt's
    peak (`max_tokens` caps those blocks; `max_bytes` every byte, codes included). The sink is each row's first
    block, so a row with over a block of left padding has its first real tokens quantized. Sealing is
    deterministic, so over a prefix tree a request reads what a chunked prefill at the match boundary would;
    caches sharing a tree share its pool, hence its formats.

    Args:
        model_or_config: the model (its dtype and device are used) or its config.
        bits, fmt, residual, sink_blocks, full_precision_layers, group_size, layer_formats, scale_bytes: see
            `QuantConfig`. ``residual``, ``group_size`` and ``scale_bytes`` left out take the format's measured
            defaults (`QuantConfig.filled`): for ``bits=2``, KIVI's (the newest 32 tokens in full precision, value
            groups of 32 channels where head_dim allows), else 0 and one scale per token and head; fp16
            statistics. (``layer_formats={0: "full", 7: "int2"}`` gives layers their own format;
            `QuantConfig.load` reads the map ``kvgov check-quant --recommend`` writes,
            ``QuantizedCache.from_config`` builds from it).
        block_size, max_tokens, max_bytes, attention: as `PagedCache` (`max_tokens` bounds full-precision
            blocks, `max_bytes` every byte the pool holds, sealed codes included).
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
        residual: int | None = None,
        sink_blocks: int = 1,
        full_precision_layers: Iterable[int] = (),
        group_size: int | Literal["auto"] | None = "auto",
        layer_formats: Mapping[int, str] | Iterable[tuple[int, str]] = (),
        scale_bytes: int | None = None,
        max_tokens: int | None = None,
        max_bytes: int | None = None,
        pool: BlockPool | None = None,
        attention: AttentionPath = "contiguous",
        prefix: PrefixCache | None = None,
        namespace: str = "",
    ) -> None:
        quant = quant_config_for(
            model_or_config, residual, group_size, scale_bytes, bits=bits, fmt=fmt, sink_blocks=sink_blocks,
            full_precision_layers=tuple(full_precision_layers), layer_formats=layer_formats,
        )  # fmt: skip
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
