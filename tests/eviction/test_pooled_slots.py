"""Eviction caches whose kept slots live in a shared, capped pool (`eviction_pool`).

A pooled cache computes what the same cache with its own tensors computes, bit for bit (the slots are copied
as bytes), so most checks compare the two; the rest count blocks by hand, fill a capped pool until it
refuses, and run threads on one pool.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import pytest
import torch

from hf_kvgov import (
    GovernedCache,
    HeavyHitter,
    HeavyHitterCache,
    Paging,
    PolicyCache,
    PoolExhausted,
    Recall,
    SinkCache,
    eviction_attention,
    eviction_pool,
)
from hf_kvgov.policies import SnapKV
from tests.conftest import tiny_gemma3, tiny_llama

BLOCK = 4


def batch(model: Any, rows: int = 2, length: int = 30, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (rows, length), generator=generator)
    mask = torch.ones_like(ids)
    if rows > 1:
        ids[1, :5], mask[1, :5] = 0, 0  # left padding in row 1
    return ids, mask


def generate(
    model: Any, cache: Any, rows: int = 2, seed: int = 3, new: int = 10, switch: bool = True, **kwargs: Any
) -> Any:
    """Greedy tokens and logits; ``switch=False`` when the model already attends with the eviction attention
    (threads share one model, so they must not switch it back and forth)."""
    ids, mask = batch(model, rows, seed=seed)
    with eviction_attention(model) if switch else contextlib.nullcontext(), torch.inference_mode():
        return model.generate(
            input_ids=ids, attention_mask=mask, cache=cache, max_new_tokens=new, min_new_tokens=new,
            do_sample=False, output_logits=True, return_dict_in_generate=True, **kwargs,
        )  # fmt: skip


def in_threads(work: Any, items: list[int], threads: int = 4) -> dict[int, Any]:
    """``work(item)`` for every item, the items dealt to ``threads`` threads; a thread's exception fails the test."""
    results: dict[int, Any] = {}
    errors: list[BaseException] = []

    def worker(mine: list[int]) -> None:
        try:
            for item in mine:
                results[item] = work(item)
        except BaseException as error:  # reported below: a thread's exception must fail the test
            errors.append(error)

    running = [threading.Thread(target=worker, args=(items[i::threads],)) for i in range(threads)]
    for thread in running:
        thread.start()
    for thread in running:
        thread.join()
    assert not errors, errors
    return results


def assert_identical(first: Any, second: Any) -> None:
    assert torch.equal(first.sequences, second.sequences)
    for a, b in zip(first.logits, second.logits, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("codec", [None, "int8", "int4", "int2", "fp8"])
@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3"])
def test_pooled_slots_compute_what_own_tensors_compute(make: Any, codec: str | None) -> None:
    model = make()
    pool = eviction_pool(model, codec=codec, block_size=BLOCK)
    pooled = HeavyHitterCache(model, budget=10, codec=codec, layer_budgets={0: 6}, pool=pool)
    assert_identical(
        generate(model, pooled), generate(model, HeavyHitterCache(model, budget=10, codec=codec, layer_budgets={0: 6}))
    )
    assert pool.num_used > 0
    pooled.release()
    assert pool.num_used == 0


def test_beams_and_other_policies_compute_the_same_in_a_pool() -> None:
    model = tiny_llama()
    pool = eviction_pool(model, block_size=BLOCK)
    for build in (
        lambda p: HeavyHitterCache(model, budget=10, pool=p),
        lambda p: PolicyCache(model, SnapKV(window=4), budget=10, pool=p),
        lambda p: SinkCache(model, n_sink=2, window=8, pool=p),
    ):
        assert_identical(
            generate(model, build(pool), rows=1, num_beams=3), generate(model, build(None), rows=1, num_beams=3)
        )
    with_recall = HeavyHitterCache(model, budget=10, pool=pool, recall=Recall(pages=2, page_tokens=4))
    assert_identical(
        generate(model, with_recall),
        generate(model, HeavyHitterCache(model, budget=10, recall=Recall(pages=2, page_tokens=4))),
    )


def test_each_layer_holds_the_blocks_its_budget_needs() -> None:
    model = tiny_gemma3(window=8)  # sliding, full, sliding: a sliding layer keeps at most window - 1 = 7 slots
    pool = eviction_pool(model, block_size=BLOCK)
    cache = HeavyHitterCache(model, budget=10, layer_budgets={1: 5}, pool=pool)
    generate(model, cache)
    rows = 2
    blocks = [len(table) for layer in cache.layers for table in layer.home.tables]
    # 7 slots -> 2 blocks in each sliding layer, 5 -> 2 in the full one, per row.
    assert blocks == [2] * rows + [2] * rows + [2] * rows
    assert pool.num_used == sum(blocks)
    assert cache.stats().kv_bytes == sum(blocks) * pool.bytes_per_block
    bigger = HeavyHitterCache(model, budget=10, layer_budgets={1: 9}, pool=pool)
    generate(model, bigger)
    assert [len(t) for t in bigger.layers[1].home.tables] == [3, 3]  # 9 slots: 3 blocks; real memory follows


def test_a_full_pool_raises_and_leaves_the_others_untouched() -> None:
    model = tiny_llama()
    # Each request keeps 10 slots in 2 layers: 3 blocks per layer per row, 6 per request; 16 blocks hold 2.
    pool = eviction_pool(model, block_size=BLOCK, max_tokens=16 * BLOCK)
    first, second = (HeavyHitterCache(model, budget=10, pool=pool) for _ in range(2))
    reference = generate(model, HeavyHitterCache(model, budget=10), rows=1, new=4)
    assert_identical(generate(model, first, rows=1, new=4), reference)
    generate(model, second, rows=1, seed=5, new=4)
    used = pool.num_used
    assert used == 12
    third = HeavyHitterCache(model, budget=10, pool=pool)
    with pytest.raises(PoolExhausted):
        generate(model, third, rows=1, seed=7, new=4)
    third.release()
    assert pool.num_used == used  # the refused request gave back what it took; nothing else moved
    # The first request's slots are as they were: its blocks still hold exactly its kept slots.
    alone = HeavyHitterCache(model, budget=10)
    generate(model, alone, rows=1, new=4)
    for pooled_layer, own_layer in zip(first.layers, alone.layers, strict=True):
        for mine, theirs in zip(pooled_layer.store.read(), own_layer.store.read(), strict=True):
            assert torch.equal(mine, theirs)


def test_threads_on_one_pool_get_their_own_results() -> None:
    model = tiny_llama()
    pool = eviction_pool(model, block_size=BLOCK, max_tokens=200 * BLOCK, preallocate=True)
    seeds = list(range(10, 18))
    expected = {seed: generate(model, HeavyHitterCache(model, budget=10), seed=seed).sequences for seed in seeds}

    def run(seed: int) -> torch.Tensor:
        cache = HeavyHitterCache(model, budget=10, pool=pool)
        tokens = generate(model, cache, seed=seed, switch=False).sequences
        cache.release()
        return tokens

    with eviction_attention(model):  # once for every thread
        results = in_threads(run, seeds)
    assert all(torch.equal(results[seed], expected[seed]) for seed in seeds)
    assert pool.num_used == 0


def test_a_pool_laid_out_for_other_slots_is_refused() -> None:
    model = tiny_llama()
    with pytest.raises(ValueError, match=r"record elements .*eviction_pool\(model, codec=\.\.\.\)"):
        HeavyHitterCache(model, budget=10, codec="int8", pool=eviction_pool(model))
    with pytest.raises(ValueError, match="layer groups"):
        from hf_kvgov import PagedCache

        HeavyHitterCache(model, budget=10, pool=PagedCache(model).pool)


def test_the_chain_puts_a_policy_on_a_capped_pool() -> None:
    model = tiny_llama()
    cache = GovernedCache(model, pool=Paging(BLOCK, max_tokens=64), codec="int8", policy=HeavyHitter(10))
    assert isinstance(cache, HeavyHitterCache) and cache.pool is not None and cache.pool.max_blocks == 16
    again = GovernedCache(model, **cache.parts.kwargs())  # the same pool: the two share it
    assert again.pool is cache.pool
    assert_identical(generate(model, cache), generate(model, HeavyHitterCache(model, budget=10, codec="int8")))


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3-layer-groups"])
def test_threads_on_one_pool_and_one_tree_stay_consistent(make: Any) -> None:
    from hf_kvgov import PagedCache, prefix_tree

    model = make()
    tree = prefix_tree(model, pool=Paging(BLOCK))
    assert (tree.grouped is not None) == (make is tiny_gemma3)
    document = torch.randint(3, 96, (1, 20), generator=torch.Generator().manual_seed(1))
    publisher = PagedCache(model, prefix=tree)
    out = model.generate(**publisher.match(document), cache=publisher, max_new_tokens=1, do_sample=False)
    publisher.publish(out)
    publisher.release()
    pool = eviction_pool(model, block_size=BLOCK, max_tokens=200 * BLOCK, preallocate=True)
    prompts = {
        seed: torch.cat((document, torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(seed))), 1)
        for seed in range(20, 28)
    }

    def answer(prompt: torch.Tensor, pooled: bool) -> torch.Tensor:
        cache = HeavyHitterCache(model, budget=6, pool=pool if pooled else None, prefix=tree)
        inputs = cache.match(prompt)
        with torch.inference_mode():
            tokens = model.generate(**inputs, cache=cache, max_new_tokens=6, do_sample=False)[:, -6:]
        assert cache.shared_prefix_tokens == [20 // BLOCK * BLOCK]
        cache.release()
        return tokens

    with eviction_attention(model):
        expected = {seed: answer(prompt, pooled=False) for seed, prompt in prompts.items()}
        results = in_threads(lambda seed: answer(prompts[seed], pooled=True), list(prompts))
    assert all(torch.equal(results[seed], expected[seed]) for seed in prompts)
    assert pool.num_used == 0
    tree.tree.check_invariants()
    tree.clear()
    assert tree.pool.num_used == 0  # every lock and reference the threads took went back


def test_a_cache_dropped_without_release_gives_its_blocks_back() -> None:
    """A block cache dropped without `release` gives its blocks back when collected; eviction caches on a shared pool
    kept theirs for the pool's life."""
    import gc

    model = tiny_llama()
    pool = eviction_pool(model, block_size=BLOCK)
    for make in (
        lambda: HeavyHitterCache(model, budget=12, recent=4, pool=pool),
        lambda: GovernedCache(model, pool=pool, policy=HeavyHitter(12, recent=4)),
        lambda: SinkCache(model, n_sink=4, window=8, pool=pool),
    ):
        cache = make()
        generate(model, cache)
        assert pool.num_used > 0
        del cache
        gc.collect()
        assert pool.num_used == 0 and pool.bytes_charged == 0
