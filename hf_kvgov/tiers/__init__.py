"""Tiers: where sealed KV blocks live when they are not in the pool, and how they move.

- ``slot_file``: one preallocated file of fixed-size block slots, laid out so one layer of many blocks
  is one read.
- ``disk_tier``: ref-counted spilled blocks by handle, a CRC-32 per (block, layer) verified on every read,
  a write budget, all-or-nothing writes. Bytes in, bytes out: codec-agnostic.
- ``prefetch``: a background reader that loads the next layer's spilled blocks into a fixed set of
  resident buffers (pinned memory and a copy stream on CUDA).
- ``block_table``: block tables whose entries are pool ids or spilled handles.
- ``kv_segments``: the raw segment format and the gather of K/V from the pool plus spilled blocks.

The remote prefix tier, shared by processes and machines (``PrefixCache(pool, remote=RedisTier(...))``):

- ``redis_tier``: `RedisTier`, reads of a whole chain in one pipelined round trip, the failure policy (a lost
  store is a miss with one warning); ``local_redis``: a throwaway ``redis-server`` on loopback.
- ``remote_keys``: chained SHA-256 block keys mixing model identity, pool layout and tenant.
- ``remote_values``: one checksummed value per block, raw K/V or sealed codes as stored; ``remote_entries``:
  with layer groups, one value per block position holding each group's block.
- ``remote_writer``: the bounded background writer; ``remote_stats``: its counters.

The tier decides nothing about what is cold: the cache (``hf_kvgov.hf.disk_cache``) asks it to store
blocks and to read them back.
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
