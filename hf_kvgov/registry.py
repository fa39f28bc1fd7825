"""Name -> cache factory: how the CLI, the demo and the eval suite ask for a cache.

A `CacheSpec` builds a fresh cache for a model and says which attention implementation it needs, so
orchestration code never branches on cache types. Later caches register themselves here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from transformers import DynamicCache

from hf_kvgov.hf.attention import paged_attention
from hf_kvgov.hf.paged_cache import PagedCache


@dataclass(frozen=True)
class CacheSpec:
    name: str
    description: str
    build: Callable[[Any], Any]  # model -> a fresh transformers Cache
    lossless: bool
    paged_attention: bool = False  # needs the hf_kvgov attention implementation

    @contextlib.contextmanager
    def attention(self, model: Any) -> Iterator[None]:
        """The attention context the cache needs around `generate` (nothing for most caches)."""
        if self.paged_attention:
            with paged_attention(model):
                yield
        else:
            yield


CACHES: dict[str, CacheSpec] = {}


def register_cache(spec: CacheSpec) -> None:
    CACHES[spec.name] = spec


def get_cache_spec(name: str) -> CacheSpec:
    if name not in CACHES:
        raise ValueError(f"Unknown cache {name!r}; available caches: {', '.join(CACHES)}.")
    return CACHES[name]


def kv_bytes(cache: Any) -> int:
    """Bytes of KV a cache holds: its own accounting when it has one, else the tensors it stores."""
    if hasattr(cache, "stats"):
        return int(cache.stats().bytes_used)
    total = 0
    for layer in cache.layers:
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if tensor is not None:
                total += tensor.numel() * tensor.element_size()
    return total


register_cache(
    CacheSpec("dynamic", "transformers DynamicCache (the reference)", lambda m: DynamicCache(config=m.config), True)
)
register_cache(CacheSpec("paged", "PagedCache, 16-token blocks, contiguous K/V for any attention", PagedCache, True))
register_cache(
    CacheSpec(
        "paged-attn",
        "PagedCache read in place by the hf_kvgov paged attention",
        lambda m: PagedCache(m, attention="paged"),
        True,
        paged_attention=True,
    )
)
