"""DiskOffloadCache(prefix=...): requests share a document through the prefix tree while each request's
private cold blocks spill. Outputs are PagedCache(prefix=)'s exactly; tree blocks never leave the pool;
reference counts stay right when the tree reclaims or a publish has to bring spilled blocks back.

Tiny model (2 layers, 2 KV heads, head dim 16, fp32): 512 bytes per token, 2,048 per 4-token block.
Block ids below follow the pool's free list: fresh ids in order, freed ids appended at its end.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import DynamicCache

from hf_kvgov import BlockPool, PagedCache, prefix_tree
from hf_kvgov.chain import Paging
from hf_kvgov.errors import PoolExhausted
from hf_kvgov.hf.disk_cache import DiskOffloadCache
from hf_kvgov.prefix.sharing import PrefixCache
from tests.conftest import tiny_llama
from tests.prefix_requests import assert_identical, left_padded, tokens
from tests.prefix_requests import serve as serve_requests

MODEL = tiny_llama(num_kv_heads=2, seed=3)
GEOMETRY = PagedCache(MODEL).pool.geometry  # type: ignore[union-attr]
BLOCK, BLOCK_BYTES, NEW = 4, 2048, 8
pytestmark = pytest.mark.usefixtures("one_thread")


def serve(cache: Any, rows: list[list[int]], **kwargs: Any) -> dict[str, Any]:
    return serve_requests(MODEL, NEW, cache, rows, **kwargs)


def tree(max_blocks: int | None = None) -> PrefixCache:
    cap = None if max_blocks is None else max_blocks * BLOCK
    return PrefixCache(BlockPool(GEOMETRY, block_size=BLOCK, max_tokens=cap))


@pytest.mark.parametrize("attention", ["contiguous", "paged"])
def test_shared_document_equals_paged_cache_while_private_blocks_spill(attention: str) -> None:
    document = tokens(32, seed=1)  # 8 blocks
    requests = [
        [document + tokens(3, seed=2)],
        [document + tokens(5, seed=3)],
        [document + tokens(4, seed=4), tokens(11, seed=5), document[:18] + tokens(6, seed=6)],  # hit, miss, part
    ]
    disk_tree, paged_tree = tree(), tree()
    for index, rows in enumerate(requests):
        disk = serve(DiskOffloadCache(MODEL, hot_tokens=4, prefix=disk_tree, attention=attention), rows)  # type: ignore[arg-type]
        paged = serve(PagedCache(MODEL, prefix=paged_tree, attention=attention), rows)  # type: ignore[arg-type]
        assert_identical(disk["out"], paged["out"])
        assert disk["reused"] == paged["reused"] == (0 if index == 0 else 32)
        assert disk["stats"].spilled_blocks > 0
        if index:  # the document's 8 blocks, matched from the tree, stayed in the pool in every row holding them
            assert disk["stats"].prefix_blocks == 8
            assert all(b >= 0 and b in disk_tree.tree for b in disk["held"][0][:8])
    assert disk["held"][2][:4] == disk["held"][0][:4]  # the row that hit 16 tokens shares their 4 blocks
    dynamic = MODEL.generate(**left_padded(requests[2]), max_new_tokens=NEW, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, cache=DynamicCache())  # fmt: skip
    assert torch.equal(disk["out"].sequences[:, -NEW:], dynamic.sequences[:, -NEW:])
    torch.testing.assert_close(torch.stack(disk["out"].logits), torch.stack(dynamic.logits), atol=1e-4, rtol=1e-4)
    assert disk_tree.stats().cached_blocks == paged_tree.stats().cached_blocks
    for shared in (disk_tree, paged_tree):
        shared.clear()
        assert shared.pool.num_used == 0  # nothing leaked: every block back once every cache is released


def test_multi_turn_reuses_every_turn_including_spilled_history(tmp_path: Path) -> None:
    disk_tree, paged_tree = tree(), tree()
    history_disk = history_paged = tokens(20, seed=10)
    for turn in range(3):
        disk = serve(DiskOffloadCache(MODEL, tmp_path, hot_tokens=4, prefix=disk_tree), [history_disk])
        paged = serve(PagedCache(MODEL, prefix=paged_tree), [history_paged])
        assert_identical(disk["out"], paged["out"])
        # publish brought the spilled history back, so the next turn reuses all of it, as with PagedCache:
        # turn 1 stored 20 + 7 tokens (6 blocks), turn 2 stored 33 + 7 (10 blocks)
        assert disk["reused"] == paged["reused"] == [0, 24, 40][turn]
        assert disk["stats"].spilled_blocks > 0
        follow_up = tokens(6, seed=11 + turn)
        history_disk = disk["out"].sequences[0].tolist() + follow_up
        history_paged = paged["out"].sequences[0].tolist() + follow_up
    assert list(tmp_path.iterdir()) == []  # every cache deleted its spill file on release


def test_beam_search_on_a_matched_prefix_equals_paged_cache() -> None:
    disk_tree, paged_tree = tree(), tree()
    document = tokens(24, seed=20)
    for rows in ([document + tokens(2, seed=21)], [document + tokens(3, seed=22)]):
        disk = serve(DiskOffloadCache(MODEL, hot_tokens=4, prefix=disk_tree), rows, num_beams=3)
        paged = serve(PagedCache(MODEL, prefix=paged_tree), rows, num_beams=3)
        assert torch.equal(disk["out"].sequences, paged["out"].sequences)
        assert disk["stats"].spilled_blocks > 0
        serve(DiskOffloadCache(MODEL, hot_tokens=4, prefix=disk_tree), rows)  # publish the document
        serve(PagedCache(MODEL, prefix=paged_tree), rows)
    assert disk["reused"] == 24 and disk["stats"].prefix_blocks == 6


def test_spill_skips_tree_blocks_and_publish_brings_private_ones_back() -> None:
    shared = tree()
    ids = torch.tensor([tokens(26, seed=30)])
    first = DiskOffloadCache(MODEL, hot_tokens=4, prefix=shared)
    MODEL(ids[:, :16], cache=first)  # blocks 0..3; nothing is cold before the next step
    assert first.publish(ids[:, :16]) == 4
    first.release()
    cache = DiskOffloadCache(MODEL, hot_tokens=4, prefix=shared)
    inputs = cache.match(ids[:, :25])  # 24 usable tokens; 16 are cached
    assert cache.get_seq_length() == 16 and inputs["input_ids"].shape == (1, 25)
    MODEL(ids[:, 16:24], cache=cache)  # step start at 16 tokens: cold columns 1, 2 are the tree's
    assert cache.stats().spills == 0
    got = MODEL(ids[:, 24:25], cache=cache).logits  # at 24 tokens: column 4 (pool id 4) spills
    expected = MODEL(ids[:, :25], cache=DynamicCache()).logits[:, 24:]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    pool, rows = shared.pool, cache.tables.rows  # type: ignore[union-attr]
    assert rows[0].block_ids == [0, 1, 2, 3, -1, 5, 6]  # token 24 took id 6: 4 went to the free list's end
    assert [pool.ref_count(b) for b in (0, 1, 2, 3, 5, 6)] == [2, 2, 2, 2, 1, 1]  # tree + row, row only
    stats = cache.stats()
    assert (stats.spilled_blocks, stats.prefix_blocks, stats.resident_blocks) == (1, 4, 6)
    assert stats.resident_bytes == 6 * BLOCK_BYTES + stats.read_buffer_bytes
    # Publishing 25 tokens offers 6 full blocks: handle 0 comes back into id 7, then the tree adopts 7 and 5.
    assert cache.publish(ids[:, :25]) == 6
    assert rows[0].block_ids == [0, 1, 2, 3, 7, 5, 6] and len(shared.tree) == 6
    assert [pool.ref_count(b) for b in (7, 5, 6)] == [2, 2, 1]
    assert cache.tier is not None and not cache.tier.is_live(0) and cache.stats().disk_bytes == 0
    MODEL(ids[:, 25:26], cache=cache)  # at 25 tokens columns 1..4 are cold, all the tree's now
    assert cache.stats().spills == 1 and cache.stats().prefix_blocks == 6
    cache.release()
    assert pool.num_used == 6 and all(pool.ref_count(b) == 1 for b in (0, 1, 2, 3, 5, 7))
    shared.clear()
    assert pool.num_used == 0


def test_tree_reclaim_never_frees_a_block_a_live_row_uses() -> None:
    shared = tree(max_blocks=12)
    document = tokens(16, seed=40)
    first = DiskOffloadCache(MODEL, hot_tokens=4, prefix=shared)
    ids_a = torch.tensor([document + tokens(8, seed=41)])
    MODEL(ids_a, cache=first)  # ids 0..5 of the 12
    first.publish(ids_a)
    first.release()  # the tree holds 0..5, unlocked
    ids_b = torch.tensor([document + tokens(10, seed=42)])
    cache = DiskOffloadCache(MODEL, hot_tokens=4, prefix=shared)
    cache.match(ids_b[:, :25])  # the document's blocks 0..3, locked by this cache
    MODEL(ids_b[:, 16:24], cache=cache)  # columns 4, 5 -> ids 6, 7
    other = PagedCache(MODEL, prefix=shared)
    MODEL(torch.tensor([tokens(20, seed=43)]), cache=other)  # 5 blocks: 8..11, and 5 evicted
    assert shared.stats().evictions == 1 and other.tables.rows[0].block_ids == [8, 9, 10, 11, 5]  # type: ignore[union-attr]
    third = PagedCache(MODEL, prefix=shared)
    with pytest.raises(PoolExhausted):  # the tree gives up 4, but never the document this cache holds
        MODEL(torch.tensor([tokens(8, seed=44)]), cache=third)
    assert shared.stats().evictions == 2 and all(b in shared.tree for b in (0, 1, 2, 3))
    pool = shared.pool
    assert [pool.ref_count(b) for b in (0, 1, 2, 3, 6, 7)] == [2, 2, 2, 2, 1, 1]
    got = MODEL(ids_b[:, 24:25], cache=cache).logits  # id 6 spills; token 24 takes the freed 4
    expected = MODEL(ids_b[:, :25], cache=DynamicCache()).logits[:, 24:]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert cache.tables.rows[0].block_ids == [0, 1, 2, 3, -1, 7, 4]  # type: ignore[union-attr]
    for finished in (cache, other, third):
        finished.release()
    assert pool.num_used == 4  # the document, cached and unlocked
    shared.clear()
    assert pool.num_used == 0


def test_publish_that_cannot_bring_blocks_back_raises_and_changes_nothing() -> None:
    shared = tree(max_blocks=8)
    ids = torch.tensor([tokens(18, seed=50)])
    cache = DiskOffloadCache(MODEL, hot_tokens=4, prefix=shared)
    MODEL(ids[:, :16], cache=cache)  # ids 0..3
    MODEL(ids[:, 16:17], cache=cache)  # columns 1, 2 spill; token 16 takes id 4
    rows = cache.tables.rows  # type: ignore[union-attr]
    assert rows[0].block_ids == [0, -1, -2, 3, 4]
    other = PagedCache(MODEL, prefix=shared)
    MODEL(torch.tensor([tokens(20, seed=51)]), cache=other)  # the last 5 free blocks
    with pytest.raises(PoolExhausted):
        cache.publish(ids[:, :17])
    assert rows[0].block_ids == [0, -1, -2, 3, 4] and len(shared.tree) == 0
    assert cache.stats().disk_bytes == 2 * BLOCK_BYTES and shared.pool.num_used == 8
    other.release()  # frees 5, 6, 7, 1, 2 in that order
    assert cache.publish(ids[:, :17]) == 4
    assert rows[0].block_ids == [0, 5, 6, 3, 4] and len(shared.tree) == 4  # handles 0, 1 came back into 5, 6
    assert all(b in shared.tree for b in (0, 5, 6, 3)) and cache.stats().disk_bytes == 0
    got = MODEL(ids[:, 17:18], cache=cache).logits  # columns 1, 2 are the tree's now: no spill
    expected = MODEL(ids, cache=DynamicCache()).logits[:, 17:]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert cache.stats().spills == 2
    cache.release()
    shared.clear()
    assert shared.pool.num_used == 0


def test_settings_that_cannot_apply_to_a_shared_pool_are_refused() -> None:
    shared = tree()
    with pytest.raises(ValueError, match=r"Disk\(max_resident_bytes=65536\) cannot cap a disk tier with prefix="):
        DiskOffloadCache(MODEL, max_resident_bytes=65536, prefix=shared)
    with pytest.raises(ValueError, match=r"block_size=16\) differs from the prefix tree's 4-token blocks"):
        DiskOffloadCache(MODEL, block_size=16, prefix=shared)
    with pytest.raises(ValueError, match=r"at most 4 blocks, but one sequence keeps .* 6 blocks of 4 tokens"):
        DiskOffloadCache(MODEL, hot_tokens=10, prefix=tree(max_blocks=4))  # 1 + ceil(10 / 4) + 2 = 6
    with pytest.raises(ValueError, match="over a QuantizedBlockPool"):
        DiskOffloadCache(MODEL, prefix=prefix_tree(MODEL, pool=Paging(block_size=4), codec="int8"))
    cache = DiskOffloadCache(MODEL, hot_tokens=4, prefix=shared, namespace="tenant")
    assert cache.pool is shared.pool and cache.parts.pool == Paging(4) and cache.parts.namespace == "tenant"


@pytest.mark.real_model
def test_smollm2_requests_sharing_a_document_equal_paged_cache(smollm2, austen_text) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer = smollm2
    document = tokenizer(austen_text[50_000:52_000])["input_ids"][:256]  # 16 blocks of 16
    # each request's own 64-token tail: with 16 hot tokens its first blocks turn cold and spill
    questions = [tokenizer(austen_text[60_000 + 5_000 * i :][:1_000])["input_ids"][:64] for i in range(2)]
    kwargs = {"max_new_tokens": 6, "do_sample": False, "output_logits": True, "return_dict_in_generate": True}
    disk_tree = PrefixCache(BlockPool(PagedCache(model).pool.geometry, block_size=16))  # type: ignore[union-attr]
    paged_tree = PrefixCache(BlockPool(disk_tree.pool.geometry, block_size=16))
    for index, question in enumerate(questions):
        ids = torch.tensor([document + question])
        runs = []
        for cache in (DiskOffloadCache(model, hot_tokens=16, prefix=disk_tree), PagedCache(model, prefix=paged_tree)):
            inputs = cache.match(ids)
            reused = cache.get_seq_length()
            with torch.inference_mode():
                out = model.generate(**inputs, cache=cache, **kwargs)
            runs.append((out, reused, cache.stats()))
            cache.publish(out.sequences)
            cache.release()
        (disk, disk_reused, stats), (paged, paged_reused, _) = runs
        assert_identical(disk, paged)
        assert disk_reused == paged_reused == (0 if index == 0 else 256)
        # 256 + 64 + 5 stored tokens, 16 hot: at the last step (324 tokens) columns 1..18 were cold; in the
        # second request the document's 16 blocks are the tree's and stay, its own columns 16, 17, 18 spill
        assert (stats.spilled_blocks, stats.prefix_blocks) == ((18, 0) if index == 0 else (3, 16))
