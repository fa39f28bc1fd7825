"""Prefix sharing: a radix tree from prompts' full token blocks to KV block ids (ints only, no tensors).

The block pool owns the KV memory; this index says which blocks already hold a prompt's prefix, counts
in-use locks on them, and picks unreferenced leaves to evict (LRU by default). See
:class:`~hf_kvgov.prefix.radix_tree.RadixTree`.
"""

from hf_kvgov.prefix.priority import (
    PRIORITIES,
    EvictionPriority,
    LFUPriority,
    LRUPriority,
    NodeInfo,
    make_priority,
)
from hf_kvgov.prefix.radix_tree import RadixTree
from hf_kvgov.prefix.results import InsertResult, PrefixCacheStats, PrefixMatch

__all__ = [
    "PRIORITIES",
    "EvictionPriority",
    "InsertResult",
    "LFUPriority",
    "LRUPriority",
    "NodeInfo",
    "PrefixCacheStats",
    "PrefixMatch",
    "RadixTree",
    "make_priority",
]
