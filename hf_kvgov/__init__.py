"""hf_kvgov: govern the KV cache of HuggingFace transformers models."""

from hf_kvgov.errors import KVGovError, PoolExhausted
from hf_kvgov.hf.attention import paged_attention, restore_attention, use_paged_attention
from hf_kvgov.hf.paged_cache import CacheStats, PagedCache
from hf_kvgov.storage.block_table import BlockTable, BlockTables
from hf_kvgov.storage.pool import BlockPool, KVGeometry

__version__ = "0.1.0"

__all__ = [
    "BlockPool",
    "BlockTable",
    "BlockTables",
    "CacheStats",
    "KVGeometry",
    "KVGovError",
    "PagedCache",
    "PoolExhausted",
    "paged_attention",
    "restore_attention",
    "use_paged_attention",
]
