"""Stats records print rounded floats (what a person reads) and keep their exact values (what code reads)."""

from __future__ import annotations

import torch

from hf_kvgov import PagedCache
from tests.conftest import tiny_llama


def test_a_caches_stats_print_rounded_and_stay_exact() -> None:
    model = tiny_llama()
    cache = PagedCache(model, block_size=16)
    model.generate(torch.tensor([[5, 6, 7] * 7]), max_new_tokens=2, do_sample=False, cache=cache, pad_token_id=0)
    stats = cache.stats()
    assert stats.bytes_per_token == stats.bytes_used / stats.tokens  # exact: 32 slots held for 22 tokens
    assert str(stats.bytes_per_token) not in repr(stats)  # 744.7272727272727 would be the unrounded repr
    assert f"bytes_per_token={stats.bytes_per_token:.6g}" in repr(stats) and repr(stats).startswith("CacheStats(")
