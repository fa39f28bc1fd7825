"""The planner's model of a built cache: which `CacheSetup` stores a sequence the way that cache does.

`kvgov bench capacity` sets what really fits beside what `kvgov plan` predicts; this module makes the prediction
for the cache under test. The setup is read from the cache object itself (block size, codec, hot window, budget),
not from the registry name, so a cache registered with other options is planned with its own. Dispatch is a
registry on the cache's class (most specific first) rather than a chain of type tests; a class with no entry gets
no prediction (None). The setup follows what the cache holds: what left a sliding window is freed (under a tree
a disk cache's sliding layers keep their window; eviction caches keep at most the window); spilling caches add
their hot window, the blocks that never spill and their read-ahead rows (one layer of the spilled blocks, up to the
cap); a quantized cache's per-layer formats and `residual` window of full-precision tokens are modelled layer by
layer.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from transformers import DynamicCache

from hf_kvgov.engine.quant_config import QuantConfig
from hf_kvgov.hf.disk_cache import RESIDENT_FIRST_BLOCKS, DiskOffloadCache
from hf_kvgov.hf.eviction import EvictionCache
from hf_kvgov.hf.paged_cache import PagedCache
from hf_kvgov.hf.quantized_cache import QuantizedCache
from hf_kvgov.hf.quantized_disk_cache import QuantizedDiskCache
from hf_kvgov.planner.config_loading import geometry_from_config
from hf_kvgov.planner.geometry import ModelGeometry
from hf_kvgov.planner.lengths import LengthDistribution
from hf_kvgov.planner.memory import MemoryBudget
from hf_kvgov.planner.planner import PlanInputs, StepResult, evaluate
from hf_kvgov.planner.setup import CacheSetup
from hf_kvgov.planner.units import KV_DTYPE_BYTES, normalize_dtype

# QuantConfig codec names -> the planner's codec names (both fp8 variants store one byte plus scales).
_PLANNER_CODECS = {"int8": "int8", "int4": "int4", "int2": "int2", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8"}
# What an eviction cache keeps per slot and KV head besides K/V (`hf_kvgov.hf.eviction.cache`): the RoPE
# position (int64) and a validity flag (bool); H2O adds its accumulated attention mass (float32).
_SLOT_METADATA_BYTES = torch.int64.itemsize + torch.bool.itemsize
_SCORE_BYTES = torch.float32.itemsize


def kv_dtype_name(dtype: torch.dtype) -> str | None:
    """The planner's name of a K/V dtype ('fp32', 'fp16', 'bf16'), or None for one it does not know."""
    try:
        return normalize_dtype(str(dtype), KV_DTYPE_BYTES, "KV cache dtype")
    except ValueError:
        return None


def planner_geometry(model: Any, name: str = "") -> ModelGeometry | None:
    """The planner's geometry of a loaded transformers model (layers, KV heads, head dim, windows), or None
    when its config lacks what the planner reads (then the benchmark reports no prediction)."""
    try:
        return geometry_from_config(model.config.to_dict(), name or type(model).__name__)
    except ValueError:
        return None


@functools.singledispatch
def planner_setup(cache: Any, kv_dtype: str) -> CacheSetup | None:
    """The `CacheSetup` that holds a sequence as `cache` does, or None when the planner has no model of it."""
    return None


@planner_setup.register
def _dynamic(cache: DynamicCache, kv_dtype: str) -> CacheSetup | None:
    # Exactly the tokens stored, no rounding: paged blocks of one token.
    return CacheSetup(paged=True, block_size=1, kv_dtype=kv_dtype)


@planner_setup.register
def _paged(cache: PagedCache, kv_dtype: str) -> CacheSetup | None:
    if cache.pool is None:
        return None
    return CacheSetup(paged=True, block_size=cache.pool.block_size, kv_dtype=kv_dtype, window_frees=_frees(cache))


def _frees(cache: PagedCache) -> bool:
    """Whether the cache's pool has sliding layer groups, which free what left their window."""
    assert cache.pool is not None
    return any(group.window is not None for group in cache.pool.groups)


@planner_setup.register
def _quantized(cache: QuantizedCache, kv_dtype: str) -> CacheSetup | None:
    codec = _PLANNER_CODECS.get(cache.quant.codec_name)
    if cache.pool is None or codec is None:
        return None
    return CacheSetup(
        paged=True,
        block_size=cache.pool.block_size,
        kv_dtype=kv_dtype,
        codec=codec,
        layer_codecs=_layer_codecs(cache.quant),
        scale_bytes=cache.quant.scale_bytes,
        group_size=cache.quant.group_size,
        sink_blocks=cache.quant.sink_blocks,
        residual=cache.quant.residual,
        window_frees=_frees(cache),
    )


def _layer_codecs(quant: QuantConfig) -> tuple[tuple[int, str | None], ...]:
    """A per-layer map's overrides in the planner's codec names; full-precision layers as None."""
    pairs: dict[int, str | None] = {layer: _PLANNER_CODECS[name] for layer, name in quant.layer_formats}
    pairs.update(dict.fromkeys(quant.full_precision_layers))
    return tuple(sorted(pairs.items()))


def _read_ahead_bytes(cache: DiskOffloadCache | QuantizedDiskCache) -> int:
    """The most read-ahead rows a spilling cache allocates as it reads blocks back: whole segments (one layer
    of one block as the tier stores it: raw K/V, or codes and scales) within its buffer budget."""
    reader = cache.prefetcher
    return reader.capacity * reader.tier.layout.segment_bytes if reader is not None else 0


@planner_setup.register
def _disk(cache: DiskOffloadCache, kv_dtype: str) -> CacheSetup | None:
    # With a prefix tree the tree's blocks never spill; the bench adds the shared fraction for its workload.
    if cache.pool is None:
        return None
    return CacheSetup(
        paged=True,
        block_size=cache.pool.block_size,
        kv_dtype=kv_dtype,
        spill_hot_tokens=cache.disk.hot_tokens,
        spill_pinned_blocks=RESIDENT_FIRST_BLOCKS,
        spill_buffer_bytes=_read_ahead_bytes(cache),
        window_frees=_frees(cache),
    )


@planner_setup.register
def _quantized_disk(cache: QuantizedDiskCache, kv_dtype: str) -> CacheSetup | None:
    # The hot window's sealed blocks stay as codes, the sink blocks and the tail in full precision; only
    # sealed blocks spill, from the first block after the sinks.
    setup = _quantized(cache, kv_dtype)
    if setup is None:
        return None
    return dataclasses.replace(
        setup,
        spill_hot_tokens=cache.disk.hot_tokens,
        spill_pinned_blocks=cache.quant.sink_blocks,
        spill_buffer_bytes=_read_ahead_bytes(cache),
    )


def _fractional_budget(cache: EvictionCache) -> float | None:
    # The planner models a budget as a fraction of each sequence's tokens; an int budget has no such form.
    spec = cache.budget_spec
    return spec if isinstance(spec, float) else None


@planner_setup.register
def _eviction(cache: EvictionCache, kv_dtype: str) -> CacheSetup | None:
    fraction = _fractional_budget(cache)
    # Head-adaptive budgets store as many slots as the fullest head's, which the data decides; a cache that
    # compresses the prompt only keeps every later token: neither is a fraction of each sequence.
    if fraction is None or cache.head_budgets is not None or cache.compress != "always":
        return None
    # Per-head slots (block size 1, or the eviction pool's blocks), as codes when a codec is set, never fewer than
    # what the policies always keep (H2O's recent window, sinks + window), each with its fp32 attention mass when a
    # policy ranks by it; a running forecast's query statistics per layer.
    return CacheSetup(
        paged=True,
        block_size=_slot_block(cache),
        kv_dtype=kv_dtype,
        h2o_budget=fraction,
        h2o_recent=cache.min_budget,
        h2o_score_bytes=_SCORE_BYTES if cache.keeps_mass else 0,
        h2o_metadata_bytes=_SLOT_METADATA_BYTES,
        eviction_slots=True,
        query_statistics_bytes=cache.query_statistics_bytes,
        **_slot_codec(cache),
        **_recall(cache),
    )


def _slot_block(cache: EvictionCache) -> int:
    return 1 if cache.pool is None else int(cache.pool.block_size)


def _recall(cache: EvictionCache) -> dict[str, Any]:
    recall = cache.recall
    if recall is None:
        return {}
    return {
        "recall_pages": recall.pages, "recall_page_tokens": recall.page_tokens, "recall_summary": recall.summary,
        "recall_buffer": recall.buffer,
    }  # fmt: skip


def _slot_codec(cache: EvictionCache) -> dict[str, Any]:
    quant = cache.quant
    if quant is None:
        return {}
    return {
        "codec": _PLANNER_CODECS[quant.codec_name],
        "layer_codecs": _layer_codecs(quant),  # a per-layer map's slots hold each layer's own format
        "scale_bytes": quant.scale_bytes,
        "group_size": quant.group_size,
    }


def with_shared_prefix(setup: CacheSetup, shared_tokens: int, length: int) -> CacheSetup:
    """`setup` for sequences of `length` tokens whose first `shared_tokens` are one prefix shared by all of them."""
    if not 0 <= shared_tokens < length:
        raise ValueError(
            f"The shared prefix must be shorter than the sequence (at least one token is a request's own); got "
            f"{shared_tokens} shared tokens of {length}."
        )
    return dataclasses.replace(setup, shared_fraction=shared_tokens / length, share_group=None)


def predict(geometry: ModelGeometry, setup: CacheSetup, lengths: LengthDistribution, budget_bytes: int) -> StepResult:
    """What `kvgov plan` computes for `setup` when the whole of `budget_bytes` is for the KV cache."""
    budget = MemoryBudget(budget_bytes, weight_bytes=0, reserve_fraction=0.0, description="KV budget only")
    return evaluate(PlanInputs(geometry, budget, lengths), setup)
