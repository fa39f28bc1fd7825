"""Eviction caches on a shared prefix: the tree's blocks attended as computed, the budget for the rest.

A block cache publishes the document; eviction requests match it. With a budget covering their own tokens
they compute what DynamicCache computes on the whole prompt (the prefix is read exactly as computed); with
a small one the prefix is still read in full at every step and only their own tokens are evicted. On a
hybrid model (a tree whose pool has layer groups) a sliding layer reads the prefix's blocks inside its window.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transformers import DynamicCache

from hf_kvgov import (
    Disk,
    GovernedCache,
    HeavyHitter,
    HeavyHitterCache,
    PagedCache,
    Paging,
    PolicyCache,
    Sink,
    eviction_attention,
    prefix_tree,
)
from hf_kvgov.chain import ChainRefused
from hf_kvgov.policies import SnapKV
from tests.conftest import tiny_gemma3, tiny_llama

BLOCK, DOCUMENT, NEW = 4, 24, 8


def tokens(count: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 96, (1, count), generator=torch.Generator().manual_seed(seed))


def published(model: Any, document: torch.Tensor) -> Any:
    """A tree holding `document` (and a question after it), published by a PagedCache."""
    tree = prefix_tree(model, pool=Paging(BLOCK))
    first = PagedCache(model, prefix=tree)
    prompt = torch.cat((document, tokens(5, seed=99)), dim=1)
    out = model.generate(**first.match(prompt), cache=first, max_new_tokens=2, do_sample=False)
    assert first.publish(out) >= DOCUMENT // BLOCK
    first.release()
    return tree


def run(model: Any, cache: Any, ids: torch.Tensor, mask: torch.Tensor | None = None, **kwargs: Any) -> Any:
    mask = torch.ones_like(ids) if mask is None else mask
    inputs = (
        cache.match(ids, mask)
        if getattr(cache, "prefix", None) is not None
        else {"input_ids": ids, "attention_mask": mask}
    )
    context = eviction_attention(model) if not isinstance(cache, DynamicCache) else torch.inference_mode()
    with context, torch.inference_mode():
        return model.generate(
            **inputs, cache=cache, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
            output_logits=True, return_dict_in_generate=True, **kwargs,
        )  # fmt: skip


def largest_gap(first: Any, second: Any) -> float:
    return max(float((a - b).abs().max()) for a, b in zip(first.logits, second.logits, strict=True))


def counted_prefix_slots(cache: Any) -> list[int]:
    """The valid extra slots (the shared prefix, in every KV head) each layer step attends, as a list to read."""
    seen: list[int] = []
    extra = cache._extra_slots

    def counting(layer: Any, query: torch.Tensor, first: torch.Tensor) -> Any:
        slots = extra(layer, query, first)
        seen.append(int(slots.valid.sum()))
        return slots

    cache._extra_slots = counting
    return seen


def requests_on_one_document(model: Any) -> Iterator[tuple[torch.Tensor, Any, list[int], Any]]:
    """Two requests of 7 own tokens each on one published document, H2O at 4 slots: yields (prompt, cache, the
    valid prefix slots each layer step read, generate's output); then the tree must give everything back."""
    document = tokens(DOCUMENT, seed=1)
    tree = published(model, document)
    for seed in (2, 3):
        prompt = torch.cat((document, tokens(7, seed=seed)), dim=1)
        cache = HeavyHitterCache(model, budget=4, recent=2, prefix=tree)
        seen = counted_prefix_slots(cache)
        out = run(model, cache, prompt)
        assert cache.shared is not None and cache.shared.tokens == [DOCUMENT]
        assert cache.get_seq_length() == DOCUMENT + 7 + NEW - 1
        yield prompt, cache, seen, out
        cache.release()
    tree.clear()
    assert tree.pool.num_used == 0  # every lock and reference went back


def hit_and_miss(document: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row 0 hits the document; row 1 is another text, left-padded: it misses and computes everything."""
    hit = torch.cat((document, tokens(6, seed=4)), dim=1)
    miss = tokens(DOCUMENT + 2, seed=5)
    ids = torch.cat((hit, torch.cat((torch.zeros(1, 4, dtype=torch.long), miss), dim=1)), dim=0)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    return ids, mask


def test_two_requests_on_one_document_both_read_the_whole_prefix() -> None:
    model = tiny_llama()
    for prompt, cache, seen, out in requests_on_one_document(model):
        assert seen and set(seen) == {DOCUMENT * 2}  # every layer, every step: the document in both KV heads
        assert cache.stats().kept == ((4, 4), (4, 4))  # the budget holds the request's own tokens only
        full = run(model, DynamicCache(config=model.config), prompt)
        alone = run(model, HeavyHitterCache(model, budget=4, recent=2), prompt)
        assert largest_gap(out, full) < largest_gap(alone, full)  # the document, read in full, is not evicted


@pytest.mark.parametrize("beams", [1, 2])
def test_with_room_for_its_own_tokens_a_request_equals_the_full_cache(beams: int) -> None:
    model = tiny_llama()
    document = tokens(DOCUMENT, seed=1)
    tree = published(model, document)
    ids, mask = hit_and_miss(document)
    full = run(model, DynamicCache(config=model.config), ids, mask, num_beams=beams)
    for cache in (
        HeavyHitterCache(model, budget=100, prefix=tree),
        PolicyCache(model, SnapKV(window=4), budget=100, prefix=tree),
        HeavyHitterCache(model, budget=100, codec="int8", prefix=tree),
    ):
        out = run(model, cache, ids, mask, num_beams=beams)
        assert cache.shared is not None and cache.shared.tokens[:1] == [DOCUMENT]
        tolerance = 0.05 if cache.codec_name else 1e-5  # int8 slots hold the request's own tokens as codes
        assert largest_gap(out, full) < tolerance
        if not cache.codec_name:  # the inputs are laid out around the hit: compare what was generated
            assert torch.equal(out.sequences[:, -NEW:], full.sequences[:, -NEW:])
        cache.release()


def test_a_fraction_is_of_the_own_prompt() -> None:
    model = tiny_llama()
    document = tokens(DOCUMENT, seed=1)
    tree = published(model, document)
    cache = HeavyHitterCache(model, budget=0.5, prefix=tree)
    run(model, cache, torch.cat((document, tokens(10, seed=6)), dim=1))
    assert cache.budget == 5  # half of the 10 tokens after the 24 shared ones


def test_the_issue_chain_builds_and_generates(tmp_path: Any) -> None:
    model = tiny_llama()
    document = tokens(DOCUMENT, seed=1)
    tree = published(model, document)
    cache = GovernedCache(
        model, pool=Paging(16), prefix=tree, codec="int8", policy=HeavyHitter(0.2), spill=Disk(path=str(tmp_path))
    )
    assert isinstance(cache, HeavyHitterCache)
    assert cache.parts.describe().startswith("paged (a shared pool of 16-token blocks) -> prefix sharing -> int8")
    out = run(model, cache, torch.cat((document, tokens(40, seed=7)), dim=1))
    assert out.sequences.shape[1] == DOCUMENT + 40 + NEW
    recall = cache.recall_stats()
    assert recall is not None and recall.pages_written > 0  # its own evicted tokens went to disk
    assert cache.shared is not None and cache.shared.tokens == [DOCUMENT]


def test_the_briefs_chain_reads_a_tree_of_codes_as_its_codes_decode(tmp_path: Any) -> None:
    """Prefix sharing, then int8, then heavy hitters, then disk, as the README builds it: the tree's blocks stay
    codes (the sink block in full precision) and each layer attends exactly what they decode to."""
    model = tiny_llama()
    document = tokens(48, seed=2)  # three 16-token blocks: the sink, then two sealed when published
    tree = prefix_tree(model, pool=Paging(16), codec="int8")
    publisher = GovernedCache(model, pool=Paging(16), prefix=tree, codec="int8")
    prompt = torch.cat((document, tokens(5, seed=99)), dim=1)
    out = model.generate(**publisher.match(prompt), cache=publisher, max_new_tokens=2, do_sample=False)
    publisher.publish(out)
    publisher.release()
    codes_held = tree.pool.sealed.num_used
    assert codes_held == 2
    cache = GovernedCache(
        model, pool=Paging(16), prefix=tree, codec="int8", policy=HeavyHitter(0.2), spill=Disk(path=str(tmp_path))
    )
    assert isinstance(cache, HeavyHitterCache)
    own = tokens(40, seed=7)
    run(model, cache, torch.cat((document, own), dim=1))
    assert cache.shared is not None and cache.shared.tokens == [48]
    entries = cache.shared.hits[0][0]
    assert entries[0] >= 0 and all(entry < 0 for entry in entries[1:])  # read from the codes, not copies
    assert tree.pool.sealed.num_used == codes_held and tree.pool.num_used == 1  # nothing decoded into the pool
    for layer in range(model.config.num_hidden_layers):
        slots = cache.shared.slots(layer)
        keys, values = tree.pool.gather_blocks(layer, torch.tensor(entries))
        sealed_keys, _ = tree.pool.read_sealed(layer, torch.tensor(entries[1:]), torch.float32)
        torch.testing.assert_close(keys[1:], sealed_keys, rtol=0, atol=0)
        torch.testing.assert_close(slots.keys[0], keys.reshape(48, 2, 16).transpose(0, 1), rtol=0, atol=0)
        torch.testing.assert_close(slots.values[0], values.reshape(48, 2, 16).transpose(0, 1), rtol=0, atol=0)
    recall = cache.recall_stats()
    assert recall is not None and recall.pages_written > 0  # its own evicted tokens went to disk
    cache.release()
    # With room for its own tokens, a request over the codes stays within int8's noise of the full cache.
    roomy = HeavyHitterCache(model, budget=100, prefix=tree)
    full = run(model, DynamicCache(config=model.config), torch.cat((document, own), dim=1))
    assert largest_gap(run(model, roomy, torch.cat((document, own), dim=1)), full) < 0.05


@pytest.mark.parametrize("beams", [1, 2])
def test_on_a_hybrid_model_a_request_with_room_equals_the_full_cache(beams: int) -> None:
    model = tiny_gemma3()  # layers: sliding (window 8), full, sliding
    document = tokens(DOCUMENT, seed=1)
    tree = published(model, document)
    assert tree.grouped is not None
    ids, mask = hit_and_miss(document)
    full = run(model, DynamicCache(config=model.config), ids, mask, num_beams=beams)
    for cache in (
        HeavyHitterCache(model, budget=100, prefix=tree),
        PolicyCache(model, SnapKV(window=4), budget=100, prefix=tree),
        GovernedCache(model, prefix=tree, pool=Paging(BLOCK), policy=HeavyHitter(100)),  # slots in pool blocks
    ):
        out = run(model, cache, ids, mask, num_beams=beams)
        assert cache.shared is not None and cache.shared.tokens[:1] == [DOCUMENT]
        assert largest_gap(out, full) < 1e-5
        assert torch.equal(out.sequences[:, -NEW:], full.sequences[:, -NEW:])
        cache.release()
    tree.clear()
    assert tree.pool.num_used == 0  # every entry's lock and every block's reference went back


def test_two_requests_on_a_hybrid_document_read_it_in_full_where_their_layers_can_see_it() -> None:
    for _, cache, seen, out in requests_on_one_document(tiny_gemma3()):
        # Per layer step and both KV heads: the full layer reads all 24 document tokens; a sliding layer the
        # blocks from the one holding token 24 - 8 + 1 = 17 (tokens 16..23), the first its next query sees.
        assert seen[:3] == [2 * 8, 2 * DOCUMENT, 2 * 8] and set(seen) == {2 * 8, 2 * DOCUMENT}
        assert cache.stats().kept == ((4, 4),) * 3  # the budget holds the request's own tokens only
        assert out.sequences.shape[1] == DOCUMENT + 7 + NEW


def test_trees_an_eviction_cache_cannot_read_are_refused() -> None:
    with pytest.raises(ValueError, match=r"layer groups keep windows \[8, None, 8\].*have \[4, None, 4\]"):
        HeavyHitterCache(tiny_gemma3(window=4), prefix=prefix_tree(tiny_gemma3(), pool=Paging(BLOCK)))
    model = tiny_llama()
    with pytest.raises(ValueError, match=r"holds 2 layers x 2 KV heads x 16.*2 x 1 x 16"):
        HeavyHitterCache(tiny_llama(num_kv_heads=1), prefix=prefix_tree(model, pool=Paging(BLOCK)))
    with pytest.raises(ChainRefused, match="attention sinks"):
        GovernedCache(model, prefix=prefix_tree(model, pool=Paging(BLOCK)), policy=Sink(2, 8))
    with pytest.raises(ValueError, match="needs a prefix cache"):
        HeavyHitterCache(model).match(tokens(4, seed=0))
    cache = HeavyHitterCache(model, budget=4, prefix=prefix_tree(model, pool=Paging(BLOCK)))
    cache.match(tokens(8, seed=0))
    with pytest.raises(ValueError, match="needs an empty cache"):
        cache.match(tokens(8, seed=0))
