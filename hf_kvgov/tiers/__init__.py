"""Tiers: where sealed KV blocks live when they are not in the pool, and how they move.

- ``slot_file``, ``disk_tier``: spilled blocks in one preallocated file (one layer of many blocks is one read),
  ref-counted, CRC-32 checked, written all or nothing; bytes in, bytes out. ``prefetch`` reads the next layer's
  blocks ahead; ``tiered_tables`` hold pool ids or spilled handles; ``kv_segments`` gathers from both.
- The remote prefix tier (``PrefixCache(pool, remote=RedisTier(...))``): ``redis_tier`` (one round trip per
  chain, a lost store is a miss), ``local_redis``, ``remote_keys`` (chained SHA-256 keys), ``remote_values`` and
  ``remote_entries`` (checksummed values), ``remote_writer`` and ``remote_stats``.

The tier decides nothing about what is cold: the cache (``hf_kvgov.hf.disk_cache``) asks it to store and read.
"""

from hf_kvgov.tiers.accounting import LatencyRecorder, TierStats
from hf_kvgov.tiers.disk_tier import DiskTier, StaleRead, TierLayout, segment_checksum
from hf_kvgov.tiers.prefetch import LayerPrefetcher
from hf_kvgov.tiers.slot_file import SlotFile
from hf_kvgov.tiers.tiered_tables import TieredBlockTable, TieredBlockTables

__all__ = [
    "DiskTier",
    "LatencyRecorder",
    "LayerPrefetcher",
    "SlotFile",
    "StaleRead",
    "TierLayout",
    "TierStats",
    "TieredBlockTable",
    "TieredBlockTables",
    "segment_checksum",
]
