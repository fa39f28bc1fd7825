"""Prefix sharing over a pool with layer groups (tiny random Gemma-3 and Mistral configs): a hit is exact, a
sliding group's table starts at its window, the tree keeps a document's sliding blocks as they are computed,
and the pool takes them back first when it needs room."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from transformers import DynamicCache

from hf_kvgov import (
    DiskOffloadCache,
    PagedCache,
    Paging,
    QuantizedCache,
    QuantizedDiskCache,
    paged_attention,
    prefix_tree,
)
from tests.conftest import tiny_llama
from tests.hf.test_paged_hybrid import BLOCK, MODELS
from tests.prefix_requests import left_padded

GENERATOR = torch.Generator().manual_seed(5)
DOCUMENT = torch.randint(3, 96, (1, 64), generator=GENERATOR)  # 8 blocks of 8 tokens, well past the 24-token window
QUESTIONS = [torch.randint(3, 96, (1, 6), generator=GENERATOR) for _ in range(3)]
OPTIONS: dict[str, Any] = {"max_new_tokens": 8, "do_sample": False}


def prompt(question: int) -> torch.Tensor:
    return torch.cat([DOCUMENT, QUESTIONS[question]], dim=1)  # 70 tokens


def without_sharing(model: Any, ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    return model.generate(ids, cache=DynamicCache(config=model.config), **(OPTIONS | kwargs))


def request(model: Any, cache: Any, ids: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, int]:
    """match -> generate -> publish -> release, as a server does; returns (sequences, prompt tokens served)."""
    inputs = cache.match(ids)
    served = cache.get_seq_length()
    out = model.generate(**inputs, cache=cache, **(OPTIONS | kwargs))
    cache.publish(out)
    cache.release()
    return out, served


@pytest.mark.parametrize("kind", ["paged", "paged-attention", "disk"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_second_request_on_the_document_computes_only_its_question(name: str, kind: str) -> None:
    model = MODELS[name]
    tree = prefix_tree(model, pool=Paging(block_size=BLOCK))
    assert tree.pool.groups == PagedCache(model).groups and tree.grouped is not None

    def cache() -> Any:
        if kind == "disk":
            return DiskOffloadCache(model, prefix=tree, hot_tokens=8)  # the document's own blocks would spill
        return PagedCache(model, prefix=tree, attention="paged" if kind == "paged-attention" else "contiguous")

    def run(question: int) -> tuple[torch.Tensor, int]:
        if kind == "paged-attention":
            with paged_attention(model):
                return request(model, cache(), prompt(question))
        return request(model, cache(), prompt(question))

    first, served = run(0)
    assert served == 0 and torch.equal(first, without_sharing(model, prompt(0)))
    second, served = run(1)
    # The document's 8 blocks come from the tree: 6 of 70 prompt tokens are computed (8.6%).
    assert served == 64 and torch.equal(second, without_sharing(model, prompt(1)))
    assert tree.pool.num_used == tree.stats().pool_blocks  # every request released its own blocks
    tree.check_invariants()


def test_a_sliding_table_starts_at_its_window_and_the_tree_keeps_what_the_request_freed() -> None:
    model = MODELS["gemma3"]
    tree = prefix_tree(model, pool=Paging(block_size=BLOCK))
    request(model, PagedCache(model, prefix=tree), prompt(0))
    # 77 tokens stored (70 + 7 fed back): 9 full blocks; each entry holds a block of each of the 3 groups, the
    # sliding ones published as the prompt was computed, before the request freed them.
    stats = tree.stats()
    assert (stats.cached_blocks, stats.pool_blocks) == (9, 27)
    cache = PagedCache(model, prefix=tree)
    cache.match(prompt(1))
    # Queries at 64 see 41 .. 64: a sliding group needs blocks 5 (40 .. 47) to 7; the full group all 8.
    assert [tables.first_block for tables in cache.all_tables] == [5, 5, 0]
    assert [len(tables.rows[0].live_ids) for tables in cache.all_tables] == [3, 3, 8]
    assert cache.stats().blocks_in_use == 14
    cache.release()


def test_a_hit_is_cut_where_a_sliding_group_lacks_its_window() -> None:
    model = MODELS["gemma3"]
    tree = prefix_tree(model, pool=Paging(block_size=BLOCK))
    first = PagedCache(model, prefix=tree)  # no match: the cache does not know the prompt while computing it
    out = model.generate(prompt(0), cache=first, **OPTIONS)
    first.publish(out)  # so only the blocks still live are offered: the sliding groups' from block 6 (48 ..) on
    first.release()
    # A hit at 64 needs the sliding blocks from 5 on, at 56 from 4 on...: no point of the document is servable.
    again = PagedCache(model, prefix=tree)
    inputs = again.match(prompt(1))
    assert again.get_seq_length() == 0
    assert torch.equal(model.generate(**inputs, cache=again, **OPTIONS), without_sharing(model, prompt(1)))
    # The same prompt again: the hit at 72 needs sliding blocks 6 .. 8, which the publish offered.
    again.release()
    same = PagedCache(model, prefix=tree)
    inputs = same.match(out[:, :73])
    assert same.get_seq_length() == 72
    assert torch.equal(model.generate(**inputs, cache=same, **OPTIONS), without_sharing(model, out[:, :73]))


def test_rows_of_one_batch_and_beams_share_the_document() -> None:
    model = MODELS["gemma3"]
    tree = prefix_tree(model, pool=Paging(block_size=BLOCK))
    request(model, PagedCache(model, prefix=tree), prompt(0))
    both = torch.cat([prompt(1), prompt(2)])
    out, served = request(model, PagedCache(model, prefix=tree), both)
    assert served == 64 and torch.equal(out, without_sharing(model, both))
    beamed = PagedCache(model, prefix=tree)  # beams fork the hit's rows (generate returns the best beam only)
    inputs = beamed.match(prompt(2))
    assert beamed.get_seq_length() == 64
    beams = model.generate(**inputs, cache=beamed, **(OPTIONS | {"num_beams": 3}))
    assert torch.equal(beams, without_sharing(model, prompt(2), num_beams=3))


def test_the_pool_takes_back_sliding_blocks_only_the_tree_holds_first() -> None:
    model = MODELS["gemma3"]
    tree = prefix_tree(model, pool=Paging(block_size=BLOCK, max_tokens=40 * BLOCK))  # 40 blocks
    request(model, PagedCache(model, prefix=tree), prompt(0))
    assert (tree.stats().cached_blocks, tree.stats().pool_blocks) == (9, 27)
    held = tree.pool.allocate(13 + 4)  # 13 blocks are free: 4 more come from the tree
    stats = tree.stats()
    # The 4 least recently used sliding blocks went (the first entries'), every entry and full block stayed.
    assert (stats.cached_blocks, stats.pool_blocks, stats.evictions) == (9, 23, 0)
    tree.pool.decref(held)
    cache = PagedCache(model, prefix=tree)
    inputs = cache.match(prompt(1))
    assert cache.get_seq_length() == 64  # entries 0 and 1 lost their sliding blocks; a hit at 64 needs 5 .. 7
    assert torch.equal(model.generate(**inputs, cache=cache, **OPTIONS), without_sharing(model, prompt(1)))
    cache.release()
    everything = tree.pool.allocate(tree.pool.num_free + tree.stats().pool_blocks)  # then whole entries go
    assert tree.stats().cached_blocks == 0 and tree.pool.num_free == 0
    tree.check_invariants()
    tree.pool.decref(everything)


def test_threads_share_one_grouped_tree_consistently() -> None:
    model = MODELS["gemma3"]
    # The document is cached first; then 8 requests on it, 4 at a time, each needing about 6 blocks of its own
    # besides the document's last window: 48 blocks make the tree give sliding blocks back, never run out.
    tree = prefix_tree(model, pool=Paging(block_size=BLOCK, max_tokens=48 * BLOCK))
    request(model, PagedCache(model, prefix=tree), prompt(0))
    questions = [torch.cat([DOCUMENT, torch.randint(3, 96, (1, 4 + i % 3), generator=GENERATOR)], 1) for i in range(8)]
    expected = [without_sharing(model, q) for q in questions]
    results: dict[int, tuple[torch.Tensor, int]] = {}
    errors: list[BaseException] = []

    def worker(indices: list[int]) -> None:
        try:
            for i in indices:
                results[i] = request(model, PagedCache(model, prefix=tree), questions[i])
        except BaseException as error:  # reported below: a thread's exception must fail the test
            errors.append(error)

    threads = [threading.Thread(target=worker, args=([i, i + 4],)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    for i, (out, _) in results.items():
        assert torch.equal(out, expected[i])
    assert all(served == 64 for _, served in results.values())
    stats = tree.stats()
    assert stats.pool_blocks < 3 * stats.cached_blocks  # the pool took sliding blocks back from the tree
    tree.check_invariants()
    tree.clear()
    assert tree.pool.num_used == 0


@pytest.mark.parametrize("kind", [QuantizedCache, QuantizedDiskCache])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_quantized_caches_share_codes_over_layer_groups(name: str, kind: type) -> None:
    model = MODELS[name]
    tree = prefix_tree(model, pool=Paging(block_size=BLOCK), codec="int8")
    assert tree.pool.groups == QuantizedCache(model).groups and tree.grouped is not None
    extra: dict[str, Any] = {"hot_tokens": 8} if kind is QuantizedDiskCache else {}
    for question in (0, 1):
        alone = model.generate(prompt(question), cache=QuantizedCache(model, block_size=BLOCK), **OPTIONS)
        out, served = request(model, kind(model, prefix=tree, **extra), prompt(question))
        assert served == (0 if question == 0 else 64) and torch.equal(out, alone)
    # The tree holds codes: its only full-precision blocks are each group's sink (block 0), all else is sealed.
    assert tree.pool.num_used == len(tree.pool.groups)
    tree.check_invariants()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_batch_that_would_pad_inside_a_window_is_refused_and_one_that_does_not_is_exact(name: str) -> None:
    """transformers' sliding mask counts slots: padding between a row's hit and its new tokens would take places in
    its window. Such a batch is refused with the reason, holding nothing; rows whose only padding comes before every
    real token are served, each as if alone."""
    model = MODELS[name]
    tree = prefix_tree(model, pool=Paging(block_size=BLOCK))
    request(model, PagedCache(model, prefix=tree), prompt(0))
    held = tree.pool.num_used
    short_hit = torch.cat([DOCUMENT[:, :32], QUESTIONS[2]], dim=1)[0].tolist()  # hits 32 tokens, 38 long
    for rows in ([prompt(1)[0].tolist(), short_hit], [short_hit, QUESTIONS[0][0].tolist() + [7] * 40]):
        cache = PagedCache(model, prefix=tree)
        padded = left_padded(rows)
        with pytest.raises(ValueError, match=r"row \d reuses \d+ cached tokens, and its \d+ padding slots .* sliding"):
            cache.match(padded["input_ids"], padded["attention_mask"])
        assert tree.pool.num_used == held and cache.prefix_locks == []  # every reference and lock given back
        tree.check_invariants()
    rows = [prompt(1)[0].tolist(), QUESTIONS[0][0].tolist()]  # the hit row is the longest: no gap after its hit
    cache = PagedCache(model, prefix=tree)
    padded = left_padded(rows)
    inputs = cache.match(padded["input_ids"], padded["attention_mask"])
    assert cache.get_seq_length() == 64
    out = model.generate(**inputs, cache=cache, **OPTIONS)
    for row, tokens in zip(out, rows, strict=True):
        assert row[-8:].tolist() == without_sharing(model, torch.tensor([tokens]))[0, -8:].tolist()
    cache.release()


def test_unequal_hits_on_full_attention_stay_served() -> None:
    model = tiny_llama()
    tree = prefix_tree(model, pool=Paging(block_size=BLOCK))
    request(model, PagedCache(model, prefix=tree), prompt(0))
    rows = [prompt(1)[0].tolist(), torch.cat([DOCUMENT[:, :32], QUESTIONS[2]], dim=1)[0].tolist()]
    cache = PagedCache(model, prefix=tree)
    padded = left_padded(rows)
    inputs = cache.match(padded["input_ids"], padded["attention_mask"])
    assert [row.cached for row in cache.row_layouts or []] == [64, 32]
    out = model.generate(**inputs, cache=cache, **OPTIONS)
    for row, tokens in zip(out, rows, strict=True):
        assert row[-8:].tolist() == without_sharing(model, torch.tensor([tokens]))[0, -8:].tolist()
