"""Per-cache summaries shared by the generation benchmarks (LongBench, synthetic)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from hf_kvgov.registry import get_cache_spec


class CacheMeasurement(Protocol):
    """A per-example result: which cache produced it and the KV bytes that cache held at the end."""

    @property
    def cache(self) -> str: ...

    @property
    def kv_bytes(self) -> int: ...


def cache_rows(names: Sequence[str]) -> list[dict[str, Any]]:
    """What each cache of a run is, for the JSON report."""
    return [
        {"name": name, "description": spec.description, "lossless": spec.lossless}
        for name, spec in ((name, get_cache_spec(name, context=True)) for name in names)
    ]


def mean_by_cache(results: Sequence[CacheMeasurement], caches: Sequence[str]) -> dict[str, float]:
    """cache -> mean KV bytes held at the end of its examples (NaN for a cache without results)."""
    means = {}
    for cache in caches:
        held = [result.kv_bytes for result in results if result.cache == cache]
        means[cache] = sum(held) / len(held) if held else float("nan")
    return means
