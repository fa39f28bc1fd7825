"""QuantizedDiskCache(prefix=...): requests share sealed blocks through the prefix tree while each request's
private sealed blocks spill to disk as codes.

Outputs are QuantizedCache(prefix=)'s exactly (torch.equal: spilled codes come back bit for bit and decode as
the store decodes them); blocks the tree holds (the full-precision sink and sealed codes) never leave memory;
reference counts, sealed-store slots and disk slots stay exact through spill, publish, release and the tree
reclaiming from a capped pool.

Tiny model (2 layers, 2 KV heads, head dim 16, fp32), 4-token blocks, int8, one sink block, residual 0: after
a step of length L a row holds the sink and the tail in full precision and columns 1 .. L // 4 - 1 sealed; at
the start of a step of a cache holding L tokens with a 4-token hot window, the sealed columns below
(L - 4) // 4 that the tree does not hold spill. A spilled int8 block is 2 layers x 416 bytes = 832 (the
per-layer layout is written out in test_quant_disk.py). Full-precision ids follow the pool's free list
(fresh ids in order, freed ids at its end); sealed ids the store's (64 fresh ids first, freed ones after).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hf_kvgov import GovernedCache, QuantizedDiskCache, prefix_tree
from hf_kvgov.chain import Disk, Paging
from hf_kvgov.errors import PoolExhausted, SpillCorrupted
from hf_kvgov.hf.quantized_cache import QuantizedCache
from hf_kvgov.prefix.sharing import PrefixCache
from hf_kvgov.prefix.tree_ids import tree_id
from hf_kvgov.storage.quantized_pool import QuantizedBlockPool
from tests.conftest import tiny_llama
from tests.prefix_requests import assert_identical, tokens
from tests.prefix_requests import serve as serve_requests
from tests.spill_damage import flip_byte

MODEL = tiny_llama(num_kv_heads=2, seed=3)
BLOCK, NEW, SPILLED_BYTES = 4, 8, 832
S = -(1 << 62)  # the table entry of spilled handle 0; handle h is S - h
pytestmark = pytest.mark.usefixtures("one_thread")


def serve(cache: Any, rows: list[list[int]], **kwargs: Any) -> dict[str, Any]:
    return serve_requests(MODEL, NEW, cache, rows, **kwargs)


def tree(max_blocks: int | None = None, codec: str = "int8") -> PrefixCache:
    """A tree over the pool an int8 chain with 4-token blocks creates; `max_blocks` caps its full-precision part."""
    cap = None if max_blocks is None else max_blocks * BLOCK
    return prefix_tree(MODEL, pool=Paging(BLOCK, max_tokens=cap), codec=codec)


def store(shared: PrefixCache) -> QuantizedBlockPool:
    assert isinstance(shared.pool, QuantizedBlockPool)
    return shared.pool


def assert_tree_holds_resident(shared: PrefixCache, blocks: list[int]) -> None:
    """Every block is the tree's and in memory: the sink (id >= 0) or sealed codes (S < id < 0)."""
    assert all(b > S and tree_id(b) in shared.tree for b in blocks), blocks


def assert_empty_after_clear(*trees: PrefixCache) -> None:
    for shared in trees:
        shared.clear()
        assert (store(shared).num_used, store(shared).sealed.num_used) == (0, 0)  # nothing leaked


# ---------------------------------------------------------------- the same output as QuantizedCache(prefix=)


@pytest.mark.parametrize(("attention", "residual"), [("contiguous", 0), ("paged", 0), ("contiguous", 4)])
def test_shared_document_equals_quantized_cache_while_private_blocks_spill(attention: str, residual: int) -> None:
    document = tokens(32, seed=1)  # 8 blocks
    requests = [
        [document + tokens(3, seed=2)],
        [document + tokens(5, seed=3)],
        [document + tokens(4, seed=4), tokens(11, seed=5), document[:18] + tokens(6, seed=6)],  # hit, miss, part
    ]
    disk_tree, quant_tree = tree(), tree()
    options: dict[str, Any] = {"attention": attention, "residual": residual}
    for index, rows in enumerate(requests):
        disk = serve(QuantizedDiskCache(MODEL, hot_tokens=4, prefix=disk_tree, **options), rows)
        quant = serve(QuantizedCache(MODEL, prefix=quant_tree, **options), rows)
        assert_identical(disk["out"], quant["out"])
        assert disk["reused"] == quant["reused"] == (0 if index == 0 else 32)
        assert disk["stats"].spilled_blocks > 0
        if index:  # the document's sink and 7 sealed blocks, matched from the tree, stayed in memory
            assert_tree_holds_resident(disk_tree, disk["held"][0][:8])
    assert disk["held"][2][:4] == disk["held"][0][:4]  # the row that hit 16 tokens shares their 4 blocks
    assert disk_tree.stats().cached_blocks == quant_tree.stats().cached_blocks
    assert_empty_after_clear(disk_tree, quant_tree)


def test_multi_turn_reuses_every_turn_including_spilled_history(tmp_path: Path) -> None:
    disk_tree, quant_tree = tree(), tree()
    history_disk = history_quant = tokens(20, seed=10)
    for turn in range(3):
        disk = serve(QuantizedDiskCache(MODEL, tmp_path, hot_tokens=4, prefix=disk_tree), [history_disk])
        quant = serve(QuantizedCache(MODEL, prefix=quant_tree), [history_quant])
        assert_identical(disk["out"], quant["out"])
        # publish brought the spilled history back, so the next turn reuses all of it: turn 0 stored 20 + 7
        # tokens (6 full blocks), turn 1 stored 34 + 7 (10 full blocks)
        assert disk["reused"] == quant["reused"] == [0, 24, 40][turn]
        assert disk["stats"].spilled_blocks > 0
        if turn:
            assert_tree_holds_resident(disk_tree, disk["held"][0][: disk["reused"] // BLOCK])
        follow_up = tokens(6, seed=11 + turn)
        history_disk = disk["out"].sequences[0].tolist() + follow_up
        history_quant = quant["out"].sequences[0].tolist() + follow_up
    assert list(tmp_path.iterdir()) == []  # every cache deleted its spill file on release
    assert_empty_after_clear(disk_tree, quant_tree)


def test_beam_search_on_a_matched_prefix_equals_quantized_cache() -> None:
    disk_tree, quant_tree = tree(), tree()
    document = tokens(24, seed=20)
    serve(QuantizedDiskCache(MODEL, hot_tokens=4, prefix=disk_tree), [document + tokens(2, seed=21)])
    serve(QuantizedCache(MODEL, prefix=quant_tree), [document + tokens(2, seed=21)])
    rows = [document + tokens(3, seed=22)]
    disk = serve(QuantizedDiskCache(MODEL, hot_tokens=4, prefix=disk_tree), rows, num_beams=3)
    quant = serve(QuantizedCache(MODEL, prefix=quant_tree), rows, num_beams=3)
    assert_identical(disk["out"], quant["out"])
    assert disk["reused"] == 24 and disk["stats"].spilled_blocks > 0
    for beam in disk["held"]:  # every beam reads the document's 6 blocks from memory, shared with the tree
        assert beam[:6] == disk["held"][0][:6]
        assert_tree_holds_resident(disk_tree, beam[:6])
    assert_empty_after_clear(disk_tree, quant_tree)


# ---------------------------------------------------------------- bookkeeping, with exact ids


def forwards(cache: QuantizedCache, ids: torch.Tensor, bounds: list[tuple[int, int]]) -> list[torch.Tensor]:
    """The logits of feeding ids[:, start:stop] for each (start, stop), in order."""
    with torch.no_grad():
        return [MODEL(ids[:, start:stop], cache=cache).logits for start, stop in bounds]


def computed_by_quantized_cache(ids: torch.Tensor, bounds: list[tuple[int, int]]) -> list[torch.Tensor]:
    """The reference: QuantizedCache(prefix=) on its own tree computes and publishes ids[:, :16], matches
    ids[:, :25] (16 tokens cached), then feeds ids[:, start:stop] for each of `bounds`."""
    published = ids[:, :16]
    shared = tree()
    first = QuantizedCache(MODEL, prefix=shared)
    forwards(first, published, [(0, published.shape[1])])
    first.publish(published)
    first.release()
    cache = QuantizedCache(MODEL, prefix=shared)
    cache.match(ids[:, :25])
    logits = forwards(cache, ids, bounds)
    cache.release()
    assert_empty_after_clear(shared)
    return logits


def published_document(shared: PrefixCache, ids: torch.Tensor) -> None:
    """A first request computes `ids` (16 tokens: sink 0, sealed -1 -2 -3) and publishes them; 4 blocks."""
    first = QuantizedDiskCache(MODEL, hot_tokens=4, prefix=shared)
    forwards(first, ids, [(0, 16)])
    assert first.publish(ids) == 4
    first.release()


def test_spill_skips_tree_blocks_and_publish_brings_private_ones_back() -> None:
    shared = tree()
    pool = store(shared)
    ids = torch.tensor([tokens(26, seed=30)])
    published_document(shared, ids[:, :16])
    cache = QuantizedDiskCache(MODEL, hot_tokens=4, prefix=shared)
    inputs = cache.match(ids[:, :25])  # 24 usable tokens; 16 are cached
    assert cache.get_seq_length() == 16 and inputs["input_ids"].shape == (1, 25)
    rows = cache.tables.rows  # type: ignore[union-attr]
    # Step at 16 tokens: cold columns 1, 2 are the tree's; tokens 16..23 take full-precision ids 4, 5, sealed
    # into sealed ids 3, 4 (entries -4, -5) at the end of the step.
    got = forwards(cache, ids, [(16, 24)])
    assert rows[0].block_ids == [0, -1, -2, -3, -4, -5] and cache.stats().spills == 0
    # Step at 24 tokens: (24 - 4) // 4 = 5, cold columns 1..4: only column 4 (-4) is private, and spills.
    got += forwards(cache, ids, [(24, 25)])
    assert rows[0].block_ids == [0, -1, -2, -3, S, -5, 6]  # token 24 took id 6 (4, 5 went to the list's end)
    assert [pool.ref_count(b) for b in (0, -1, -2, -3, -5, 6)] == [2, 2, 2, 2, 1, 1]  # tree + row, row only
    assert (pool.num_used, pool.sealed.num_used) == (2, 4)  # ids 0, 6; sealed 0, 1, 2 and 4 (3 was spilled)
    stats = cache.stats()
    assert (stats.spilled_blocks, stats.sealed_blocks, stats.full_precision_blocks) == (1, 4, 2)
    assert stats.prefix_blocks == 4  # the sink and sealed -1, -2, -3 matched from the tree
    assert stats.disk_bytes == stats.bytes_written == SPILLED_BYTES
    # Publishing 25 tokens offers 6 full blocks: handle 0 comes back into sealed id 5 (entry -6), then the
    # tree adopts -6 and -5.
    assert cache.publish(ids[:, :25]) == 6
    assert rows[0].block_ids == [0, -1, -2, -3, -6, -5, 6] and len(shared.tree) == 6
    assert [pool.ref_count(b) for b in rows[0].block_ids] == [2, 2, 2, 2, 2, 2, 1]
    assert cache.tier is not None and not cache.tier.is_live(0) and cache.stats().disk_bytes == 0
    assert pool.sealed.num_used == 5 and cache.stats().prefix_blocks == 6  # -6 and -5 published
    got += forwards(cache, ids, [(25, 26)])  # at 25 tokens columns 1..4 are cold, all the tree's now
    assert cache.stats().spills == 1 and rows[0].block_ids[:6] == [0, -1, -2, -3, -6, -5]
    expected = computed_by_quantized_cache(ids, [(16, 24), (24, 25), (25, 26)])
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
    cache.release()
    assert (pool.num_used, pool.sealed.num_used) == (1, 5)  # the tree's: sink 0, sealed 0, 1, 2, 4, 5
    assert all(pool.ref_count(b) == 1 for b in (0, -1, -2, -3, -5, -6))
    assert_empty_after_clear(shared)


def test_tree_reclaim_never_frees_a_block_a_live_row_uses() -> None:
    shared = tree(max_blocks=6)  # full-precision blocks: sinks and tails
    pool = store(shared)
    document, other_document = tokens(16, seed=40), tokens(12, seed=41)
    published_document(shared, torch.tensor([document]))  # A: 0, -1, -2, -3; full-precision ids 4, 5, 1, 2, 3 free
    b = QuantizedDiskCache(MODEL, hot_tokens=4, prefix=shared)
    forwards(b, torch.tensor([other_document]), [(0, 12)])  # ids 4, 5, 1: 5, 1 sealed into -4, -5
    b.publish(torch.tensor([other_document]))
    b.release()  # B: 4, -4, -5, unlocked; free: 2, 3, 5, 1
    ids = torch.tensor([document + tokens(10, seed=42)])
    cache = QuantizedDiskCache(MODEL, hot_tokens=4, prefix=shared)
    cache.match(ids[:, :25])  # A's 4 blocks, locked by this cache
    got = forwards(cache, ids, [(16, 24), (24, 25)])  # 2, 3 sealed into -6, -7; -6 spills; token 24 takes 5
    rows = cache.tables.rows  # type: ignore[union-attr]
    assert rows[0].block_ids == [0, -1, -2, -3, S, -7, 5] and pool.num_used == 3  # 0 (A), 4 (B), 5
    # Another request needs 4 full-precision blocks, 3 are free: the tree evicts B's path, its sealed leaves
    # first, then its sink 4; A, locked, stays.
    other = QuantizedCache(MODEL, prefix=shared)
    forwards(other, torch.tensor([tokens(16, seed=43)]), [(0, 16)])
    assert shared.stats().evictions == 3 and len(shared.tree) == 4
    # It took 1, 2, 3 and the freed 4, then sealed columns 1..3: it keeps 1, and 0 (A) and 5 are in use.
    assert other.tables.rows[0].block_ids[0] == 1 and pool.num_used == 3  # type: ignore[union-attr]
    third = QuantizedCache(MODEL, prefix=shared)
    with pytest.raises(PoolExhausted):  # 3 free, and nothing the tree may give up: A is locked
        forwards(third, torch.tensor([tokens(16, seed=44)]), [(0, 16)])
    assert shared.stats().evictions == 3
    assert_tree_holds_resident(shared, [0, -1, -2, -3])
    assert rows[0].block_ids == [0, -1, -2, -3, S, -7, 5]
    assert [pool.ref_count(b) for b in (0, -1, -2, -3, -7, 5)] == [2, 2, 2, 2, 1, 1]
    assert cache.tier is not None and cache.tier.is_live(0)
    got += forwards(cache, ids, [(25, 26)])  # the live row reads everything it held, spilled block included
    expected = computed_by_quantized_cache(ids, [(16, 24), (24, 25), (25, 26)])
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
    for finished in (cache, other, third):
        finished.release()
    assert (pool.num_used, pool.sealed.num_used) == (1, 3)  # A, cached and unlocked
    assert_empty_after_clear(shared)


def warm_cache_with_a_spilled_block(
    shared: PrefixCache, ids: torch.Tensor, path: Path, prefetch: bool = True
) -> QuantizedDiskCache:
    """The state of the test above after token 24: row [0, -1, -2, -3, S, -5, 6], handle 0 = tokens 16..19."""
    published_document(shared, ids[:, :16])
    cache = QuantizedDiskCache(MODEL, path, hot_tokens=4, prefix=shared, prefetch=prefetch)
    cache.match(ids[:, :25])
    forwards(cache, ids, [(16, 24), (24, 25)])
    assert cache.tables is not None and cache.tables.rows[0].block_ids == [0, -1, -2, -3, S, -5, 6]
    return cache


def damage(cache: QuantizedDiskCache, handle: int, layer: int) -> None:
    assert cache.tier is not None
    spill_path, offset = cache.tier.location(handle, layer)
    flip_byte(spill_path, offset + 100)  # the first part is key codes: 128 bytes per block


def test_publish_that_cannot_bring_blocks_back_raises_and_changes_nothing(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    shared = tree()
    pool = store(shared)
    ids = torch.tensor([tokens(26, seed=50)])
    cache = warm_cache_with_a_spilled_block(shared, ids, tmp_path)
    rows, tier = cache.tables.rows, cache.tier  # type: ignore[union-attr]
    assert tier is not None

    def unchanged() -> None:
        assert rows[0].block_ids == [0, -1, -2, -3, S, -5, 6] and len(shared.tree) == 4
        assert [pool.ref_count(b) for b in (0, -1, -2, -3, -5, 6)] == [2, 2, 2, 2, 1, 1]
        assert (pool.num_used, pool.sealed.num_used) == (2, 4) and tier.is_live(0)
        assert cache.stats().disk_bytes == SPILLED_BYTES

    def store_full(n: int) -> list[int]:
        raise MemoryError("the sealed store cannot grow")

    with monkeypatch.context() as patch:
        patch.setattr(pool.sealed, "allocate", store_full)
        with pytest.raises(MemoryError, match="cannot grow"):
            cache.publish(ids[:, :25])
    unchanged()
    damage(cache, handle=0, layer=1)  # layer 0 reads back fine, layer 1 fails: the fresh slot is given back
    with pytest.raises(SpillCorrupted, match=r"block 0 \(tokens \[16, 20\)\), layer 1"):
        cache.publish(ids[:, :25])
    unchanged()
    cache.release()
    assert list(tmp_path.iterdir()) == []
    assert_empty_after_clear(shared)


@pytest.mark.parametrize("prefetch", [True, False])
def test_a_damaged_spill_file_raises_spill_corrupted(tmp_path: Path, prefetch: bool) -> None:
    shared = tree()
    ids = torch.tensor([tokens(26, seed=60)])
    cache = warm_cache_with_a_spilled_block(shared, ids, tmp_path, prefetch)
    # Layer 1: with read-ahead, layer 0 of the next step was read when the last step ended, before the damage.
    damage(cache, handle=0, layer=1)
    with pytest.raises(SpillCorrupted, match=r"block 0 \(tokens \[16, 20\)\), layer 1") as info:
        forwards(cache, ids, [(25, 26)])
    assert (info.value.block, info.value.layer, info.value.tokens) == (0, 1, (16, 20))
    cache.release()
    assert_empty_after_clear(shared)


# ---------------------------------------------------------------- refusals and the chain


def test_settings_that_cannot_apply_to_a_shared_pool_are_refused() -> None:
    shared = tree()
    with pytest.raises(ValueError, match=r"Disk\(max_resident_bytes=65536\) cannot cap a disk tier with prefix="):
        QuantizedDiskCache(MODEL, max_resident_bytes=65536, prefix=shared)
    with pytest.raises(ValueError, match=r"block_size=16\) differs from the prefix tree's 4-token blocks"):
        QuantizedDiskCache(MODEL, block_size=16, prefix=shared)
    # The cap counts full-precision blocks: 1 sink + ceil(8 / 4) residual + tail + one step = 5 > 4.
    with pytest.raises(ValueError, match=r"at most 4 blocks, but one sequence keeps .* 5 blocks of 4 tokens"):
        QuantizedDiskCache(MODEL, residual=8, prefix=tree(max_blocks=4))
    QuantizedDiskCache(MODEL, hot_tokens=64, prefix=tree(max_blocks=3)).release()  # the hot window is sealed
    plain = prefix_tree(MODEL, pool=Paging(BLOCK))
    with pytest.raises(TypeError, match=r"tree over a BlockPool.*prefix_tree\(model, codec='int8'\)"):
        QuantizedDiskCache(MODEL, prefix=plain)
    with pytest.raises(ValueError, match="configured alike"):
        QuantizedDiskCache(MODEL, bits=4, prefix=shared)
    cache = QuantizedDiskCache(MODEL, hot_tokens=4, prefix=shared, namespace="tenant")
    assert cache.pool is shared.pool and cache.parts.pool == Paging(BLOCK) and cache.parts.namespace == "tenant"
    cache.release()


def test_the_chain_builds_it_and_it_shares_blocks_with_quantized_cache() -> None:
    shared = tree()
    cache = GovernedCache(MODEL, prefix=shared, codec="int8", spill=Disk(hot_tokens=4))
    assert isinstance(cache, QuantizedDiskCache) and cache.pool is shared.pool
    assert cache.parts.pool == Paging(BLOCK) and cache.disk.hot_tokens == 4  # the tree's block size
    again = GovernedCache(MODEL, **cache.parts.kwargs())
    assert type(again) is QuantizedDiskCache and again.parts == cache.parts
    again.release()
    document = tokens(20, seed=70)
    served = serve(cache, [document])  # published under QuantizedCache's namespace for this configuration
    assert served["reused"] == 0 and served["stats"].spilled_blocks > 0
    quant = serve(QuantizedCache(MODEL, prefix=shared), [document + tokens(3, seed=71)])
    assert quant["reused"] == 20
    assert_empty_after_clear(shared)


@pytest.mark.real_model
def test_smollm2_int8_requests_sharing_a_document_equal_quantized_cache(smollm2, austen_text) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer = smollm2
    document = tokenizer(austen_text[50_000:52_000])["input_ids"][:128]  # 8 blocks of 16
    # each request's own 48 tokens: with 16 hot tokens its first sealed blocks turn cold and spill
    questions = [tokenizer(austen_text[60_000 + 5_000 * i :][:1_000])["input_ids"][:48] for i in range(2)]
    kwargs = {"max_new_tokens": 4, "do_sample": False, "output_logits": True, "return_dict_in_generate": True}
    disk_tree, quant_tree = (prefix_tree(model, codec="int8") for _ in range(2))
    for index, question in enumerate(questions):
        ids = torch.tensor([document + question])
        runs = []
        for cache in (
            QuantizedDiskCache(model, hot_tokens=16, prefix=disk_tree),
            QuantizedCache(model, prefix=quant_tree),
        ):
            inputs = cache.match(ids)
            reused = cache.get_seq_length()
            with torch.no_grad():
                out = model.generate(**inputs, cache=cache, **kwargs)
            runs.append((out, reused, cache.stats(), [list(row.block_ids) for row in cache.tables.rows]))  # type: ignore[union-attr]
            cache.publish(out.sequences)
            cache.release()
        (disk, disk_reused, stats, held), (quant, quant_reused, _, _) = runs
        assert_identical(disk, quant)
        assert disk_reused == quant_reused == (0 if index == 0 else 128)
        # 128 + 48 + 3 stored tokens; the last step started at 178: (178 - 16) // 16 = 10, columns 1..9 cold.
        # In the second request the document's 8 blocks are the tree's and stay; its own columns 8, 9 spill.
        assert stats.spilled_blocks == (9 if index == 0 else 2)
        if index:
            assert_tree_holds_resident(disk_tree, held[0][:8])
