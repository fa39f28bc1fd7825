"""Prefix sharing through generate: a warm tree gives exactly the cold outputs, and computes less."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import DynamicCache

from hf_kvgov import BlockPool, GovernedCache, PagedCache, Paging, QuantizedCache
from hf_kvgov.prefix.sharing import PrefixCache
from tests.conftest import tiny_llama

MODEL = tiny_llama(num_kv_heads=2, seed=3)
BLOCK = 8
NEW = 10


def shared_pool(max_tokens: int | None = None) -> tuple[BlockPool, PrefixCache]:
    geometry = PagedCache(MODEL).pool.geometry  # type: ignore[union-attr]
    pool = BlockPool(geometry, block_size=BLOCK, max_tokens=max_tokens)
    return pool, PrefixCache(pool)


def tokens(length: int, seed: int) -> list[int]:
    return torch.randint(3, 96, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def left_padded(rows: list[list[int]]) -> dict[str, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return {"input_ids": ids, "attention_mask": mask}


def generate(cache, inputs):  # type: ignore[no-untyped-def]
    return MODEL.generate(
        **inputs,
        cache=cache,
        max_new_tokens=NEW,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
    )


def reference(rows: list[list[int]]):  # type: ignore[no-untyped-def]
    """Cold outputs from DynamicCache: the generated tokens and their logits, per row."""
    out = generate(DynamicCache(), left_padded(rows))
    return out.sequences[:, -NEW:], torch.stack(out.logits, 1)


def warm_run(prefix: PrefixCache, rows: list[list[int]], namespace: str = ""):  # type: ignore[no-untyped-def]
    """match -> generate -> publish -> release; returns (new tokens, logits, tokens served from cache)."""
    cache = PagedCache(MODEL, prefix=prefix, namespace=namespace)
    padded = left_padded(rows)
    inputs = cache.match(padded["input_ids"], padded["attention_mask"])
    reused = cache.get_seq_length()
    out = generate(cache, inputs)
    cache.publish(out.sequences)
    cache.release()
    return out.sequences[:, -NEW:], torch.stack(out.logits, 1), reused


def assert_same(got, expected) -> None:  # type: ignore[no-untyped-def]
    assert torch.equal(got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1], atol=1e-4, rtol=1e-4)


def test_warm_tree_equals_cold_and_reuses_whole_blocks() -> None:
    _, prefix = shared_pool()
    prompt = tokens(37, seed=1)
    expected = reference([prompt])
    cold = warm_run(prefix, [prompt])
    assert cold[2] == 0
    assert_same(cold[:2], expected)
    warm = warm_run(prefix, [prompt])
    assert warm[2] == 32  # 36 usable tokens (one left uncached) -> 4 whole blocks of 8
    assert_same(warm[:2], expected)


def test_prompt_entirely_cached_but_its_last_token() -> None:
    _, prefix = shared_pool()
    long = tokens(40, seed=2)
    warm_run(prefix, [long])  # publishes 40 + NEW - 1 = 49 tokens -> 6 blocks
    prompt = long[:33]
    result = warm_run(prefix, [prompt])
    assert result[2] == 32  # everything but the last prompt token
    assert_same(result[:2], reference([prompt]))


def test_prefix_ending_mid_block_reuses_only_whole_blocks() -> None:
    _, prefix = shared_pool()
    first = tokens(30, seed=3)
    warm_run(prefix, [first])
    second = first[:20] + tokens(11, seed=4)  # diverges inside block 2 (tokens 16..23)
    result = warm_run(prefix, [second])
    assert result[2] == 16
    assert_same(result[:2], reference([second]))


def test_batch_mixing_hits_and_misses() -> None:
    _, prefix = shared_pool()
    document = tokens(34, seed=5)
    warm_run(prefix, [document + tokens(3, seed=6)])
    rows = [document + tokens(5, seed=7), tokens(12, seed=8), document[:17] + tokens(9, seed=9)]
    got = warm_run(prefix, rows)
    assert got[2] == 32  # the longest row hit; shorter hits are padded in the middle
    assert_same(got[:2], reference(rows))


def test_rows_sharing_a_prefix_share_blocks() -> None:
    pool, prefix = shared_pool()
    document = tokens(40, seed=10)
    warm_run(prefix, [document])
    cache = PagedCache(MODEL, prefix=prefix)
    padded = left_padded([document + tokens(4, seed=11), document + tokens(6, seed=12)])
    cache.match(padded["input_ids"], padded["attention_mask"])
    rows = cache.tables.rows  # type: ignore[union-attr]
    assert rows[0].block_ids[:5] == rows[1].block_ids[:5]
    assert all(pool.ref_count(b) == 3 for b in rows[0].block_ids[:5])  # the tree + two rows
    cache.release()


def test_turn_two_reuses_turn_one_including_the_answer() -> None:
    _, prefix = shared_pool()
    turn1 = tokens(20, seed=13)
    cache = PagedCache(MODEL, prefix=prefix)
    out = generate(cache, cache.match(torch.tensor([turn1])))
    cache.publish(out.sequences)
    cache.release()
    turn2 = out.sequences[0].tolist() + tokens(6, seed=14)
    result = warm_run(prefix, [turn2])
    assert result[2] == 24  # 29 stored tokens of turn 1 -> 3 whole blocks, answer included
    assert_same(result[:2], reference([turn2]))


def test_namespaces_are_isolated() -> None:
    _, prefix = shared_pool()
    prompt = tokens(30, seed=15)
    warm_run(prefix, [prompt], namespace="tenant-a")
    assert warm_run(prefix, [prompt], namespace="tenant-b")[2] == 0
    assert warm_run(prefix, [prompt], namespace="tenant-a")[2] == 24


def test_eviction_under_a_small_pool_keeps_outputs_exact_and_leaks_nothing() -> None:
    pool, prefix = shared_pool(max_tokens=12 * BLOCK)
    prompts = [tokens(30, seed=20 + i) for i in range(6)]
    for prompt in prompts + prompts[:2]:
        assert_same(warm_run(prefix, [prompt])[:2], reference([prompt]))
    stats = prefix.stats()
    assert stats.evictions > 0
    assert stats.shared_blocks == 0  # nothing is locked once every cache is released
    prefix.clear()
    assert pool.num_used == 0


def test_stats_count_hits() -> None:
    _, prefix = shared_pool()
    prompt = tokens(25, seed=30)
    warm_run(prefix, [prompt])
    warm_run(prefix, [prompt])
    stats = prefix.stats()
    assert (stats.lookup_tokens, stats.hit_tokens) == (50, 24)
    assert stats.hit_rate == pytest.approx(24 / 50)


def test_threads_share_one_pool_consistently() -> None:
    pool, prefix = shared_pool(max_tokens=40 * BLOCK)
    document = tokens(33, seed=40)
    questions = [document + tokens(4 + i % 3, seed=41 + i) for i in range(8)]
    expected = [reference([q]) for q in questions]
    results: dict[int, tuple] = {}
    errors: list[BaseException] = []

    def worker(indices: list[int]) -> None:
        try:
            for i in indices:
                results[i] = warm_run(prefix, [questions[i]])
        except BaseException as error:  # reported below: a thread's exception must fail the test
            errors.append(error)

    threads = [threading.Thread(target=worker, args=([i, i + 4],)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    for i, result in results.items():
        assert_same(result[:2], expected[i])
    assert sum(result[2] for result in results.values()) >= 32 * 4  # later requests hit the document
    prefix.tree.check_invariants()
    prefix.clear()
    assert pool.num_used == 0


def test_match_refuses_misuse() -> None:
    with pytest.raises(ValueError, match="prefix cache"):
        PagedCache(MODEL).match(torch.tensor([[5, 6, 7]]))
    _, prefix = shared_pool()
    cache = PagedCache(MODEL, prefix=prefix)
    with pytest.raises(ValueError, match="left-padded"):
        cache.match(torch.tensor([[5, 6, 7]]), torch.tensor([[1, 0, 1]]))
    MODEL(torch.tensor([[5, 6, 7]]), cache=cache)
    with pytest.raises(ValueError, match="empty cache"):
        cache.match(torch.tensor([[5, 6, 7]]))


def test_block_size_comes_from_the_tree_and_a_different_one_is_refused() -> None:
    pool, prefix = shared_pool()  # 8-token blocks, where a cache's own default would be 16
    cache = PagedCache(MODEL, prefix=prefix)
    assert cache.parts.pool == Paging(BLOCK)  # the chain it records rebuilds the same cache
    rebuilt = GovernedCache(MODEL, **cache.parts.kwargs())
    assert rebuilt.pool is pool
    assert PagedCache(MODEL, pool=pool, block_size=BLOCK).pool is pool
    for kwargs in ({"prefix": prefix}, {"pool": pool}):
        # With a tree the chain's rules refuse it first (Paging(block_size=16) differs from the tree's blocks).
        with pytest.raises(ValueError, match=r"block_size=16\b.*8-token blocks"):
            PagedCache(MODEL, block_size=16, **kwargs)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"block_size=16\b.*8-token blocks"):
            QuantizedCache(MODEL, block_size=16, **kwargs)  # type: ignore[arg-type]
