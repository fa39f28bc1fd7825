"""Filling a capped block pool with real sequences until it refuses, and running one sequence through a cache.

Which caches can be counted by their pool is a registry on the cache's class (most specific first): a
cache whose memory is exactly the blocks it holds in one pool gets a factory for more caches of its kind
drawing from a shared, capped pool; the others get None and are counted by their measured bytes.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from hf_kvgov.errors import PoolExhausted
from hf_kvgov.hf.compat import quiet_generate_warnings
from hf_kvgov.hf.disk_cache import DiskOffloadCache
from hf_kvgov.hf.paged_cache import PagedCache
from hf_kvgov.hf.quantized_cache import QuantizedCache
from hf_kvgov.registry import CacheSpec, kv_bytes
from hf_kvgov.storage.pool import BlockPool

# Per layer: keys and values `[1, kv_heads, tokens, head_dim]`.
LayerKV = list[tuple[torch.Tensor, torch.Tensor]]
CacheFactory = Callable[[BlockPool], Any]

_MEMINFO = Path("/proc/meminfo")


@functools.singledispatch
def pooled_twin(cache: Any, model: Any) -> CacheFactory | None:
    """A factory of caches that hold K/V as `cache` does in a given pool, or None when the pool does not
    bound the cache's memory (then its bytes are measured instead)."""
    return None


@pooled_twin.register
def _paged(cache: PagedCache, model: Any) -> CacheFactory | None:
    # The contiguous path holds the same blocks as the paged one, and its update needs no attention kwargs.
    return lambda pool: PagedCache(model, pool=pool)


@pooled_twin.register
def _quantized(cache: QuantizedCache, model: Any) -> CacheFactory | None:
    return None  # sealed codes live in a store outside the capped pool: the cap does not bound them


@pooled_twin.register
def _disk(cache: DiskOffloadCache, model: Any) -> CacheFactory | None:
    return None  # each cache keeps a hot window and read-ahead buffers; spilled blocks leave the pool


def release(cache: Any) -> None:
    """Hand a cache's blocks (and a disk cache's spill file) back; DynamicCache has nothing to release."""
    free = getattr(cache, "release", None)
    if callable(free):
        free()


def available_memory(device: torch.device) -> int | None:
    """Bytes that can still be allocated on `device` (MemAvailable on Linux CPUs), or None if unknown."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in _MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def capped_pool(like: BlockPool, budget_bytes: int) -> BlockPool:
    """A pool of `like`'s geometry and block size, capped at `budget_bytes` and allocated up front."""
    free = available_memory(like.geometry.device)
    if free is not None and budget_bytes > free:
        raise ValueError(
            f"Counting sequences by filling a pool allocates the whole budget ({budget_bytes:,} bytes), but only "
            f"{free:,} bytes are available on {like.geometry.device}; give a smaller budget."
        )
    return BlockPool(like.geometry, block_size=like.block_size, max_bytes=budget_bytes, preallocate=True)


def reference_kv(model: Any, ids: torch.Tensor) -> LayerKV:
    """Every layer's K/V of one prefill of `ids` (long `[1, tokens]`), all tokens kept in every layer."""
    cache = DynamicCache()  # no config: sliding-window layers keep every token too, as a paged cache does
    with quiet_generate_warnings(), torch.inference_mode():
        model(ids, past_key_values=cache, logits_to_keep=1)
    kv: LayerKV = []
    for index, layer in enumerate(cache.layers):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
            raise ValueError(
                f"Layer {index} of the model stored no key/value tensors (a {type(layer).__name__}); filling a "
                "block pool needs an attention-only decoder."
            )
        kv.append((keys, values))
    return kv


def _write_sequence(cache: Any, kv: LayerKV, length: int) -> None:
    """Store the first `length` tokens of `kv` in `cache`, as a prefill would (blocks allocated by layer 0)."""
    with torch.inference_mode():
        for index, (keys, values) in enumerate(kv):
            cache.update(keys[:, :, :length], values[:, :, :length], index)


def fill_until_refused(
    twin: CacheFactory, pool: BlockPool, kv: LayerKV, order: Sequence[int], progress: Any = None
) -> tuple[int, int, int]:
    """One cache per sequence, lengths from `order` (cycling), written into `pool` until it is exhausted.

    Args:
        kv: K/V per layer, `[1, kv_heads, >= max(order), head_dim]`.
        progress: a tqdm bar advanced once per sequence that fits (or None).
    Returns:
        (sequences that fit, the bytes they hold by their caches' accounting, the length that was refused).
    """
    held: list[Any] = []
    try:
        for length in itertools.cycle(order):
            cache = twin(pool)
            try:
                _write_sequence(cache, kv, length)
            except PoolExhausted:
                cache.release()  # all-or-nothing: the refused sequence allocated nothing
                return len(held), sum(kv_bytes(c) for c in held), length
            held.append(cache)
            if progress is not None:
                progress.update(1)
    finally:
        for cache in held:
            cache.release()
    raise AssertionError("a capped pool always refuses eventually: every sequence takes at least one block")


def run_sequence(model: Any, spec: CacheSpec, ids: torch.Tensor) -> Any:
    """A fresh cache of `spec` after the model has processed `ids` (long `[1, tokens]`).

    All tokens but the last are the prompt and the last is one decode step: caches that act at step
    boundaries (a disk cache spills at the start of a step, a quantized cache seals at its end) are then
    in the state a decoding request is in.
    """
    cache = spec.build(model)
    with spec.attention(model), quiet_generate_warnings(), torch.inference_mode():
        if ids.shape[1] > 1:
            model(ids[:, :-1], past_key_values=cache, logits_to_keep=1)
        model(ids[:, -1:], past_key_values=cache, logits_to_keep=1)
    return cache
