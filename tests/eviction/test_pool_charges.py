"""What an eviction cache keeps beside its pooled slots is counted against the pool's cap.

The slots' positions, validity and attention mass, a running forecast's query statistics, recall's pending pages,
summaries and page tables, and the recall buffer's pages are tensors of the cache's own; with a pool they are
charged to it (`BlockPool.charge`), so ``max_bytes`` bounds every byte the cache holds. The checks compare the
pool's count with the bytes the cache's stats measure from its tensors, and cap a pool between the slots' bytes
and the slots' plus the rest.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hf_kvgov import HeavyHitterCache, PolicyCache, PoolExhausted, Recall, eviction_attention, eviction_pool
from hf_kvgov.policies.expected_attention import running_expected_attention
from tests.conftest import tiny_gemma3, tiny_llama

BLOCK = 4


def generate(model: Any, cache: Any, rows: int = 2, new: int = 12, seed: int = 3) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (rows, 40), generator=generator)
    mask = torch.ones_like(ids)
    if rows > 1:
        ids[1, :6], mask[1, :6] = 0, 0  # left padding in row 1
    with eviction_attention(model), torch.inference_mode():
        return model.generate(
            input_ids=ids, attention_mask=mask, cache=cache, max_new_tokens=new, min_new_tokens=new, do_sample=False
        )


def beside(cache: Any) -> int:
    """Bytes the cache keeps beside its slots, measured from its tensors (what its stats count)."""
    stats = cache.stats()
    return stats.metadata_bytes + stats.recall_bytes


CASES = {
    "h2o": lambda model, pool, path: HeavyHitterCache(model, budget=10, pool=pool),
    "h2o-int8": lambda model, pool, path: HeavyHitterCache(model, budget=10, codec="int8", pool=pool),
    "running-ea": lambda model, pool, path: PolicyCache(model, running_expected_attention(recent=4), 10, pool=pool),
    "recall-shared": lambda model, pool, path: HeavyHitterCache(
        model, budget=10, recall=Recall(path, pages=2, page_tokens=4), pool=pool
    ),
    "recall-layer": lambda model, pool, path: HeavyHitterCache(
        model, budget=10, recall=Recall(path, pages=2, page_tokens=4, buffer="layer"), pool=pool
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3"])
def test_the_pool_counts_what_the_cache_keeps_beside_its_slots(make: Any, case: str, tmp_path: Path) -> None:
    model = make()
    codec = "int8" if case == "h2o-int8" else None
    pool = eviction_pool(model, codec=codec, block_size=BLOCK)
    cache = CASES[case](model, pool, tmp_path)
    generate(model, cache)
    stats = cache.stats()
    assert stats.metadata_bytes > 0
    if case.startswith("recall"):
        assert stats.recall_bytes > 0 and stats.recall is not None and stats.recall.pages_recalled > 0
    if case == "running-ea":  # float64 sums of every query: far more than positions, validity and mass
        assert stats.metadata_bytes > 2 * sum(layer.positions.numel() * 13 for layer in cache.layers)
    assert pool.bytes_charged == beside(cache)
    assert pool.bytes_held() == pool.capacity * pool.bytes_per_block + beside(cache)
    cache.release()
    assert pool.bytes_charged == 0 and pool.num_used == 0


def test_beams_recharge_what_the_rows_become(tmp_path: Path) -> None:
    model = tiny_llama()
    pool = eviction_pool(model, block_size=BLOCK)
    cache = HeavyHitterCache(model, budget=10, recall=Recall(tmp_path, pages=2, page_tokens=4), pool=pool)
    ids = torch.randint(3, 96, (1, 30), generator=torch.Generator().manual_seed(4))
    with eviction_attention(model), torch.inference_mode():
        model.generate(input_ids=ids, cache=cache, max_new_tokens=6, num_beams=3, do_sample=False)
    assert cache.stats().sequences == 3
    assert pool.bytes_charged == beside(cache) > 0


def test_a_cap_that_holds_the_slots_but_not_what_is_beside_them_is_exhausted(tmp_path: Path) -> None:
    model = tiny_llama()
    make = CASES["recall-shared"]
    free_pool = eviction_pool(model, block_size=BLOCK)
    reference = make(model, free_pool, tmp_path / "free")
    expected = generate(model, reference)
    slots = free_pool.num_used * free_pool.bytes_per_block
    extra = beside(reference)
    assert extra > free_pool.bytes_per_block  # the cap below is more than the slots need
    # Enough blocks for every slot, not for the bytes beside them: before the pool counted them, this completed.
    tight = eviction_pool(model, block_size=BLOCK, max_bytes=slots + extra // 2)
    refused = make(model, tight, tmp_path / "tight")
    with pytest.raises(PoolExhausted, match="bytes of slot metadata"):
        generate(model, refused)
    assert tight.bytes_held() <= slots + extra // 2
    # The refused step's evicted pages are not left in recall's memory beyond what the pool counts.
    assert refused.stats().recall_bytes > 0 and beside(refused) == tight.bytes_charged
    refused.release()
    # With room for both, the same tokens as the uncapped cache, and the cap still holds.
    roomy = eviction_pool(model, block_size=BLOCK, max_bytes=slots + extra + 4 * free_pool.bytes_per_block)
    cache = make(model, roomy, tmp_path / "roomy")
    assert torch.equal(generate(model, cache), expected)
    assert roomy.bytes_held() <= roomy.max_bytes
    assert roomy.bytes_charged == beside(cache)
