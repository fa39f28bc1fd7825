"""`GovernedCacheBase`: the transformers `Cache` that every hf_kvgov cache is, a chain of parts.

    cache = GovernedCache(model, pool=Paging(block_size=16), prefix=tree, codec="int8")
    cache = GovernedCache(model, policy=HeavyHitter(0.2), codec="int8", layers={0: Layer(budget=1.0)})

The named caches are presets of the chain: `PagedCache` (paged blocks, optionally prefix sharing),
`QuantizedCache` (+ a codec), `DiskOffloadCache` (+ a disk tier), `QuantizedDiskCache` (both),
`HeavyHitterCache`, `SinkCache` and `PolicyCache` (an eviction policy). Each cache's `parts` says which chain
it is, and ``GovernedCache(model, **cache.parts.kwargs())`` builds the same cache. `GovernedCache` is a
function (`hf_kvgov.chain.build`): it checks the parts (`hf_kvgov.engine.rules`) and calls the builder of
their storage layout, so this boundary module imports nothing above it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hf_kvgov.hf.compat import Cache

if TYPE_CHECKING:
    from hf_kvgov.engine.parts import ChainParts


class GovernedCacheBase(Cache):
    """The transformers `Cache` every hf_kvgov cache is: a chain of parts, in the brief's order.

    ``hf_kvgov.GovernedCache(model, pool=..., prefix=..., codec=..., policy=..., spill=..., layers=...,
    attention=...)`` (`hf_kvgov.chain.build`) checks the parts and returns the preset they make; the presets
    (`PagedCache`, `QuantizedCache`, `DiskOffloadCache`, `QuantizedDiskCache`, `HeavyHitterCache`, `SinkCache`,
    `PolicyCache`) are constructed directly. `parts` says which chain a cache is.
    """

    parts: ChainParts

    def update(self, key_states: Any, value_states: Any, layer_idx: int, *args: Any, **kwargs: Any) -> Any:
        """transformers' `Cache.update`, after checking that the layer is one the cache was built for."""
        if not 0 <= layer_idx < len(self.layers):
            raise ValueError(
                f"{type(self).__name__} was built for a model of {len(self.layers)} layers, and a layer with index "
                f"{layer_idx} stores K/V in it: a cache serves the model it was built for."
            )
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)
