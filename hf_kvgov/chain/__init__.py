"""The governance chain: the parts a cache is built from (`parts`), which combinations work (`rules`),
and how a chain becomes a cache (`build`, behind ``hf_kvgov.GovernedCache`` and ``hf_kvgov.prefix_tree``;
not imported here, since the caches it builds import the parts)."""

from hf_kvgov.engine.parts import ChainParts, Disk, Evict, HeavyHitter, Layer, Paging, Sink
from hf_kvgov.engine.rules import ChainRefused

__all__ = ["ChainParts", "ChainRefused", "Disk", "Evict", "HeavyHitter", "Layer", "Paging", "Sink"]
