"""Prefix sharing -> paged blocks -> int8 as one governed cache, with the tree `prefix_tree` lays out."""

from __future__ import annotations

import pytest
import torch

from hf_kvgov import GovernedCache, PagedCache, QuantizedCache, prefix_tree
from hf_kvgov.chain import Paging
from hf_kvgov.storage.quantized_pool import QuantizedBlockPool
from tests.conftest import tiny_llama

MODEL = tiny_llama()
DOCUMENT = torch.arange(10, 42)[None]  # 32 tokens: 8 blocks of 4


def ask(cache: PagedCache, question: list[int]) -> torch.Tensor:
    ids = torch.cat([DOCUMENT, torch.tensor([question])], dim=1)
    inputs = cache.match(ids)
    with torch.no_grad():
        out = MODEL.generate(**inputs, cache=cache, max_new_tokens=4, do_sample=False)
    cache.publish(out)
    return out


def test_quantized_chain_with_a_prefix_tree_shares_the_document() -> None:
    tree = prefix_tree(MODEL, pool=Paging(block_size=4), codec="int8")
    assert isinstance(tree.pool, QuantizedBlockPool)
    first = GovernedCache(MODEL, pool=Paging(block_size=4), prefix=tree, codec="int8")
    assert isinstance(first, QuantizedCache)
    assert first.parts.describe() == "paged (4-token blocks) -> prefix sharing -> int8"
    ask(first, [50, 51, 52])
    first.release()
    second = GovernedCache(MODEL, pool=Paging(block_size=4), prefix=tree, codec="int8")
    ask(second, [60, 61])
    # The second request found the whole 32-token document cached: 8 full blocks of 4 tokens.
    assert tree.stats().hit_tokens >= 32


def test_a_tree_laid_out_for_another_codec_is_refused() -> None:
    tree = prefix_tree(MODEL, pool=Paging(block_size=4), codec="int8")
    with pytest.raises(ValueError, match="share a pool only between caches configured alike"):
        GovernedCache(MODEL, pool=Paging(block_size=4), prefix=tree, codec="int4")
    with pytest.raises(ValueError, match="prefix_tree needs the model itself"):
        prefix_tree(MODEL.config, codec="int8")
