"""Random chains under a random byte cap: the pool never holds more than its cap, and past it the chain raises
`PoolExhausted` (or refuses the configuration when it is built) instead of overwriting anything.

Each example draws the chain's parts (codec x policy x recall/disk x prefix tree x layer groups: a tiny Llama, or a
tiny Gemma-3 whose sliding layers make groups), a cap of a few blocks' worth, a batch of random prompt lengths with
left padding, and a number of new tokens. After every forward (a hook on the model) the pool's tensors, measured,
plus what a cache keeps beside its blocks in the pool (an eviction cache's positions, mass, recall pages and tables;
a spilling cache's read-ahead rows: measured from its tensors, which the pool must count as charged), are at most
the cap. Generation either completes, raises `PoolExhausted`, or the chain is refused up front (`ChainRefused` / a
ValueError naming the cap); then a fresh cache with the pool's cap lifted gives the tokens a completed run must
equal (nothing was overwritten on the way).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from hf_kvgov import Disk, GovernedCache, HeavyHitter, Paging, eviction_attention, prefix_tree
from hf_kvgov.chain import ChainRefused
from hf_kvgov.errors import PoolExhausted
from hf_kvgov.hf.eviction.cache import EvictionCache
from hf_kvgov.storage.pool import BlockPool
from tests.conftest import tiny_gemma3, tiny_llama

MODELS = {"llama": tiny_llama(), "gemma3": tiny_gemma3()}
BLOCK = 4
EXAMPLES = int(os.environ.get("KVGOV_EXAMPLES", "30"))  # more for a longer search by hand


def held_bytes(pool: BlockPool) -> int:
    """Every byte of the pool's tensors, measured (a quantized pool's sealed pieces included)."""
    tensors = [*pool.keys, *pool.values]
    sealed = getattr(pool, "sealed", None)
    if sealed is not None:
        tensors += [t for layer in sealed.pieces for t in layer.values()]
    distinct = {id(t): t for t in tensors}.values()
    return sum(t.numel() * t.element_size() for t in distinct)


def beside(cache: Any, pool: BlockPool) -> int:
    """Bytes a cache keeps beside its blocks in ``pool``, measured from its tensors: an eviction cache's slot
    metadata and recall state, a spilling block cache's read-ahead rows (a prefix tree's pool, under a tree)."""
    if isinstance(cache, EvictionCache):
        stats = cache.stats()
        return stats.metadata_bytes + stats.recall_bytes if cache.pool is pool else 0
    reader = getattr(cache, "prefetcher", None)
    return reader.buffer_bytes if reader is not None and cache.pool is pool else 0


def build(model: Any, parts: dict[str, Any], cap: int | None, spill_dir: str) -> tuple[Any, list[BlockPool]]:
    """The chain, and the pools whose caps it must keep: a block store's pool (a prefix tree's, when it has one;
    with a disk tier the cap is what stays resident), an eviction cache's slot pool and its tree's."""
    kwargs: dict[str, Any] = {"codec": parts["codec"]}
    evicting = parts["policy"]
    if evicting:
        kwargs["policy"] = HeavyHitter(0.5)
        kwargs["pool"] = Paging(BLOCK, max_bytes=cap)
        if parts["disk"]:
            kwargs["spill"] = Disk(path=spill_dir)  # recall: evicted tokens to disk pages
    elif parts["disk"]:  # the cap is what stays resident; under a tree, the tree's pool's
        kwargs["pool"] = Paging(BLOCK)
        resident = None if parts["prefix"] else cap
        kwargs["spill"] = Disk(path=spill_dir, hot_tokens=2 * BLOCK, max_resident_bytes=resident)
    elif not parts["prefix"]:
        kwargs["pool"] = Paging(BLOCK, max_bytes=cap)
    tree = None
    if parts["prefix"]:
        tree = prefix_tree(model, pool=Paging(BLOCK, max_bytes=cap), codec=None if evicting else parts["codec"])
        kwargs["prefix"] = tree
    cache = GovernedCache(model, **kwargs)
    pools = [pool for pool in (getattr(cache, "pool", None), None if tree is None else tree.pool) if pool is not None]
    return cache, list({id(pool): pool for pool in pools}.values())


def run(model: Any, cache: Any, ids: torch.Tensor, mask: torch.Tensor, new: int, watch: Any = None) -> torch.Tensor:
    inputs = cache.match(ids, mask) if getattr(cache, "prefix", None) is not None else {"input_ids": ids}
    inputs.setdefault("attention_mask", mask)
    hook = None if watch is None else model.register_forward_hook(lambda *_: watch())
    try:
        with eviction_attention(model), torch.inference_mode():
            return model.generate(**inputs, cache=cache, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    finally:
        if hook is not None:
            hook.remove()


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    model_name=st.sampled_from(sorted(MODELS)),
    codec=st.sampled_from([None, "int8", "int4"]),
    policy=st.booleans(),
    disk=st.booleans(),
    prefix=st.booleans(),
    cap_blocks=st.integers(2, 40),
    lengths=st.lists(st.integers(3, 24), min_size=1, max_size=3),
    new=st.integers(1, 8),
    seed=st.integers(0, 2**16),
)
def test_a_chain_never_holds_more_than_its_pool_cap(
    model_name: str, codec: str | None, policy: bool, disk: bool, prefix: bool, cap_blocks: int,
    lengths: list[int], new: int, seed: int,
) -> None:  # fmt: skip
    model = MODELS[model_name]
    parts = {"codec": codec, "policy": policy, "disk": disk, "prefix": prefix}
    width = max(lengths)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 96, (len(lengths), width), generator=generator)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        mask[row, width - length :] = 1
    ids = ids * mask
    with tempfile.TemporaryDirectory() as spill_dir:
        try:
            probe, pools = build(model, parts, None, spill_dir)
        except (ChainRefused, ValueError, TypeError) as refused:
            event(f"refused: {str(refused)[:60]}")
            return
        cap = cap_blocks * max((pool.bytes_per_block for pool in pools), default=4096)
        del probe, pools
        try:
            cache, pools = build(model, parts, cap, spill_dir)
        except (ChainRefused, ValueError) as refused:
            event(f"refused under the cap: {str(refused)[:60]}")
            return
        peak = [0]

        def watch() -> None:
            for pool in pools:
                extra = beside(cache, pool)
                assert pool.bytes_charged == extra  # the pool counts what is beside its blocks
                held = held_bytes(pool) + extra
                peak[0] = max(peak[0], held)
                assert held <= cap, f"a pool holds {held} bytes under max_bytes={cap}"

        try:
            got = run(model, cache, ids, mask, new, watch)
        except PoolExhausted:
            event("PoolExhausted")
            return
        event(f"completed: {'+'.join(k if not isinstance(v, str) else v for k, v in parts.items() if v)}")
        watch()
        assert peak[0] > 0  # the hook saw the pool hold K/V
        free, _ = build(model, parts, None, spill_dir)
        assert torch.equal(got[:, -new:], run(model, free, ids, mask, new)[:, -new:])
