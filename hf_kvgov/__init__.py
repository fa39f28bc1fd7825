"""hf_kvgov: govern the KV cache of HuggingFace transformers models.

Names are imported lazily, so that model-free parts (the planner, the radix tree, codecs, policies)
load without importing transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "BlockPool": "hf_kvgov.storage.pool",
    "KVGeometry": "hf_kvgov.storage.pool",
    "BlockTable": "hf_kvgov.storage.block_table",
    "BlockTables": "hf_kvgov.storage.block_table",
    "KVGovError": "hf_kvgov.errors",
    "PoolExhausted": "hf_kvgov.errors",
    "GovernedCache": "hf_kvgov.chain.build",
    "GovernedCacheBase": "hf_kvgov.hf.governed",
    "prefix_tree": "hf_kvgov.chain.build",
    "ChainParts": "hf_kvgov.chain",
    "ChainRefused": "hf_kvgov.chain",
    "Paging": "hf_kvgov.chain",
    "Evict": "hf_kvgov.chain",
    "HeavyHitter": "hf_kvgov.chain",
    "Sink": "hf_kvgov.chain",
    "Disk": "hf_kvgov.chain",
    "Layer": "hf_kvgov.chain",
    "PagedCache": "hf_kvgov.hf.paged_cache",
    "CacheStats": "hf_kvgov.hf.paged_cache",
    "KVStats": "hf_kvgov.engine.kv_stats",
    "paged_attention": "hf_kvgov.hf.attention",
    "use_paged_attention": "hf_kvgov.hf.attention",
    "restore_attention": "hf_kvgov.hf.attention",
    "load_model": "hf_kvgov.models",
    "PrefixCache": "hf_kvgov.prefix.sharing",
    "RedisTier": "hf_kvgov.tiers.redis_tier",
    "RemoteStats": "hf_kvgov.tiers.remote_stats",
    "HeavyHitterCache": "hf_kvgov.hf.eviction",
    "SinkCache": "hf_kvgov.hf.eviction",
    "PolicyCache": "hf_kvgov.hf.eviction",
    "EvictionStats": "hf_kvgov.hf.eviction",
    "Recall": "hf_kvgov.tiers.recall_pages",
    "eviction_pool": "hf_kvgov.hf.eviction.pooled_slots",
    "RecallStats": "hf_kvgov.engine.slots.recall",
    "eviction_attention": "hf_kvgov.hf.eviction",
    "kvzip_cache": "hf_kvgov.hf.eviction.kvzip",
    "DiskOffloadCache": "hf_kvgov.hf.disk_cache",
    "DiskCacheStats": "hf_kvgov.hf.disk_cache",
    "SpillError": "hf_kvgov.errors",
    "SpillSpaceExhausted": "hf_kvgov.errors",
    "SpillCorrupted": "hf_kvgov.errors",
    "SpillFileLost": "hf_kvgov.errors",
    "QuantizedCache": "hf_kvgov.hf.quantized_cache",
    "QuantizedCacheStats": "hf_kvgov.hf.quantized_cache",
    "QuantizedDiskCache": "hf_kvgov.hf.quantized_disk_cache",
    "QuantizedDiskCacheStats": "hf_kvgov.hf.quantized_disk_cache",
    "QuantConfig": "hf_kvgov.engine.quant_config",
    "QuantizedBlockPool": "hf_kvgov.storage.quantized_pool",
    "check_quantization": "hf_kvgov.quality",
    "CheckOptions": "hf_kvgov.quality",
}

__all__ = [
    "BlockPool",
    "BlockTable",
    "BlockTables",
    "CacheStats",
    "ChainParts",
    "ChainRefused",
    "CheckOptions",
    "Disk",
    "DiskCacheStats",
    "DiskOffloadCache",
    "Evict",
    "EvictionStats",
    "GovernedCache",
    "GovernedCacheBase",
    "HeavyHitter",
    "HeavyHitterCache",
    "KVGeometry",
    "KVGovError",
    "KVStats",
    "Layer",
    "PagedCache",
    "Paging",
    "PolicyCache",
    "PoolExhausted",
    "PrefixCache",
    "QuantConfig",
    "QuantizedBlockPool",
    "QuantizedCache",
    "QuantizedCacheStats",
    "QuantizedDiskCache",
    "QuantizedDiskCacheStats",
    "Recall",
    "RecallStats",
    "RedisTier",
    "RemoteStats",
    "Sink",
    "SinkCache",
    "SpillCorrupted",
    "SpillError",
    "SpillFileLost",
    "SpillSpaceExhausted",
    "check_quantization",
    "eviction_attention",
    "eviction_pool",
    "kvzip_cache",
    "load_model",
    "paged_attention",
    "prefix_tree",
    "restore_attention",
    "use_paged_attention",
]

if TYPE_CHECKING:
    from hf_kvgov.chain import ChainParts, ChainRefused, Disk, Evict, HeavyHitter, Layer, Paging, Sink
    from hf_kvgov.chain.build import GovernedCache, prefix_tree
    from hf_kvgov.engine.kv_stats import KVStats
    from hf_kvgov.engine.quant_config import QuantConfig
    from hf_kvgov.engine.slots.recall import RecallStats
    from hf_kvgov.errors import (
        KVGovError,
        PoolExhausted,
        SpillCorrupted,
        SpillError,
        SpillFileLost,
        SpillSpaceExhausted,
    )
    from hf_kvgov.hf.attention import paged_attention, restore_attention, use_paged_attention
    from hf_kvgov.hf.disk_cache import DiskCacheStats, DiskOffloadCache
    from hf_kvgov.hf.eviction import EvictionStats, HeavyHitterCache, PolicyCache, SinkCache, eviction_attention
    from hf_kvgov.hf.eviction.kvzip import kvzip_cache
    from hf_kvgov.hf.eviction.pooled_slots import eviction_pool
    from hf_kvgov.hf.governed import GovernedCacheBase
    from hf_kvgov.hf.paged_cache import CacheStats, PagedCache
    from hf_kvgov.hf.quantized_cache import QuantizedCache, QuantizedCacheStats
    from hf_kvgov.hf.quantized_disk_cache import QuantizedDiskCache, QuantizedDiskCacheStats
    from hf_kvgov.models import load_model
    from hf_kvgov.prefix.sharing import PrefixCache
    from hf_kvgov.quality import CheckOptions, check_quantization
    from hf_kvgov.storage.block_table import BlockTable, BlockTables
    from hf_kvgov.storage.pool import BlockPool, KVGeometry
    from hf_kvgov.storage.quantized_pool import QuantizedBlockPool
    from hf_kvgov.tiers.recall_pages import Recall
    from hf_kvgov.tiers.redis_tier import RedisTier
    from hf_kvgov.tiers.remote_stats import RemoteStats


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hf_kvgov' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
