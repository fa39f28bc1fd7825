"""Name -> cache factory: how the CLI, the demo and the eval suite ask for a cache.

A `CacheSpec` builds a fresh cache for a model and says which attention context it needs around
`generate`, so orchestration code never branches on cache types. A new cache adds one `register_cache`
line below.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from transformers import DynamicCache

from hf_kvgov.hf.attention import paged_attention
from hf_kvgov.hf.disk_cache import DiskOffloadCache
from hf_kvgov.hf.eviction import HeavyHitterCache, SinkCache, eviction_attention
from hf_kvgov.hf.paged_cache import PagedCache
from hf_kvgov.hf.quantized_cache import QuantizedCache

AttentionContext = Callable[[Any], AbstractContextManager[Any]]


def _no_context(model: Any) -> AbstractContextManager[Any]:
    return contextlib.nullcontext()


@dataclass(frozen=True)
class CacheSpec:
    name: str
    description: str
    build: Callable[[Any], Any]  # model -> a fresh transformers Cache
    lossless: bool
    attention_context: AttentionContext = _no_context  # what generate must run under

    def attention(self, model: Any) -> AbstractContextManager[Any]:
        """The attention context the cache needs around `generate` (nothing for most caches)."""
        return self.attention_context(model)


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


for _spec in (
    CacheSpec("dynamic", "transformers DynamicCache (the reference)", lambda m: DynamicCache(config=m.config), True),
    CacheSpec("paged", "PagedCache, 16-token blocks, contiguous K/V for any attention", PagedCache, True),
    CacheSpec(
        "paged-attn",
        "PagedCache read in place by the hf_kvgov paged attention",
        lambda m: PagedCache(m, attention="paged"),
        True,
        paged_attention,
    ),
    CacheSpec(
        "int8",
        "QuantizedCache int8: keys per channel, values per token; sink and tail blocks in full precision",
        lambda m: QuantizedCache(m, bits=8),
        False,
    ),
    CacheSpec(
        "int4",
        "QuantizedCache int4, two codes per byte: keys per channel, values per token",
        lambda m: QuantizedCache(m, bits=4),
        False,
    ),
    CacheSpec(
        "fp8",
        "QuantizedCache fp8 e4m3 with one scale per channel (keys) or per token (values)",
        lambda m: QuantizedCache(m, bits=8, fmt="fp8"),
        False,
    ),
    # Eviction caches keep different tokens per KV head: generate must run under the eviction attention.
    CacheSpec(
        "h2o",
        "HeavyHitterCache (H2O): 20% of the prompt per KV head, half recent window, half heavy hitters",
        lambda m: HeavyHitterCache(m, budget=0.2),
        False,
        eviction_attention,
    ),
    CacheSpec(
        "sink",
        "SinkCache (StreamingLLM): 4 sinks + recent window, 20% of the prompt (at least 64 slots) per KV head",
        lambda m: SinkCache(m, n_sink=4, window=60, budget=0.2),
        False,
        eviction_attention,
    ),
    CacheSpec(
        "disk",
        "DiskOffloadCache: blocks older than a 512-token hot window spill to a private temp file",
        DiskOffloadCache,
        True,
    ),
):
    register_cache(_spec)
