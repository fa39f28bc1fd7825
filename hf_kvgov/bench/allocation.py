"""Filling a capped block pool with real sequences until it refuses, and running one sequence through a cache.

Which caches can be counted by their pool is a registry on the cache's class (most specific first): a cache whose
memory is exactly the blocks it holds in one pool gets a factory for more caches of its kind drawing from a
shared, capped pool; the others get None and are counted by their measured bytes. Every fill allocates real K/V;
none divides a budget by a size. `fill_until_refused` gives each sequence its own cache in a pool capped at the
budget until it raises `PoolExhausted`; `fill_shared` serves requests that start with one document through a
`PrefixCache`. The pool's `max_bytes` is the budget and counts every byte: a `QuantizedBlockPool`'s full-precision
blocks and sealed codes, and what caches charge to it beside their blocks (a disk cache's read-ahead rows).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from hf_kvgov.engine.attention_view import VIEW_KEY
from hf_kvgov.engine.paged_view import PagedView
from hf_kvgov.errors import PoolExhausted
from hf_kvgov.hf.disk_cache import DiskOffloadCache
from hf_kvgov.hf.paged_cache import PagedCache
from hf_kvgov.hf.quantized_cache import QuantizedCache
from hf_kvgov.prefix.sharing import PrefixCache
from hf_kvgov.registry import CacheSpec, kv_bytes
from hf_kvgov.storage.pool import BlockPool
from hf_kvgov.storage.quantized_pool import QuantizedBlockPool

# Per layer: keys and values `[1, kv_heads, tokens, head_dim]`.
LayerKV = list[tuple[torch.Tensor, torch.Tensor]]
CacheFactory = Callable[[BlockPool], Any]
SharingFactory = Callable[[PrefixCache], Any]  # a cache drawing from the tree's pool, with match / publish
Request = Callable[[int], list[int]]  # request index -> its token ids
# (sequences that fit, bytes they hold, length of the first that did not)
Fit = tuple[int, int, int]

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


def _check_free(like: BlockPool, budget_bytes: int) -> None:
    free = available_memory(like.geometry.device)
    if free is not None and budget_bytes > free:
        raise ValueError(
            f"Counting sequences by filling a pool allocates the whole budget ({budget_bytes:,} bytes), but only "
            f"{free:,} bytes are available on {like.geometry.device}; give a smaller budget."
        )


@functools.singledispatch
def capped_pool(like: BlockPool, budget_bytes: int) -> BlockPool:
    """A pool of `like`'s geometry, block size and layer groups, capped at `budget_bytes` and allocated up front."""
    _check_free(like, budget_bytes)
    return BlockPool(
        like.geometry, block_size=like.block_size, max_bytes=budget_bytes, preallocate=True, groups=like.groups
    )


@capped_pool.register
def _capped_quantized(like: QuantizedBlockPool, budget_bytes: int) -> BlockPool:
    # Its cap bounds full-precision blocks and codes together, which it shares between them as they grow: grown on
    # demand, not pre-allocated; `pool_bytes_used` is what a fill holds against the budget.
    _check_free(like, budget_bytes)
    return QuantizedBlockPool(
        like.geometry, like.sealed.formats, block_size=like.block_size, max_bytes=budget_bytes, groups=like.groups
    )


@functools.singledispatch
def pool_bytes_used(pool: BlockPool) -> int:
    """Bytes of the blocks in use (by sequences or a prefix tree): full-precision blocks."""
    return pool.num_used * pool.bytes_per_block


@pool_bytes_used.register
def _quantized_bytes_used(pool: QuantizedBlockPool) -> int:
    return pool.num_used * pool.bytes_per_block + pool.sealed.num_used * pool.sealed.bytes_per_block


def reference_kv(model: Any, ids: torch.Tensor) -> LayerKV:
    """Every layer's K/V of one prefill of `ids` (long `[1, tokens]`), all tokens kept in every layer."""
    cache = DynamicCache()  # no config: sliding-window layers keep every token too, as a paged cache does
    with torch.inference_mode():
        model(ids, cache=cache, logits_to_keep=1)
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


def write_tokens(cache: Any, kv: LayerKV, start: int, stop: int) -> None:
    """Store tokens [start, stop) of `kv` in `cache`, as one forward step would (blocks allocated by layer 0).

    A cache on the paged attention path hands each layer's blocks to attention instead of gathering them,
    which makes filling it cheap. No attention runs here, so its view is marked read and its after-attend
    hook (a quantized cache seals the blocks the step filled) runs, as after an attention that reads nothing.
    """
    with torch.inference_mode():
        for index, (keys, values) in enumerate(kv):
            step: dict[str, Any] = {}
            cache.update(keys[:, :, start:stop], values[:, :, start:stop], index, kwargs=step)
            _attend_nothing(step.get(VIEW_KEY))


def _attend_nothing(view: PagedView | None) -> None:
    if view is None:
        return
    view.consumed = True
    after = getattr(view, "after_attend", None)
    if after is not None:
        after()


def _write_sequence(cache: Any, kv: LayerKV, length: int) -> None:
    """The prompt (all tokens but the last), then the last token as a decode step: the state of a decoding
    request, which is what the planner counts.

    A sliding-window layer group frees what left its window between steps, so a cache with one gets its
    prompt one block a step, as a chunked prefill would: written in one step it would hold the whole prompt
    in every layer at once, a peak no decoding request has. Other caches take the prompt in one step.
    """
    pool = getattr(cache, "pool", None)
    sliding = pool is not None and any(group.window is not None for group in pool.groups)
    chunk = pool.block_size if pool is not None and sliding else max(1, length - 1)
    steps = [(start, min(start + chunk, length - 1)) for start in range(0, length - 1, chunk)]
    for start, stop in [*steps, (length - 1, length)]:
        write_tokens(cache, kv, start, stop)


def fill_until_refused(
    twin: CacheFactory, pool: BlockPool, kv: LayerKV, order: Sequence[int], progress: Any = None
) -> Fit:
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


def _write_request(cache: Any, kv: LayerKV, tokens: list[int], chunk: int, last_alone: bool) -> None:
    """Match `tokens` in the prefix tree, then write the rest `chunk` tokens a step; with `last_alone` the last token
    is a step of its own (a decode step)."""
    cache.match(torch.tensor([tokens]))
    stop = len(tokens) - 1 if last_alone else len(tokens)
    steps = [(start, min(start + chunk, stop)) for start in range(cache.get_seq_length(), stop, chunk)]
    for start, end in steps + ([(stop, len(tokens))] if last_alone else []):
        write_tokens(cache, kv, start, end)


def fill_shared(
    twin: SharingFactory,
    prefix: PrefixCache,
    kv: LayerKV,
    request: Request,
    chunk: int = 256,
    progress: Any = None,
    outside_pool: Callable[[Any], int] = lambda cache: 0,
    last_token_alone: bool = False,
    published: int | None = None,
) -> Fit:
    """Requests from `request(0)`, `request(1)`, ... each through its own cache on `prefix`'s pool until refused.

    Request 0 is written whole and publishes its first `published` tokens (the shared document; None: all of
    them), so the tree holds what the requests share and request 0 keeps its own part as every other request does;
    every later one matches what the tree holds and writes the rest. K/V come from `kv` (`[1, kv_heads, >= length,
    head_dim]` per layer) at each token's position: what a block costs does not depend on its content.

    Args:
        outside_pool: bytes a cache holds besides its pool blocks (charged to the pool), added to the held figure.
        last_token_alone: write each request's last token as a step of its own (see `_write_request`).
    Returns:
        (requests that fit, pool bytes + `outside_pool` bytes they hold, the length of the refused request).
    """
    pool = prefix.pool
    held: list[Any] = []

    def used() -> int:
        return pool_bytes_used(pool) + sum(outside_pool(c) for c in held)

    try:
        for index in itertools.count():
            tokens, cache = request(index), twin(prefix)
            try:
                _write_request(cache, kv, tokens, chunk, last_token_alone)
            except PoolExhausted:
                cache.release()  # the refused request keeps nothing
                return len(held), used(), len(tokens)
            if index == 0:
                cache.publish(torch.tensor([tokens[:published]]))
            held.append(cache)
            if progress is not None:
                progress.update(1)
    finally:
        for cache in held:
            cache.release()
        prefix.clear()
    raise AssertionError("a capped pool always refuses eventually: every request holds at least one block")


def run_sequence(model: Any, spec: CacheSpec, ids: torch.Tensor) -> Any:
    """A fresh cache of `spec` after the model has processed `ids` (long `[1, tokens]`).

    All tokens but the last are the prompt and the last is one decode step: caches that act at step
    boundaries (a disk cache spills at the start of a step, a quantized cache seals at its end) are then
    in the state a decoding request is in.
    """
    # A budget that is a fraction of the prompt is one of these prompt tokens (the model is called directly).
    cache = spec.build_for(model, max(1, ids.shape[1] - 1))
    with spec.attention(model), torch.inference_mode():
        if ids.shape[1] > 1:
            model(ids[:, :-1], cache=cache, logits_to_keep=1)
        model(ids[:, -1:], cache=cache, logits_to_keep=1)
    return cache
