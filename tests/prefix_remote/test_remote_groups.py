"""The remote tier over pools with layer groups (tiny Gemma-3 and Mistral, sliding windows of 24 tokens): each
position's value holds every group's block, and a remote hit is cut, as a local one, where a sliding group
lacks the blocks of its last window."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hf_kvgov import PagedCache, Paging, QuantizedCache, prefix_tree
from hf_kvgov.prefix.sharing import PrefixCache
from hf_kvgov.tiers.local_redis import LocalRedis
from hf_kvgov.tiers.redis_tier import RedisTier
from tests.hf.test_paged_hybrid import BLOCK, MODELS
from tests.hf.test_prefix_hybrid import OPTIONS, prompt, request, without_sharing


def remote_tree(model: Any, url: str, codec: str | None = None) -> PrefixCache:
    """A fresh pool laid out for the model's layer groups (a new process), its tree over the store at `url`."""
    local = prefix_tree(model, pool=Paging(block_size=BLOCK), codec=codec)
    local.close()  # only its pool is wanted
    assert local.grouped is not None
    return PrefixCache(local.pool, remote=RedisTier(url, model))


def flushed(tree: PrefixCache) -> PrefixCache:
    assert tree.remote is not None and tree.remote.flush(10)
    return tree


@pytest.mark.parametrize("name", sorted(MODELS))
def test_process_b_computes_only_its_question_over_layer_groups(redis_server: LocalRedis, name: str) -> None:
    model: Any = MODELS[name]
    writer = remote_tree(model, redis_server.url)
    request(model, PagedCache(model, prefix=writer), prompt(0))
    flushed(writer)
    reader = remote_tree(model, redis_server.url)
    out, served = request(model, PagedCache(model, prefix=reader), prompt(1))
    assert served == 64 and torch.equal(out, without_sharing(model, prompt(1)))  # 6 of 70 tokens computed
    stats = reader.stats()
    assert stats.remote is not None and stats.remote.blocks_read == 8 and stats.remote.damaged_values == 0
    assert stats.hit_tokens == 64 and stats.tree.hit_tokens == 0  # served by the store, after a local miss
    assert reader.pool.num_used == stats.pool_blocks  # the request released its own blocks
    reader.check_invariants()
    cache = PagedCache(model, prefix=reader)
    cache.match(prompt(2))  # a local hit now, cut to the windows as usual
    assert cache.get_seq_length() == 64
    cache.release()


def test_a_remote_hit_is_cut_where_a_sliding_group_lacks_its_window(redis_server: LocalRedis) -> None:
    model: Any = MODELS["gemma3"]
    writer = remote_tree(model, redis_server.url)
    first = PagedCache(model, prefix=writer)  # no match: only the blocks still live are published
    out = model.generate(prompt(0), cache=first, **OPTIONS)
    first.publish(out)  # the sliding groups' blocks from 6 (48 ..) on, the full group's all
    first.release()
    flushed(writer)
    reader = remote_tree(model, redis_server.url)
    again = PagedCache(model, prefix=reader)
    inputs = again.match(prompt(1))
    assert again.get_seq_length() == 0  # a hit at 64 needs sliding blocks from 5 on: no point is servable
    assert torch.equal(model.generate(**inputs, cache=again, **OPTIONS), without_sharing(model, prompt(1)))
    again.release()
    other = remote_tree(model, redis_server.url)
    same = PagedCache(model, prefix=other)
    inputs = same.match(out[:, :73])  # a hit at 72 needs sliding blocks 6 .. 8, which the store has
    assert same.get_seq_length() == 72
    assert torch.equal(model.generate(**inputs, cache=same, **OPTIONS), without_sharing(model, out[:, :73]))
    same.release()
    other.check_invariants()


def test_quantized_codes_travel_over_layer_groups(redis_server: LocalRedis) -> None:
    model: Any = MODELS["gemma3"]
    writer = remote_tree(model, redis_server.url, codec="int8")
    request(model, QuantizedCache(model, prefix=writer), prompt(0))
    flushed(writer)
    reader = remote_tree(model, redis_server.url, codec="int8")
    alone = model.generate(prompt(1), cache=QuantizedCache(model, block_size=BLOCK), **OPTIONS)
    out, served = request(model, QuantizedCache(model, prefix=reader), prompt(1))
    assert served == 64 and torch.equal(out, alone)
    assert reader.pool.num_used == len(reader.pool.groups)  # full precision: each group's sink, the rest sealed
    reader.check_invariants()
