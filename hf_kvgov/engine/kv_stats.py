"""`KVStats`: the figures every cache's stats record carries, whatever holds its K/V (blocks or kept slots)."""

from __future__ import annotations

from dataclasses import dataclass

from hf_kvgov.stats_repr import rounded_repr


@dataclass(frozen=True)
class KVStats:
    """What any hf_kvgov cache holds now; a cache's own record (`CacheStats`, `EvictionStats`, ...) adds its detail.

    Attributes:
        sequences: rows of the batch.
        tokens: logical tokens, ``sequences x`` tokens processed per sequence (left padding included).
        bytes_used: bytes the cache holds in memory (shared blocks once; a disk tier's bytes are not memory).
        bytes_per_token: ``bytes_used / tokens`` (0.0 when empty): what one processed token costs now.
    """

    __repr__ = rounded_repr

    sequences: int
    tokens: int
    bytes_used: int
    bytes_per_token: float
