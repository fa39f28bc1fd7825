"""`copy.deepcopy` of a cache: transformers' prompt reuse, where a prompt is run once into a cache and each request
continues from a copy of it. A block cache used to raise "cannot pickle '_thread.RLock' object" (the pool's lock).

A block cache's copy shares the original's pool and blocks, copying a block only when a copy writes into it, so the
prompt is stored once however many copies continue it; every copy answers as `DynamicCache`'s copy does. An
eviction cache is copied by value (its slots and running state; slots in pool blocks into blocks of its own). What a
copy could not own (a disk tier's spill file, recall's pages) is refused by name.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import DynamicCache

from hf_kvgov import (
    DiskOffloadCache,
    HeavyHitterCache,
    PagedCache,
    Paging,
    PolicyCache,
    PoolExhausted,
    QuantizedCache,
    Recall,
    SinkCache,
    eviction_attention,
    eviction_pool,
    paged_attention,
    prefix_tree,
)
from hf_kvgov.policies import ExpectedAttention, HeadAdaptive, QueryForecast
from tests.conftest import tiny_gemma3, tiny_llama

LLAMA = tiny_llama()
BLOCK = 4
NEW = 6


def _prompt(length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 96, (1, length), generator=torch.Generator().manual_seed(seed))


def _reuse(model: Any, cache: Any, system: torch.Tensor, questions: list[torch.Tensor]) -> list[torch.Tensor]:
    """transformers' pattern: the system prompt into `cache` once, then each question from a copy of it."""
    with torch.no_grad():
        model(system, cache=cache)
    return [_continue(model, copy.deepcopy(cache), system, question) for question in questions]


def _continue(model: Any, cache: Any, system: torch.Tensor, question: torch.Tensor) -> torch.Tensor:
    ids = torch.cat([system, question], dim=1)
    return model.generate(ids, cache=cache, max_new_tokens=NEW, do_sample=False)[:, ids.shape[1] :]


def _fresh(model: Any, build: Callable[[Any], Any], system: torch.Tensor, question: torch.Tensor) -> torch.Tensor:
    """The same steps on a cache of its own: the prompt, then the question."""
    cache = build(model)
    with torch.no_grad():
        model(system, cache=cache)
    return _continue(model, cache, system, question)


BUILDERS: dict[str, Callable[[Any], Any]] = {
    "PagedCache": lambda m: PagedCache(m, block_size=BLOCK),
    "PagedCache(attention='paged')": lambda m: PagedCache(m, block_size=BLOCK, attention="paged"),
    "QuantizedCache int8": lambda m: QuantizedCache(m, bits=8, block_size=BLOCK),
}


@pytest.mark.parametrize("build", list(BUILDERS.values()), ids=list(BUILDERS))
@pytest.mark.parametrize("make_model", [lambda: LLAMA, tiny_gemma3], ids=["llama", "gemma3 (sliding layers)"])
def test_copies_continue_a_prompt_as_dynamic_cache_copies_do(
    make_model: Callable[[], Any], build: Callable[[Any], Any]
) -> None:
    model = make_model()
    system = _prompt(18, seed=1)  # four full blocks and a partial one, which the copies both write into
    questions = [_prompt(5, seed=2), _prompt(9, seed=3)]
    expected = _reuse(model, DynamicCache(config=model.config), system, questions)
    cache = build(model)
    with paged_attention(model):
        got = _reuse(model, cache, system, questions)
        alone = [_fresh(model, build, system, question) for question in questions]
    for answer, own, reference in zip(got, alone, expected, strict=True):
        assert torch.equal(answer, own)  # bit for bit what a cache of its own computes (int8 codes included)
        if not isinstance(cache, QuantizedCache):
            assert torch.equal(answer, reference)
    assert cache.get_seq_length() == 18  # the copies' tokens went to the copies


def test_a_copy_shares_the_prompt_blocks_and_release_returns_every_one() -> None:
    system, question = _prompt(18, seed=1), _prompt(5, seed=2)
    cache = PagedCache(LLAMA, block_size=BLOCK)
    with torch.no_grad():
        LLAMA(system, cache=cache)
    pool = cache.pool
    assert pool is not None
    prompt_blocks = pool.num_used
    copies = [copy.deepcopy(cache) for _ in range(3)]
    assert all(c.pool is pool for c in copies)
    assert pool.num_used == prompt_blocks  # nothing copied until written
    ids = torch.cat([system, question], dim=1)
    for c in copies:
        LLAMA.generate(ids, cache=c, max_new_tokens=NEW, do_sample=False)
    # A block holds every layer's tokens. Each copy copied the partial fifth block when it wrote into it, then took
    # blocks of its own: 28 tokens in 7 blocks, the first 4 shared.
    assert prompt_blocks == 5
    assert pool.num_used == 5 + 3 * (7 - 4)
    for c in copies:
        c.release()
    assert pool.num_used == prompt_blocks
    cache.release()
    assert pool.num_used == 0


def test_copies_of_a_quantized_cache_share_its_codes() -> None:
    system, question = _prompt(18, seed=1), _prompt(5, seed=2)
    cache = QuantizedCache(LLAMA, bits=8, block_size=BLOCK)
    with torch.no_grad():
        LLAMA(system, cache=cache)
    pool = cache.pool
    assert pool is not None
    held = (pool.num_used, pool.sealed.num_used)
    copies = [copy.deepcopy(cache) for _ in range(2)]
    assert (pool.num_used, pool.sealed.num_used) == held
    for c in copies:
        _continue(LLAMA, c, system, question)
    for c in copies:
        c.release()
    assert (pool.num_used, pool.sealed.num_used) == held
    cache.release()
    assert (pool.num_used, pool.sealed.num_used) == (0, 0)


def test_a_copy_of_a_cache_on_a_prefix_tree_holds_its_own_locks() -> None:
    tree = prefix_tree(LLAMA, pool=None)
    prompt = _prompt(17, seed=4)
    first = PagedCache(LLAMA, prefix=tree)
    first.publish(LLAMA.generate(**first.match(prompt), cache=first, max_new_tokens=NEW, do_sample=False))
    first.release()
    cache = PagedCache(LLAMA, prefix=tree)
    inputs = cache.match(prompt)
    assert tree.stats().shared_blocks > 0
    held = tree.stats().shared_blocks
    twin = copy.deepcopy(cache)
    expected = LLAMA.generate(**inputs, cache=cache, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(LLAMA.generate(**inputs, cache=twin, max_new_tokens=NEW, do_sample=False), expected)
    cache.release()
    assert tree.stats().shared_blocks == held  # the copy still holds the tree's blocks
    twin.release()
    assert tree.stats().shared_blocks == 0


EVICTING: dict[str, Callable[[Any], Any]] = {
    "HeavyHitterCache": lambda m: HeavyHitterCache(m, budget=12),
    "HeavyHitterCache int8 slots": lambda m: HeavyHitterCache(m, budget=12, codec="int8"),
    "SinkCache": lambda m: SinkCache(m, n_sink=2, window=10),
    "PolicyCache(snapkv), compressed once": lambda m: PolicyCache(m, "snapkv", budget=40, compress="prefill"),
    "PolicyCache(expected attention, running)": lambda m: PolicyCache(
        m, ExpectedAttention(forecast=QueryForecast(running=True)), budget=40
    ),
    "HeavyHitterCache, head-adaptive (slots in pool blocks)": lambda m: HeavyHitterCache(
        m, budget=12, head_budgets=HeadAdaptive()
    ),
    "HeavyHitterCache int8 slots in pool blocks": lambda m: HeavyHitterCache(
        m, budget=12, codec="int8", pool=eviction_pool(m, codec="int8")
    ),
}


@pytest.mark.parametrize("build", list(EVICTING.values()), ids=list(EVICTING))
def test_an_eviction_cache_is_copied_by_value(build: Callable[[Any], Any]) -> None:
    """A context compressed once, each question from a copy: what a cache of its own computes, and the original
    keeps its slots (its running state is the copy's own)."""
    system, questions = _prompt(30, seed=1), [_prompt(7, seed=2), _prompt(4, seed=3)]
    with eviction_attention(LLAMA):
        cache = build(LLAMA)
        got = _reuse(LLAMA, cache, system, questions)
        kept = cache.stats().slots
        alone = [_fresh(LLAMA, build, system, question) for question in questions]
        again = _continue(LLAMA, copy.deepcopy(cache), system, questions[0])
    assert all(torch.equal(answer, own) for answer, own in zip(got, alone, strict=True))
    assert torch.equal(again, alone[0]) and cache.stats().slots == kept


def test_a_copy_of_slots_in_pool_blocks_takes_blocks_of_its_own_and_gives_them_back() -> None:
    pool = eviction_pool(LLAMA)
    cache = HeavyHitterCache(LLAMA, budget=12, pool=pool)
    with eviction_attention(LLAMA), torch.no_grad():
        LLAMA(_prompt(30, seed=1), cache=cache)
    held, charged = pool.num_used, pool.stats().bytes_charged
    twin = copy.deepcopy(cache)
    assert (pool.num_used, pool.stats().bytes_charged) == (2 * held, 2 * charged)
    twin.release()
    assert (pool.num_used, pool.stats().bytes_charged) == (held, charged)
    cache.release()
    assert (pool.num_used, pool.stats().bytes_charged) == (0, 0)


def test_a_copy_that_does_not_fit_the_cap_holds_nothing() -> None:
    """A copy past the pool's cap raises `PoolExhausted` whichever layer it fails at; the layers copied before give
    their blocks back."""
    probe = HeavyHitterCache(LLAMA, budget=12, pool=eviction_pool(LLAMA))
    with eviction_attention(LLAMA), torch.no_grad():
        LLAMA(_prompt(30, seed=1), cache=probe)
    assert probe.pool is not None
    one_copy = probe.pool.num_used * probe.pool.bytes_per_block + probe.pool.stats().bytes_charged
    pool = eviction_pool(LLAMA, max_bytes=one_copy + one_copy // 2)  # room for the cache and half a copy
    cache = HeavyHitterCache(LLAMA, budget=12, pool=pool)
    with eviction_attention(LLAMA), torch.no_grad():
        LLAMA(_prompt(30, seed=1), cache=cache)
    held, charged = pool.num_used, pool.stats().bytes_charged
    with pytest.raises(PoolExhausted):
        copy.deepcopy(cache)
    assert (pool.num_used, pool.stats().bytes_charged) == (held, charged)


def test_a_copy_of_an_eviction_cache_on_a_prefix_tree_holds_the_matched_blocks_again() -> None:
    tree = prefix_tree(LLAMA, pool=Paging(BLOCK))
    document = _prompt(24, seed=4)
    first = PagedCache(LLAMA, prefix=tree)
    first.publish(LLAMA.generate(**first.match(document), cache=first, max_new_tokens=2, do_sample=False))
    first.release()
    prompt = torch.cat((document, _prompt(7, seed=5)), dim=1)
    cache = HeavyHitterCache(LLAMA, budget=6, recent=2, prefix=tree)
    inputs = cache.match(prompt)
    assert cache.shared is not None and cache.shared.tokens == [24]
    twin = copy.deepcopy(cache)
    with eviction_attention(LLAMA):
        expected = LLAMA.generate(**inputs, cache=cache, max_new_tokens=NEW, do_sample=False)
        cache.release()  # the copy still holds the document's blocks
        assert torch.equal(LLAMA.generate(**inputs, cache=twin, max_new_tokens=NEW, do_sample=False), expected)
    twin.release()
    tree.clear()
    assert tree.pool.num_used == 0  # every lock and reference the copy took went back


REFUSED: dict[str, tuple[Callable[[Any, Path], Any], str]] = {
    "DiskOffloadCache": (lambda m, p: DiskOffloadCache(m, path=p, hot_tokens=8, block_size=BLOCK), "spill file"),
    "HeavyHitterCache with recall": (
        lambda m, p: HeavyHitterCache(m, budget=8, recall=Recall(path=str(p))),
        "recall keeps its pages",
    ),
}


@pytest.mark.parametrize(("build", "reason"), list(REFUSED.values()), ids=list(REFUSED))
def test_caches_that_cannot_be_copied_refuse_by_name(
    build: Callable[[Any, Path], Any], reason: str, tmp_path: Path
) -> None:
    """These used to raise "cannot pickle '_thread.RLock' object" (a pool's lock) or the like."""
    cache = build(LLAMA, tmp_path)
    with pytest.raises(TypeError, match=rf"{type(cache).__name__} cannot be copied: .*{reason}.*prefix_tree"):
        copy.deepcopy(cache)
