"""Build the cache for a chain: `GovernedCache` checks the parts and calls the one builder of their storage layout."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from hf_kvgov.engine.parts import (
    ChainParts,
    Disk,
    Evict,
    HeavyHitter,
    Layer,
    Paging,
    Policy,
    Sink,
    codec_config,
)
from hf_kvgov.engine.quant_config import QuantConfig
from hf_kvgov.engine.rules import layout_for
from hf_kvgov.hf.compat import cached_layer_count, decoder_config
from hf_kvgov.hf.disk_cache import DiskOffloadCache
from hf_kvgov.hf.eviction import HeavyHitterCache, PolicyCache, SinkCache
from hf_kvgov.hf.eviction.pooled_slots import eviction_pool
from hf_kvgov.hf.governed import GovernedCacheBase
from hf_kvgov.hf.paged_cache import PagedCache
from hf_kvgov.hf.quantized_cache import QuantizedCache, quant_config_for
from hf_kvgov.hf.quantized_disk_cache import QuantizedDiskCache
from hf_kvgov.prefix.sharing import PrefixCache
from hf_kvgov.storage.pool import BlockPool


def GovernedCache(
    model_or_config: Any,
    *,
    pool: Paging | BlockPool | None = None,
    prefix: PrefixCache | None = None,
    namespace: str = "",
    codec: str | QuantConfig | None = None,
    policy: Policy | None = None,
    spill: Disk | None = None,
    layers: Mapping[int, Layer] | None = None,
    attention: str = "contiguous",
) -> GovernedCacheBase:
    """The cache these parts make, checked by `hf_kvgov.engine.rules` (`ChainRefused` says why not).

    Args:
        model_or_config: the model the cache serves (or its config, for block-storing caches).
        pool: `Paging(block_size, max_tokens | max_bytes)` to create a pool, or an existing `BlockPool`.
        prefix: a `PrefixCache` shared across requests (its pool is used); namespace: its tenant salt.
        codec: "int8", "int4", "int2", "fp8" (e4m3), "fp8_e5m2", or a `QuantConfig`. A name means what
            `QuantizedCache(model, bits=...)` does for sealed blocks (int2: KIVI's window and value groups,
            `QuantConfig.filled`); an eviction policy's slots take the bare format.
        policy: an eviction policy, `HeavyHitter(budget, ...)`, `Sink(n_sink, window, ...)` or `Evict(...)`.
        spill: a disk tier, `Disk(path, hot_tokens, max_resident_bytes, max_write_bytes, ...)`.
        layers: per-layer overrides, ``{layer: Layer(full_precision=True)}`` or ``Layer(budget=...)``.
        attention: "contiguous" or "paged" for block-storing caches (see `ChainParts`).

    Returns the preset the parts name (`PagedCache`, `QuantizedCache`, ..., `HeavyHitterCache`), a
    `GovernedCacheBase`.
    """
    if isinstance(codec, str) and policy is None:  # sealed blocks: the format's measured settings
        named = codec_config(codec)
        assert named is not None
        codec = quant_config_for(model_or_config, bits=named.bits, fmt=named.fmt)
    parts = ChainParts.of(
        pool=pool,
        prefix=prefix,
        namespace=namespace,
        codec=codec,
        policy=policy,
        spill=spill,
        layers=layers,
        attention=attention,
    )
    layout = layout_for(parts, cached_layer_count(decoder_config(model_or_config)))
    return _BUILDERS[layout.name](model_or_config, parts)


# ------------------------------------------------------------------ one builder per storage layout


def _blocks(model: Any, parts: ChainParts) -> GovernedCacheBase:
    """The block store with the chain's links, as the named cache those links make it."""
    configuration = _BLOCK_CONFIGURATIONS[(parts.codec is not None, parts.spill is not None)]
    return configuration.from_parts(model, parts)


# (has a codec, has a disk tier) -> the name a block store with those links goes by; each is the same store.
_BLOCK_CONFIGURATIONS: dict[tuple[bool, bool], type[PagedCache]] = {
    (False, False): PagedCache,
    (True, False): QuantizedCache,
    (False, True): DiskOffloadCache,
    (True, True): QuantizedDiskCache,
}


def _eviction(model: Any, parts: ChainParts) -> GovernedCacheBase:
    policy = parts.policy
    assert policy is not None, "the slots layout needs a policy"
    return _POLICY_BUILDERS[type(policy)](model, policy, parts)


def _eviction_arguments(model: Any, policy: Policy, parts: ChainParts) -> dict[str, Any]:
    arguments: dict[str, Any] = {} if policy.query_chunk is None else {"query_chunk": policy.query_chunk}
    if policy.budget_of is not None:
        arguments["budget_of"] = policy.budget_of
    if parts.codec is not None:
        arguments["codec"] = parts.codec
    if parts.layer_budgets() and policy.allocation is not None:
        raise ValueError(
            f"{policy.describe()} splits its budget over the layers (allocation={policy.allocation!r}), and the "
            f"chain also gives layers {sorted(parts.layer_budgets())} budgets of their own; give one or the other."
        )
    if parts.layer_budgets():
        arguments["layer_budgets"] = parts.layer_budgets()
    elif policy.allocation is not None:
        arguments["layer_budgets"] = policy.allocation
    if isinstance(policy, HeavyHitter | Evict) and policy.heads is not None:
        arguments["head_budgets"] = policy.heads
    if parts.spill is not None:
        arguments["recall"] = parts.spill.recall()
    if parts.prefix is not None:
        arguments |= {"prefix": parts.prefix, "namespace": parts.namespace}
    if isinstance(parts.pool, BlockPool):
        arguments["pool"] = parts.pool  # shared with other eviction caches; the cache checks its layout
    elif parts.pool is not None:
        p = parts.pool
        arguments["pool"] = eviction_pool(
            model, parts.codec, p.block_size, max_tokens=p.max_tokens, max_bytes=p.max_bytes
        )
    return arguments


def _heavy_hitter(model: Any, policy: Any, parts: ChainParts) -> GovernedCacheBase:

    h: HeavyHitter = policy
    return HeavyHitterCache(model, h.budget, h.recent, h.heavy, **_eviction_arguments(model, h, parts))


def _sink(model: Any, policy: Any, parts: ChainParts) -> GovernedCacheBase:

    s: Sink = policy
    return SinkCache(model, s.n_sink, s.window, s.budget, **_eviction_arguments(model, s, parts))


def _evict(model: Any, policy: Any, parts: ChainParts) -> GovernedCacheBase:
    e: Evict = policy
    arguments = _eviction_arguments(model, e, parts)
    return PolicyCache(model, e.policy, e.budget, decode_policy=e.decode_policy, compress=e.compress, **arguments)


_POLICY_BUILDERS: dict[type, Callable[[Any, Any, ChainParts], GovernedCacheBase]] = {
    HeavyHitter: _heavy_hitter,
    Sink: _sink,
    Evict: _evict,
}

_BUILDERS: dict[str, Callable[[Any, ChainParts], GovernedCacheBase]] = {
    "blocks": _blocks,
    "slots": _eviction,
}


def prefix_tree(
    model: Any,
    *,
    pool: Paging | None = None,
    codec: str | QuantConfig | None = None,
    layers: Mapping[int, Layer] | None = None,
    priority: str = "lru",
) -> PrefixCache:
    """A `PrefixCache` over a new pool laid out for chains with these parts, to pass as their ``prefix=``.

    A quantized chain's tree needs a pool that seals blocks with the same codec and full-precision layers
    (blocks are shared as stored); the pool is the one such a cache would create, with `pool`'s block size
    and cap. Needs a model (its dtype and devices place the pool).
    """
    owner = GovernedCache(model, pool=pool, codec=codec, layers=layers)
    assert isinstance(owner, PagedCache)
    if owner.pool is None:
        raise ValueError(
            "prefix_tree needs the model itself (its dtype and devices place the pool), not only its config."
        )
    return PrefixCache(owner.pool, priority=priority)  # with the layer groups such a cache would have
