"""Where recalled pages are held: one buffer per layer, or one that every layer takes in turn.

Both attend the same pages, so their logits are identical; a shared buffer holds one layer's pages (the
cache's recall bytes fall by the other layers' buffers) and reads each step's pages again. The buffer itself
is checked on a real page tier: what it reads, keeps and drops.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hf_kvgov import HeavyHitterCache, Recall
from hf_kvgov.chain import Disk, HeavyHitter
from hf_kvgov.chain.build import GovernedCache
from hf_kvgov.engine.slots.recall_buffer import RecallBuffer
from hf_kvgov.planner.chain import ChainOptions
from hf_kvgov.tiers.recall_pages import PageTier
from tests.conftest import tiny_gemma3, tiny_llama
from tests.eviction.test_recall import BUDGET, PAGE, generate

PAGES = 2


def _pair(make: Any) -> tuple[Any, Any, Any, Any]:
    model = make()
    caches = [
        HeavyHitterCache(model, budget=BUDGET, recent=2, recall=Recall(pages=PAGES, page_tokens=PAGE, buffer=buffer))
        for buffer in ("layer", "shared")
    ]
    outs = [generate(model, cache, new=16) for cache in caches]
    return caches[0], caches[1], outs[0], outs[1]


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3 (sliding layers)"])
def test_a_shared_buffer_attends_the_same_pages_as_one_buffer_per_layer(make: Any) -> None:
    per_layer, shared, first, second = _pair(make)
    assert torch.equal(first.sequences, second.sequences)
    assert all(torch.equal(a, b) for a, b in zip(first.logits, second.logits, strict=True))
    a, b = per_layer.recall_stats(), shared.recall_stats()
    assert a is not None and b is not None
    assert a.pages_recalled == b.pages_recalled > 0 and a.pages_written == b.pages_written
    recalling = [layer for layer in shared.slot_layers if layer.recall.page_count is not None]
    if len(recalling) > 1:
        # One buffer per layer keeps a page chosen at consecutive steps; the shared one reads it again.
        assert a.pages_read < b.pages_read == b.pages_recalled
    else:  # one layer recalls (tiny Gemma-3's sliding layers keep their window): the shared buffer is its own
        assert a.pages_read == b.pages_read < b.pages_recalled


def test_a_shared_buffer_holds_only_one_layers_pages() -> None:
    per_layer, shared, _, _ = _pair(tiny_llama)  # 2 layers, 2 KV heads, 2 rows
    buffers = [layer.recall.buffer for layer in shared.slot_layers]
    assert buffers[0] is buffers[1]
    held = [layer.recall.buffer.held_bytes(layer.index) for layer in per_layer.slot_layers]
    assert all(h > 0 for h in held)
    page_bytes = PAGE * (2 * 16 * 4 + 8)  # K, V (fp32, head_dim 16) and an int64 position per token
    assert held[0] <= 2 * 2 * PAGES * page_bytes  # rows x heads x pages
    held_shared = [layer.recall.buffer.held_bytes(layer.index) for layer in shared.slot_layers]
    assert held_shared[0] == 0 < held_shared[1]  # the last layer served holds it
    assert shared.stats().recall_bytes == per_layer.stats().recall_bytes - held[0] - held[1] + held_shared[1]


def _tier(tmp_path: Path) -> tuple[PageTier, list[int]]:
    tier = PageTier(PAGE, 8, torch.float32, tmp_path)
    keys = torch.arange(3 * PAGE * 8, dtype=torch.float32).reshape(3, PAGE, 8)
    positions = torch.arange(3 * PAGE).reshape(3, PAGE)
    return tier, tier.write(keys, -keys, positions)


def test_the_buffer_reads_what_it_does_not_hold_and_drops_what_is_not_wanted(tmp_path: Path) -> None:
    tier, (h0, h1, h2) = _tier(tmp_path)
    buffer = RecallBuffer()
    pages, read = buffer.take(tier, 0, [h0, h1])
    assert read == 2 and sorted(pages) == sorted([h0, h1])
    assert torch.equal(pages[h1][2], torch.arange(PAGE, 2 * PAGE))
    assert torch.equal(pages[h1][1], -pages[h1][0])
    pages, read = buffer.take(tier, 0, [h1, h2])
    assert read == 1 and sorted(pages) == sorted([h1, h2])  # h1 kept, h2 read, h0 dropped
    assert buffer.held_bytes(0) == 2 * PAGE * (2 * 8 * 4 + 8) and buffer.held_bytes(1) == 0
    pages, read = buffer.take(tier, 1, [h1])  # another layer: the first layer's pages go
    assert read == 1 and buffer.held_bytes(0) == 0 < buffer.held_bytes(1)
    buffer.forget(0)  # not the layer it holds: nothing changes
    assert buffer.held_bytes(1) > 0
    buffer.forget(1)
    assert buffer.held_bytes(1) == 0 and buffer.pages == {}
    tier.close()


@pytest.mark.parametrize("buffer", ["layer", "shared"])
def test_kept_within_spreads_a_shared_buffer_over_the_recalling_layers(buffer: str) -> None:
    # 200 slot-equivalents over 1,000 tokens, 4 pages of 16, centroids (half a token per written page).
    # Per layer: 64 recalled + 16 pending = 80 fixed (91 kept, tests/policies/test_page_scores.py).
    # Shared over 4 layers: 64 / 4 + 16 = 32 fixed; 141 + 32 + ceil(ceil(859 / 16) / 2) = 27 is 200.
    recall = Recall(pages=4, page_tokens=16, buffer=buffer)
    assert recall.kept_within(200, 1000, layers=4) == (141 if buffer == "shared" else 91)
    assert recall.kept_within(200, 1000, layers=1) == 91  # one layer: its buffer is all of it either way


def test_bad_buffers_and_layer_counts_are_named() -> None:
    with pytest.raises(ValueError, match="buffer must be one of layer, shared; got 'global'"):
        Recall(buffer="global")
    with pytest.raises(ValueError, match="layers must be an int >= 1; got 0"):
        Recall().kept_within(200, 1000, layers=0)
    with pytest.raises(ValueError, match="recall_buffer must be one of layer, shared; got 'both'"):
        Disk(recall_buffer="both")
    with pytest.raises(ValueError, match="recall_buffer must be one of layer, shared; got 'x'"):
        ChainOptions(max_len=1024, recall_buffer="x")


def test_the_chain_builds_a_shared_buffer_and_says_so_in_its_parts(tmp_path: Path) -> None:
    model = tiny_llama()
    cache = GovernedCache(model, policy=HeavyHitter(BUDGET), spill=Disk(str(tmp_path), recall_buffer="shared"))
    assert cache.recall.buffer == "shared"
    assert cache.parts.spill.recall_buffer == "shared"
    again = GovernedCache(model, **cache.parts.kwargs())
    assert again.recall == cache.recall
    generate(model, cache, new=4)
    layers = cache.slot_layers
    assert layers[0].recall.buffer is layers[1].recall.buffer
