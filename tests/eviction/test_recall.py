"""Recall: evicted tokens written once to disk pages, the pages a query bounds highest attended again.

The exact check: with every page recalled, attention reads every token a sequence ever had (kept slots,
pending page, recalled pages), so the logits equal the full cache's on the tiny models, batch with left
padding, sliding layers and beams included. The rest: bytes written by hand, the read cap, the buffer,
the disk faults, the chain and registry forms, the planner's bytes against the cache's.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import DynamicCache

from hf_kvgov import HeavyHitterCache, PolicyCache, Recall, eviction_attention
from hf_kvgov.chain import ChainRefused, Disk, HeavyHitter, Sink
from hf_kvgov.chain.build import GovernedCache
from hf_kvgov.engine.slots.recall import LayerRecall, RecallCounters
from hf_kvgov.engine.slots.recall_buffer import RecallBuffer
from hf_kvgov.errors import SpillCorrupted, SpillFileLost, SpillSpaceExhausted
from hf_kvgov.planner.accounting import recall_bytes
from hf_kvgov.planner.setup import CacheSetup
from hf_kvgov.policies import H2O, SnapKV
from hf_kvgov.registry import get_cache_spec
from tests.conftest import tiny_gemma3, tiny_llama
from tests.spill_damage import flip_byte

PROMPT, NEW, BUDGET, PAGE = 40, 12, 8, 4
EVERY_PAGE = Recall(pages=1000, page_tokens=PAGE)  # more pages than any sequence writes: nothing is left out


def batch(model: Any, rows: int = 2, length: int = PROMPT) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(3, model.config.vocab_size, (rows, length), generator=generator)
    mask = torch.ones_like(ids)
    if rows > 1:
        ids[1, :5], mask[1, :5] = 0, 0  # left padding in row 1
    return ids, mask


def generate(model: Any, cache: Any, rows: int = 2, new: int = NEW, **kwargs: Any) -> Any:
    ids, mask = batch(model, rows)
    context = eviction_attention(model) if not isinstance(cache, DynamicCache) else torch.inference_mode()
    with context, torch.inference_mode():
        return model.generate(
            input_ids=ids, attention_mask=mask, cache=cache, max_new_tokens=new, min_new_tokens=new,
            do_sample=False, output_logits=True, return_dict_in_generate=True, **kwargs,
        )  # fmt: skip


def largest_logit_gap(first: Any, second: Any) -> float:
    return max(float((a - b).abs().max()) for a, b in zip(first.logits, second.logits, strict=True))


# ------------------------------------------------------------------ exact against the full cache


@pytest.mark.parametrize(("summary", "neighbours"), [("bounds", 0), ("centroid", 0), ("centroid", 1)])
@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3 (sliding layers)"])
def test_recalling_every_page_equals_the_full_cache(make: Any, summary: str, neighbours: int) -> None:
    model = make()
    full = generate(model, DynamicCache(config=model.config))
    every_page = Recall(pages=EVERY_PAGE.pages, page_tokens=PAGE, summary=summary, neighbours=neighbours)
    cache = HeavyHitterCache(model, budget=BUDGET, recent=2, recall=every_page)
    recalled = generate(model, cache)
    alone = generate(model, HeavyHitterCache(model, budget=BUDGET, recent=2))
    assert torch.equal(recalled.sequences, full.sequences)
    assert largest_logit_gap(recalled, full) < 1e-5
    assert largest_logit_gap(alone, full) > 1e-2  # the budget truly evicts: without recall the logits move
    stats = cache.recall_stats()
    assert stats is not None and stats.pages_written > 0 and stats.pages_read > 0


def recalled_pages(neighbours: int, tmp_path: Path) -> list[int]:
    """Six pages of four evicted tokens in one (row, KV head), page p's keys all ``scale[p]`` along channel 0; the
    pages recalled (by their first position / 4) for a query along channel 0, three pages attended."""
    scale = [0.1, 0.2, 5.0, 0.3, 0.2, 4.0]
    recall = Recall(path=str(tmp_path), pages=3, page_tokens=4, neighbours=neighbours)
    layer = LayerRecall(recall.tier(4, torch.float32), 0, recall, RecallCounters(), RecallBuffer())
    keys = torch.zeros(1, 1, 24, 4)
    keys[0, 0, :, 0] = torch.tensor(scale).repeat_interleave(4)
    positions = torch.arange(24).reshape(1, 1, 24)
    layer.spill(keys, torch.randn(1, 1, 24, 4), positions, torch.ones(1, 1, 24, dtype=torch.bool))
    query = torch.tensor([1.0, 0.0, 0.0, 0.0]).reshape(1, 1, 1, 4)
    slots = layer.recalled(query, torch.tensor([24]), None)
    assert slots is not None
    chosen = slots.positions[0, 0][slots.valid[0, 0]]  # the pending page is empty: all 24 were written
    pages = sorted({int(p) // 4 for p in chosen})
    layer.tier.close()
    return pages


def test_neighbours_bring_back_the_pages_beside_the_best_one(tmp_path: Path) -> None:
    assert recalled_pages(0, tmp_path / "alone") == [2, 3, 5]  # the three best scores
    assert recalled_pages(1, tmp_path / "spans") == [1, 2, 3]  # the best page and both its neighbours


def test_a_query_aware_policy_with_recall_equals_the_full_cache() -> None:
    model = tiny_llama()
    full = generate(model, DynamicCache(config=model.config))
    cache = PolicyCache(model, SnapKV(window=4), budget=BUDGET, decode_policy=H2O(heavy=4, recent=2), recall=EVERY_PAGE)
    assert largest_logit_gap(generate(model, cache), full) < 1e-5


def test_beams_share_pages_and_equal_the_full_cache() -> None:
    model = tiny_llama()
    full = generate(model, DynamicCache(config=model.config), rows=1, num_beams=3)
    cache = HeavyHitterCache(model, budget=BUDGET, recent=2, recall=EVERY_PAGE)
    beams = generate(model, cache, rows=1, num_beams=3)
    assert torch.equal(beams.sequences, full.sequences)
    # Pages are never copied for a beam: every handle in a table is live, and the tier holds each page once.
    tables = [layer.recall for layer in cache.layers]
    held = {int(h) for table in tables for h in table.handles.flatten().tolist() if h >= 0}
    tier = cache.page_tier.tier
    assert all(tier.is_live(h) for h in held)
    assert tier.stats().slots_in_use == len(held)
    cache.reset()
    assert tier.stats().slots_in_use == 0  # a reset gives every page back


def test_int8_slots_with_recall_come_closer_to_the_full_cache_than_without() -> None:
    model = tiny_llama()
    full = generate(model, DynamicCache(config=model.config))
    with_recall = generate(model, HeavyHitterCache(model, budget=BUDGET, codec="int8", recall=EVERY_PAGE))
    without = generate(model, HeavyHitterCache(model, budget=BUDGET, codec="int8"))
    assert largest_logit_gap(with_recall, full) < largest_logit_gap(without, full) / 5


# ------------------------------------------------------------------ what is written and read


def test_each_evicted_token_is_written_once_in_full_pages() -> None:
    model = tiny_llama()  # 2 layers, 2 KV heads of dim 16, float32
    cache = HeavyHitterCache(model, budget=BUDGET, recall=EVERY_PAGE)
    generate(model, cache, rows=1)
    seen = PROMPT + NEW - 1  # the last token generated is never fed back
    written_per_head = (seen - BUDGET) // PAGE * PAGE  # the rest waits in the pending page
    layers, heads, head_dim = 2, 2, 16
    stats = cache.recall_stats()
    assert stats is not None
    assert stats.tokens_spilled == layers * heads * written_per_head
    assert stats.bytes_written == stats.tokens_spilled * (2 * head_dim * 4 + 8)  # K, V (fp32), position
    assert stats.write_amplification == 1.0
    assert stats.pages_written == stats.tokens_spilled // PAGE


def test_reads_per_step_are_capped_and_recalled_pages_stay_buffered() -> None:
    model = tiny_llama()
    pages = 2
    cache = HeavyHitterCache(model, budget=BUDGET, recall=Recall(pages=pages, page_tokens=PAGE, buffer="layer"))
    generate(model, cache, new=20)
    stats = cache.recall_stats()
    assert stats is not None
    rows, heads = 2, 2
    assert 0 < stats.max_pages_read_per_step <= pages * rows * heads
    # A page chosen at consecutive steps is read once: fewer reads than pages attended.
    assert stats.pages_read < stats.pages_recalled
    assert stats.resident_bytes == cache.stats().recall_bytes > 0


def test_no_recalled_pages_reads_nothing_but_still_writes() -> None:
    model = tiny_llama()
    cache = HeavyHitterCache(model, budget=BUDGET, recall=Recall(pages=0, page_tokens=PAGE))
    generate(model, cache)
    stats = cache.recall_stats()
    assert stats is not None and stats.pages_written > 0 and stats.pages_read == 0 == stats.bytes_read


def test_compress_once_spills_only_the_prompt() -> None:
    model = tiny_llama()
    cache = HeavyHitterCache(model, budget=BUDGET, recall=EVERY_PAGE, compress="prefill")
    generate(model, cache, rows=1)
    stats = cache.recall_stats()
    assert stats is not None
    assert stats.tokens_spilled == 2 * 2 * (PROMPT - BUDGET) // PAGE * PAGE  # layers x heads x the prompt's pages


def test_a_sliding_layer_spills_nothing_when_its_window_fits_the_budget() -> None:
    model = tiny_gemma3(window=8)  # sliding, full, sliding: budget 8 >= window - 1 in the sliding layers
    cache = HeavyHitterCache(model, budget=BUDGET, recall=EVERY_PAGE)
    generate(model, cache, rows=1)
    sliding, full = cache.layers[0].recall, cache.layers[1].recall
    assert sliding.pending_count is None and sliding.nbytes == 0  # what leaves a window is never written
    assert full.pending_count is not None and int(full.page_count.sum()) > 0


# ------------------------------------------------------------------ faults


def prefilled(model: Any, recall: Recall) -> tuple[Any, torch.Tensor]:
    """A cache after the prompt of one row (pages written, none read yet), and the next token."""
    cache = HeavyHitterCache(model, budget=BUDGET, recall=recall)
    ids, _ = batch(model, rows=1)
    with eviction_attention(model), torch.inference_mode():
        logits = model(ids, cache=cache).logits
    return cache, logits[:, -1:].argmax(-1)


def decode(model: Any, cache: Any, token: torch.Tensor) -> None:
    with eviction_attention(model), torch.inference_mode():
        model(token, cache=cache)


def test_a_damaged_page_raises_before_attention_reads_it(tmp_path: Path) -> None:
    model = tiny_llama()
    cache, token = prefilled(model, Recall(path=str(tmp_path), pages=1000, page_tokens=PAGE))
    stats = cache.recall_stats()
    assert stats is not None and stats.path is not None
    first_page = int(cache.layers[0].recall.handles[0, 0, 0])
    _, offset = cache.page_tier.tier.location(first_page, 0)
    flip_byte(stats.path, offset + 3)
    with pytest.raises(SpillCorrupted, match=r"layer 0 .*corrupted|layer 0, is corrupted") as damaged:
        decode(model, cache, token)
    assert damaged.value.layer == 0 and damaged.value.tokens is not None


def test_a_removed_spill_directory_is_reported(tmp_path: Path) -> None:
    model = tiny_llama()
    directory = tmp_path / "spill"
    cache, token = prefilled(model, Recall(path=str(directory), pages=1000, page_tokens=PAGE))
    shutil.rmtree(directory)
    with pytest.raises(SpillFileLost):
        decode(model, cache, token)


def test_a_spent_write_budget_raises_a_full_disk_error() -> None:
    model = tiny_llama()
    page_bytes = PAGE * (2 * 16 * 4 + 8)
    with pytest.raises(SpillSpaceExhausted, match="write budget"):
        prefilled(model, Recall(pages=4, page_tokens=PAGE, max_write_bytes=3 * page_bytes))


def test_an_unwritable_path_is_refused_when_the_cache_is_built(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")  # nothing can be created below a file, whoever runs the test
    with pytest.raises(ValueError, match=r"spill path .*a-file/kv.* cannot be written"):
        HeavyHitterCache(tiny_llama(), budget=BUDGET, recall=Recall(path=str(blocker / "kv")))


def test_a_path_that_is_a_file_is_refused(tmp_path: Path) -> None:
    file = tmp_path / "file"
    file.write_text("x")
    with pytest.raises(ValueError, match="must be a directory"):
        Recall(path=str(file))


def test_release_deletes_the_spill_file() -> None:
    model = tiny_llama()
    cache, _ = prefilled(model, EVERY_PAGE)
    stats = cache.recall_stats()
    assert stats is not None and stats.path is not None and Path(stats.path).exists()
    cache.release()
    assert not Path(stats.path).exists()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"pages": -1}, "pages must be an int >= 0"), ({"page_tokens": 0}, "page_tokens must be an int >= 1"),
     ({"max_write_bytes": 0}, "max_write_bytes must be a positive int")],
)  # fmt: skip
def test_bad_recall_settings_are_named(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Recall(**kwargs)


# ------------------------------------------------------------------ the chain, the registry, the planner


def test_the_chain_builds_h2o_with_recall_and_its_preset_is_the_same_cache(tmp_path: Path) -> None:
    model = tiny_llama()
    composed = GovernedCache(model, policy=HeavyHitter(BUDGET, recent=2), codec="int8", spill=Disk(path=str(tmp_path)))
    preset = HeavyHitterCache(model, budget=BUDGET, recent=2, codec="int8", recall=Recall(path=str(tmp_path)))
    assert isinstance(composed, HeavyHitterCache) and composed.recall == preset.recall
    assert composed.parts == preset.parts
    assert torch.equal(generate(model, composed).sequences, generate(model, preset).sequences)
    assert "spill" in preset.parts.present


def test_a_centroid_summary_survives_the_round_trip_between_preset_and_chain(tmp_path: Path) -> None:
    model = tiny_llama()
    recall = Recall(path=str(tmp_path), pages=3, summary="centroid")
    preset = HeavyHitterCache(model, budget=BUDGET, recent=2, recall=recall)
    spill = Disk(path=str(tmp_path), recall_pages=3, recall_summary="centroid")
    composed = GovernedCache(model, policy=HeavyHitter(BUDGET, recent=2), spill=spill)
    assert isinstance(composed, HeavyHitterCache) and composed.recall == preset.recall == recall
    assert composed.parts == preset.parts and preset.parts.spill is not None
    assert preset.parts.spill.recall() == recall
    assert torch.equal(generate(model, composed).sequences, generate(model, preset).sequences)
    with pytest.raises(ValueError, match="recall_summary must be one of bounds, centroid; got 'mean'"):
        Disk(recall_summary="mean")


@pytest.mark.parametrize(
    ("parts", "message"),
    [
        ({"policy": Sink(2, 10), "spill": Disk()}, "re-rotates the keys"),
        ({"policy": HeavyHitter(0.2), "spill": Disk(hot_tokens=8)}, r"Disk\(hot_tokens=...\) has no meaning"),
        ({"spill": Disk(recall_pages=4)}, "the chain has no eviction policy"),
    ],
)
def test_chains_that_cannot_recall_are_refused_with_the_reason(parts: dict[str, Any], message: str) -> None:
    with pytest.raises(ChainRefused, match=message):
        GovernedCache(tiny_llama(), **parts)


def test_the_registry_names_h2o_with_recall() -> None:
    model = tiny_llama()
    cache = get_cache_spec("h2o@0.2:int8+recall").build_for(model, PROMPT)
    assert isinstance(cache, HeavyHitterCache) and cache.recall == Recall() and cache.codec_name == "int8"
    assert cache.budget == math.floor(0.2 * PROMPT)
    description = get_cache_spec("h2o@0.2:int8+recall").description
    assert "the 8 pages a query scores highest are recalled" in description
    assert "into one buffer the layers share" in description
    with pytest.raises(ValueError, match="suffixes after '\\+' are 'recall', 'spans', 'pyramid', 'ada', each at most"):
        get_cache_spec("h2o@0.2+spill")
    spans = get_cache_spec("h2o@0.2+recall+spans").build_for(model, PROMPT)
    assert spans.recall == Recall(neighbours=1)
    described = get_cache_spec("h2o@0.2+recall+spans").description
    assert "a chosen page's 1 neighbour(s) on each side coming with it" in described
    assert cache.recall.neighbours == 1  # a chosen page's neighbours come with it by default
    with pytest.raises(ValueError, match="'\\+spans' names recall's neighbouring pages, so it needs '\\+recall'"):
        get_cache_spec("h2o@0.2+spans")


@pytest.mark.parametrize(("summary", "buffer"), [("bounds", "layer"), ("centroid", "layer"), ("centroid", "shared")])
def test_the_planner_counts_recall_bytes_as_the_cache_holds_them(summary: str, buffer: str) -> None:
    model = tiny_llama()  # full attention only
    recall = Recall(pages=2, page_tokens=PAGE, summary=summary, buffer=buffer)
    cache = HeavyHitterCache(model, budget=BUDGET, recall=recall)
    generate(model, cache, rows=1, new=3)
    setup = CacheSetup(
        block_size=1, kv_dtype="fp32", h2o_budget=0.5, eviction_slots=True, recall_pages=2, recall_page_tokens=PAGE,
        recall_summary=summary, recall_buffer=buffer,
    )  # fmt: skip
    evicted = PROMPT + 3 - 1 - BUDGET
    resident, disk, buffered = recall_bytes(setup, evicted, head_dim=16)
    layers, heads = 2, 2
    buffers = heads * buffered if buffer == "shared" else layers * heads * buffered  # a shared one: one layer's
    assert buffered > 0
    assert cache.stats().recall_bytes == layers * heads * resident + buffers
    layers_times_heads = layers * heads
    stats = cache.recall_stats()
    assert stats is not None and stats.bytes_written == layers_times_heads * disk


def test_a_refused_cache_creates_no_spill_directory(tmp_path: Path) -> None:
    # Every argument is checked before the recall tier checks (and creates) its directory.
    path = tmp_path / "not-yet"
    with pytest.raises(ValueError, match="compress must be one of"):
        HeavyHitterCache(tiny_llama(), budget=8, recall=Recall(path=str(path)), compress="sometimes")
    assert not path.exists()
    HeavyHitterCache(tiny_llama(), budget=8, recall=Recall(path=str(path)))
    assert path.is_dir()  # a cache that is built checks the directory now, not at the first spill
