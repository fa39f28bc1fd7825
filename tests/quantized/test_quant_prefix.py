"""Prefix sharing in a QuantizedCache: a request served from the tree reads what it would have computed.

The reference for a warm request is the same QuantizedCache without a prefix tree, fed the same inputs
(the ones `match` hands to generate) in two forwards: the matched prefix first, then generate. Sealing is
deterministic, so the tree's codes (encoded by an earlier request, from a longer prompt) are the codes the
reference encodes itself, and tokens and logits agree to float tolerance. A one-forward prefill of the
whole prompt is not the reference: its suffix attends to the prefix in full precision during that step.

Tiny model, blocks of 4 tokens, `residual=0`, one sink block: after a step of length L a row holds the sink
and the tail (L % 4 tokens) in full precision and columns 1 .. L // 4 - 1 sealed.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from hf_kvgov import PagedCache, paged_attention
from hf_kvgov.engine import paged_prefix
from hf_kvgov.errors import PoolExhausted
from hf_kvgov.hf.quantized_cache import QuantizedCache
from hf_kvgov.prefix.sharing import PrefixCache
from hf_kvgov.storage.pool import BlockPool
from hf_kvgov.storage.quantized_pool import QuantizedBlockPool
from tests.conftest import tiny_llama

MODEL = tiny_llama(num_kv_heads=2, seed=3)
BLOCK = 4
NEW = 6
CODECS = {"int8": {"bits": 8}, "int4": {"bits": 4}, "fp8": {"bits": 8, "fmt": "fp8"}}


def tokens(length: int, seed: int) -> list[int]:
    return torch.randint(3, 96, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def left_padded(rows: list[list[int]]) -> dict[str, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return {"input_ids": ids, "attention_mask": mask}


def shared_tree(codec: str = "int8", max_tokens: int | None = None, **options: Any) -> PrefixCache:
    """A PrefixCache over the pool of a QuantizedCache configured like the requests that will use it."""
    owner = QuantizedCache(MODEL, block_size=BLOCK, max_tokens=max_tokens, **CODECS[codec], **options)
    assert isinstance(owner.pool, QuantizedBlockPool)
    return PrefixCache(owner.pool)


def generate(cache: Any, inputs: dict[str, torch.Tensor], **kwargs: Any) -> Any:
    kwargs.setdefault("max_new_tokens", NEW)
    return MODEL.generate(
        **inputs, cache=cache, do_sample=False, return_dict_in_generate=True, output_logits=True, **kwargs
    )


@dataclass
class Served:
    new_tokens: torch.Tensor  # long [rows, NEW]
    logits: torch.Tensor  # [rows (x beams), NEW, vocab]
    reused: int  # tokens the tree served
    inputs: dict[str, torch.Tensor]  # what generate was given
    cache: QuantizedCache


def serve(prefix: PrefixCache, rows: list[list[int]], codec: str = "int8", keep: bool = False, **kwargs: Any) -> Served:
    """match -> generate -> publish (not after beam search) -> release unless `keep`."""
    options = kwargs.pop("options", {})
    cache = QuantizedCache(MODEL, block_size=BLOCK, prefix=prefix, **CODECS[codec], **options)
    padded = left_padded(rows)
    inputs = cache.match(padded["input_ids"], padded["attention_mask"])
    reused = cache.get_seq_length()
    out = generate(cache, inputs, **kwargs)
    if kwargs.get("num_beams", 1) == 1:
        cache.publish(out.sequences)
    if not keep:
        cache.release()
    return Served(out.sequences[:, -NEW:], torch.stack(out.logits, 1), reused, inputs, cache)


def computed_alone(served: Served, codec: str, path: str = "contiguous", **kwargs: Any) -> tuple[torch.Tensor, ...]:
    """The reference: a QuantizedCache without a tree computes the matched prefix itself, then generates."""
    cache = QuantizedCache(MODEL, block_size=BLOCK, attention=path, **CODECS[codec])  # type: ignore[arg-type]
    ids, mask = served.inputs["input_ids"], served.inputs["attention_mask"]
    with paged_attention(MODEL) if path == "paged" else contextlib.nullcontext():
        if served.reused:
            # no_grad, not inference_mode: the sealed store grows inside this call, and tensors created
            # under inference_mode cannot be written by generate afterwards.
            with torch.no_grad():
                MODEL(input_ids=ids[:, : served.reused], attention_mask=mask[:, : served.reused], cache=cache)
        cache.batch_repeat_interleave(kwargs.get("num_beams", 1))  # generate expands the inputs, not the cache
        out = generate(cache, served.inputs, **kwargs)
    return out.sequences[:, -NEW:], torch.stack(out.logits, 1)


def assert_same(served: Served, expected: tuple[torch.Tensor, ...]) -> None:
    assert torch.equal(served.new_tokens, expected[0])
    torch.testing.assert_close(served.logits, expected[1], atol=1e-5, rtol=1e-5)


DOCUMENT = tokens(26, seed=1)


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_warm_request_equals_computing_the_prefix_itself(codec: str) -> None:
    prefix = shared_tree(codec)
    cold = serve(prefix, [DOCUMENT + tokens(3, seed=2)], codec)
    assert cold.reused == 0
    assert_same(cold, computed_alone(cold, codec))  # a miss is a plain QuantizedCache run
    request = [DOCUMENT[:22] + tokens(7, seed=3)]
    warm = serve(prefix, request, codec)
    assert warm.reused == 20  # 22 common tokens -> 5 whole blocks of 4
    assert_same(warm, computed_alone(warm, codec))


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_left_padded_batch_with_different_hits(codec: str) -> None:
    prefix = shared_tree(codec)
    serve(prefix, [DOCUMENT + tokens(3, seed=2)], codec)
    rows = [DOCUMENT + tokens(5, seed=4), tokens(12, seed=5), DOCUMENT[:13] + tokens(9, seed=6)]
    warm = serve(prefix, rows, codec)
    assert warm.reused == 24
    # Hits of 24, 0 and 12 tokens: shorter hits are followed by masked padding up to the longest.
    assert warm.inputs["attention_mask"][:, :24].sum(1).tolist() == [24, 0, 12]
    assert_same(warm, computed_alone(warm, codec))


def test_matched_rows_seal_their_padding_before_the_prefill() -> None:
    prefix = shared_tree()
    pool = prefix.pool
    assert isinstance(pool, QuantizedBlockPool)
    serve(prefix, [DOCUMENT + tokens(3, seed=2)])  # the tree: sink + 7 sealed blocks
    cache = QuantizedCache(MODEL, block_size=BLOCK, prefix=prefix)
    rows = left_padded([DOCUMENT + tokens(5, seed=4), tokens(12, seed=5), DOCUMENT[:13] + tokens(9, seed=6)])
    cache.match(rows["input_ids"], rows["attention_mask"])
    # Hits of 6, 0 and 3 blocks. Padding blocks past the sink column (5 for the miss, 3 for the short hit)
    # are sealed now, as a cache that had computed these 24 slots would have; only the shared sink and the
    # miss row's first (padding) block stay in full precision.
    assert [[b < 0 for b in row.block_ids] for row in cache.tables.rows] == [[False] + [True] * 5] * 3  # type: ignore[union-attr]
    assert (pool.num_used, pool.sealed.num_used) == (2, 7 + 8)
    cache.release()
    assert (pool.num_used, pool.sealed.num_used) == (1, 7)


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_beam_search_from_a_matched_prefix(codec: str) -> None:
    prefix = shared_tree(codec)
    serve(prefix, [DOCUMENT + tokens(3, seed=2)], codec)
    rows = [DOCUMENT[:17] + tokens(4, seed=7), DOCUMENT + tokens(2, seed=8)]
    warm = serve(prefix, rows, codec, keep=True, num_beams=3)
    assert warm.reused == 24
    assert_same(warm, computed_alone(warm, codec, num_beams=3))
    pool = warm.cache.pool
    assert isinstance(pool, QuantizedBlockPool)
    warm.cache.release()
    # Only the tree's blocks remain: the first request's 8 full blocks of 34 tokens, the sink in full precision.
    assert (pool.num_used, pool.sealed.num_used) == (1, 7)


def test_paged_attention_path() -> None:
    prefix = shared_tree()
    serve(prefix, [DOCUMENT + tokens(3, seed=2)])
    cache = QuantizedCache(MODEL, block_size=BLOCK, attention="paged", prefix=prefix)
    request = left_padded([DOCUMENT[:22] + tokens(7, seed=3)])
    inputs = cache.match(request["input_ids"], request["attention_mask"])
    with paged_attention(MODEL):
        out = generate(cache, inputs)
    warm = Served(out.sequences[:, -NEW:], torch.stack(out.logits, 1), 20, inputs, cache)
    assert_same(warm, computed_alone(warm, "int8", path="paged"))


def test_prompt_lookup_decoding_after_a_match_crops_into_sealed_blocks() -> None:
    prefix = shared_tree()
    repetitive = [5, 6, 7, 8] * 6
    serve(prefix, [[*repetitive, 9]])
    warm = serve(prefix, [[*repetitive, 5, 6]], prompt_lookup_num_tokens=3)
    assert warm.reused == 24
    assert_same(warm, computed_alone(warm, "int8", prompt_lookup_num_tokens=3))


def test_crop_into_a_matched_sealed_block_decodes_a_private_copy() -> None:
    prefix = shared_tree()
    serve(prefix, [DOCUMENT + tokens(3, seed=2)])
    ids = torch.tensor([DOCUMENT])
    cache = QuantizedCache(MODEL, block_size=BLOCK, prefix=prefix)
    cache.match(ids)
    shared = cache.tables.rows[0].block_ids[4]  # type: ignore[union-attr]
    assert shared < 0 and prefix.pool.ref_count(shared) == 2  # the tree + this row
    reference = QuantizedCache(MODEL, block_size=BLOCK)
    with torch.no_grad():
        MODEL(ids[:, :24], cache=reference)
        for c in (cache, reference):
            c.crop(-6)  # 18 tokens: block 4 keeps tokens 16, 17 and must take writes again
        got = MODEL(ids[:, 18:], cache=cache).logits
        expected = MODEL(ids[:, 18:], cache=reference).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert prefix.pool.ref_count(shared) == 1  # the tree still caches its sealed block
    cache.release()


def test_two_requests_hold_the_sealed_prefix_once() -> None:
    prefix = shared_tree()
    pool = prefix.pool
    assert isinstance(pool, QuantizedBlockPool)
    first = serve(prefix, [DOCUMENT], keep=True)
    # 26 + 6 new tokens -> 31 stored: the sink, 6 sealed blocks (published with the sink), a tail of 3.
    second = serve(prefix, [DOCUMENT[:20] + tokens(9, seed=9)], keep=True)
    # 20 tokens matched (sink + 4 sealed), 29 + 5 = 34 stored: 3 more sealed blocks of its own, a tail of 2.
    assert second.reused == 20
    assert (first.cache.stats().sealed_blocks, first.cache.stats().full_precision_blocks) == (6, 2)
    assert (second.cache.stats().sealed_blocks, second.cache.stats().full_precision_blocks) == (7, 2)
    # Without sharing: 6 + 7 sealed and 2 + 2 full-precision blocks. Shared: the 4 sealed blocks and the
    # sink both requests hold exist once.
    assert (pool.sealed.num_used, pool.num_used) == (9, 3)
    first.cache.release()
    second.cache.release()
    # What the tree caches: the first request's 7 full blocks, then the second's 3 past the fork (column 5).
    assert (pool.sealed.num_used, pool.num_used) == (9, 1)
    assert prefix.clear() == 7 + 3
    assert (pool.sealed.num_used, pool.num_used) == (0, 0)


def test_rows_matching_one_prefix_count_its_blocks_once() -> None:
    prefix = shared_tree()
    pool = prefix.pool
    serve(prefix, [DOCUMENT + tokens(3, seed=2)])
    cache = QuantizedCache(MODEL, block_size=BLOCK, prefix=prefix)
    request = left_padded([DOCUMENT[:24] + tokens(3, seed=10), DOCUMENT[:24] + tokens(5, seed=11)])
    cache.match(request["input_ids"], request["attention_mask"])
    stats = cache.stats()
    # Both rows hold the tree's sink and sealed blocks 1..5: 6 blocks, counted once each.
    assert (stats.blocks_in_use, stats.full_precision_blocks, stats.sealed_blocks) == (6, 1, 5)
    assert stats.sealed_bytes == 5 * pool.sealed.bytes_per_block  # type: ignore[attr-defined]
    rows = cache.tables.rows  # type: ignore[union-attr]
    assert rows[0].block_ids == rows[1].block_ids
    assert [pool.ref_count(b) for b in rows[0].block_ids] == [3] * 6  # the tree + two rows
    cache.release()


def test_reclaim_evicts_sealed_leaves_down_to_a_sink_when_the_full_precision_part_is_full() -> None:
    # 6 full-precision blocks. A 14-token prompt needs 4 of them during its prefill; each finished request
    # leaves its sink (full precision) and 3 sealed blocks (17 stored tokens) in the tree.
    prefix = shared_tree(max_tokens=6 * BLOCK)
    pool = prefix.pool
    assert isinstance(pool, QuantizedBlockPool)
    prompts = [tokens(14, seed=20 + i) for i in range(4)]
    for prompt in prompts:
        served = serve(prefix, [prompt], max_new_tokens=4)
        assert_same(served, computed_alone(served, "int8", max_new_tokens=4))
    # The fourth prefill found 3 free blocks: the oldest path went, its 3 sealed leaves first, then its sink.
    stats = prefix.stats()
    assert (stats.evictions, stats.cached_blocks) == (4, 12)
    assert (pool.num_used, pool.sealed.num_used) == (3, 9)
    assert serve(prefix, [prompts[0]], max_new_tokens=4).reused == 0
    assert serve(prefix, [prompts[3]], max_new_tokens=4).reused == 12
    prefix.tree.check_invariants()


def test_a_full_pool_with_nothing_evictable_is_exhausted_and_leaks_nothing() -> None:
    prefix = shared_tree(max_tokens=5 * BLOCK)
    pool = prefix.pool
    serve(prefix, [DOCUMENT[:14]], max_new_tokens=4)  # the tree: sink + 3 sealed blocks
    holder = QuantizedCache(MODEL, block_size=BLOCK, prefix=prefix)
    holder.match(torch.tensor([DOCUMENT[:14]]))  # locks the sink and 2 sealed blocks; the third is evictable
    with pytest.raises(PoolExhausted):
        serve(prefix, [tokens(20, seed=30)])  # a 20-token prefill needs 5 full-precision blocks; 4 are free
    holder.release()
    prefix.clear()
    assert (pool.num_used, pool.sealed.num_used) == (0, 0)  # type: ignore[attr-defined]


def test_residual_blocks_are_published_as_codes_while_the_row_keeps_them() -> None:
    prefix = shared_tree(residual=8)
    pool = prefix.pool
    assert isinstance(pool, QuantizedBlockPool)
    cache = QuantizedCache(MODEL, block_size=BLOCK, residual=8, prefix=prefix)
    out = generate(cache, cache.match(torch.tensor([DOCUMENT])))
    row = cache.tables.rows[0]  # type: ignore[union-attr]
    before = list(row.block_ids)
    # 31 tokens, newest 8 in full precision: columns 1-4 sealed, 5 and 6 full but in the window, 7 the tail.
    assert [b < 0 for b in before] == [False, True, True, True, True, False, False, False]
    assert cache.publish(out.sequences) == 7
    assert row.block_ids == before  # the row still reads its window in full precision
    assert (pool.num_used, pool.sealed.num_used) == (4, 6)  # the tree took sealed copies of columns 5, 6
    cache.release()
    assert (pool.num_used, pool.sealed.num_used) == (1, 6)
    again = serve(prefix, [DOCUMENT[:24] + tokens(3, seed=12)], options={"residual": 8})
    assert again.reused == 24  # the sink and 5 sealed blocks, column 5 the copy published above
    # 32 tokens stored: columns 6 and 7 (in its window) were published as copies too.
    assert (pool.num_used, pool.sealed.num_used) == (1, 8)
    prefix.clear()
    assert (pool.num_used, pool.sealed.num_used) == (0, 0)


def test_a_full_precision_block_the_tree_holds_is_sealed_privately_by_the_row() -> None:
    # Blocks published as they are (no sealed copies): the tree holds columns 5 and 6 in full precision.
    prefix = shared_tree(residual=8)
    publisher = QuantizedCache(MODEL, block_size=BLOCK, residual=8, prefix=prefix)
    out = generate(publisher, publisher.match(torch.tensor([DOCUMENT])))
    paged_prefix.publish(publisher, out.sequences, namespace=publisher.sharing_namespace)
    kept = publisher.tables.rows[0].block_ids[5]  # type: ignore[union-attr]
    publisher.release()
    assert kept >= 0 and prefix.pool.ref_count(kept) == 1  # the tree's reference
    cache = QuantizedCache(MODEL, block_size=BLOCK, prefix=prefix)
    request = left_padded([DOCUMENT[:24] + tokens(5, seed=13)])
    inputs = cache.match(request["input_ids"], request["attention_mask"])
    assert cache.get_seq_length() == 24
    # Column 5 is ready in this cache (residual 0): the row sealed its own copy before the prefill, the tree
    # kept its full-precision block. The prefill then reads the codes a cache computing the prefix would.
    row = cache.tables.rows[0].block_ids  # type: ignore[union-attr]
    assert row[5] < 0 and prefix.pool.ref_count(row[5]) == 1 and prefix.pool.ref_count(kept) == 1
    out = generate(cache, inputs)
    warm = Served(out.sequences[:, -NEW:], torch.stack(out.logits, 1), 24, inputs, cache)
    assert_same(warm, computed_alone(warm, "int8"))


def test_caches_that_seal_differently_never_share() -> None:
    prefix = shared_tree()
    serve(prefix, [DOCUMENT])
    assert serve(prefix, [DOCUMENT], options={"sink_blocks": 2}).reused == 0
    paged = PagedCache(MODEL, prefix=prefix)
    paged.match(torch.tensor([DOCUMENT]))
    assert paged.get_seq_length() == 0  # a PagedCache would read sealed ids as full-precision blocks
    paged.release()
    assert serve(prefix, [DOCUMENT]).reused == 24
    cache = QuantizedCache(MODEL, bits=8, prefix=prefix, namespace="tenant-a")
    assert cache.sharing_namespace.startswith("tenant-a") and "int8" in cache.sharing_namespace
    assert serve(prefix, [DOCUMENT], options={"namespace": "tenant-a"}).reused == 0


def test_trees_on_other_formats_are_refused() -> None:
    int8_tree = shared_tree("int8")
    with pytest.raises(ValueError, match="configured alike"):
        QuantizedCache(MODEL, bits=4, prefix=int8_tree)
    with pytest.raises(ValueError, match="configured alike"):
        QuantizedCache(MODEL, bits=8, full_precision_layers=(1,), prefix=int8_tree)
    plain = PrefixCache(BlockPool(PagedCache(MODEL).pool.geometry, block_size=BLOCK))  # type: ignore[union-attr]
    with pytest.raises(TypeError, match="QuantizedBlockPool"):
        QuantizedCache(MODEL, prefix=plain)
    with pytest.raises(ValueError, match="prefix= brings its own pool"):
        QuantizedCache(MODEL, pool=shared_tree("int8").pool, prefix=int8_tree)
    cache = QuantizedCache(MODEL, prefix=int8_tree)  # block_size comes from the tree's pool
    assert cache.pool is int8_tree.pool and cache.stats().block_size == BLOCK


@pytest.mark.real_model
def test_smollm2_shared_document_gives_the_same_greedy_tokens(smollm2, austen_text) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer = smollm2
    document = austen_text[30_000:32_000]
    questions = ["Who is speaking here?", "What did she say next?", "Where does this scene take place?"]
    prompts = [tokenizer(f"{document}\n\nQuestion: {q}\nAnswer:", return_tensors="pt") for q in questions]
    kwargs = {"max_new_tokens": 12, "do_sample": False, "return_dict_in_generate": True}

    def answer(cache: QuantizedCache, inputs: dict[str, torch.Tensor]) -> Any:
        return model.generate(**inputs, cache=cache, **kwargs)

    alone = [answer(QuantizedCache(model, bits=8), dict(p)).sequences for p in prompts]
    first = QuantizedCache(model, bits=8)
    prefix = PrefixCache(first.pool)  # type: ignore[arg-type]
    reused = []
    for prompt, expected in zip(prompts, alone, strict=True):
        cache = QuantizedCache(model, bits=8, prefix=prefix)
        inputs = cache.match(prompt["input_ids"], prompt["attention_mask"])
        reused.append(cache.get_seq_length())
        out = answer(cache, inputs)
        assert torch.equal(out.sequences, expected)
        cache.publish(out.sequences)
        cache.release()
    document_tokens = len(tokenizer(document)["input_ids"])
    assert reused[0] == 0 and min(reused[1:]) >= (document_tokens - 16) // 16 * 16  # the document, whole blocks
