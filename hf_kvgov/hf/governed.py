"""`GovernedCache`: one transformers `Cache` built from the parts of the governance chain.

    cache = GovernedCache(model, pool=Paging(block_size=16), prefix=tree, codec="int8")
    cache = GovernedCache(model, policy=HeavyHitter(0.2), codec="int8", layers={0: Layer(budget=1.0)})

Every hf_kvgov cache is a `GovernedCache`, and the named caches are its presets: `PagedCache` is the chain
with only paged blocks (and optionally prefix sharing), `QuantizedCache` adds a codec, `DiskOffloadCache` a
disk tier (optionally under a prefix tree, whose blocks stay resident), `QuantizedDiskCache` a codec and a
disk tier (sealed blocks spill as codes; optionally under a prefix tree, whose blocks stay resident),
`HeavyHitterCache` and `SinkCache` an eviction policy (optionally with a codec). Each cache's `parts` says
which chain it is, and ``GovernedCache(model, **cache.parts.kwargs())`` builds the same cache.

Constructing `GovernedCache` itself checks the parts (`hf_kvgov.chain.rules`: a combination that cannot
work raises `ChainRefused` saying why) and builds them (`hf_kvgov.chain.build`) in one of two storage
layouts. Without a policy every head keeps every token, so the K/V live in the one block store,
`PagedCache`, whose codec and disk links are objects it calls (`BlockSealer`, `BlockTier`); the four block
presets are that store with those links, and a chain comes back as the preset its links name. With a policy
heads keep different tokens, so the K/V live in per-head slots (`EvictionCache`), in a pool's blocks when
given one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hf_kvgov.hf.compat import Cache

if TYPE_CHECKING:
    from hf_kvgov.chain.parts import ChainParts


class _ComposedOnCall(type):
    """Calling `GovernedCache` itself composes; calling a preset class constructs it as usual."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is GovernedCache:
            from hf_kvgov.chain.build import compose  # the builders import the presets, which import this module

            return compose(*args, **kwargs)
        return super().__call__(*args, **kwargs)


class GovernedCache(Cache, metaclass=_ComposedOnCall):
    """A KV cache assembled from chain parts, in the brief's order (see the module docstring).

    Args:
        model_or_config: the model the cache serves (or its config, for block-storing caches).
        pool: `Paging(block_size, max_tokens | max_bytes)` to create a pool, or an existing `BlockPool`.
        prefix: a `PrefixCache` shared across requests (its pool is used); namespace: its tenant salt.
        codec: "int8", "int4", "fp8" (e4m3), "fp8_e5m2", or a `QuantConfig`.
        policy: an eviction policy, `HeavyHitter(budget, ...)` or `Sink(n_sink, window, ...)`.
        spill: a disk tier, `Disk(path, hot_tokens, max_resident_bytes, max_write_bytes, ...)`.
        layers: per-layer overrides, ``{layer: Layer(full_precision=True)}`` or ``Layer(budget=...)``.
        attention: "contiguous" or "paged" for block-storing caches (see `ChainParts`).
    """

    parts: ChainParts
