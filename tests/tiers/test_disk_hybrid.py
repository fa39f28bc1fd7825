"""The disk caches on hybrid models: sliding-window layer groups free what left their window and never spill;
only full-attention layers' cold blocks reach the disk, and generation is what the caches give without a tier
(tiny random Gemma-3 and Mistral configs, both attention paths, left padding, beams, crop)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import DynamicCache

from hf_kvgov import DiskOffloadCache, QuantizedCache, QuantizedDiskCache, paged_attention
from hf_kvgov.errors import SpillCorrupted
from hf_kvgov.tiers.tiered_tables import TieredBlockTables
from tests.hf.test_paged_hybrid import BLOCK, MODELS, WINDOW, generate
from tests.spill_damage import flip_byte

HOT = 16  # tokens: below the 24-token window, so a full-attention layer's blocks spill while a sliding one's are live


def run(model: Any, cache: Any, attention: str = "contiguous", **kwargs: Any) -> Any:
    if attention == "paged":
        with paged_attention(model):
            return generate(model, cache, **kwargs)
    return generate(model, cache, **kwargs)


@pytest.mark.parametrize("attention", ["contiguous", "paged"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_disk_offload_equals_dynamic_cache(name: str, attention: str, tmp_path: Path) -> None:
    model = MODELS[name]
    reference = generate(model, DynamicCache(config=model.config))
    cache = DiskOffloadCache(model, tmp_path, hot_tokens=HOT, block_size=BLOCK, attention=attention)  # type: ignore[arg-type]
    out = run(model, cache, attention)
    assert torch.equal(out.sequences, reference.sequences)
    for mine, theirs in zip(out.logits, reference.logits, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    assert cache.groups == cache.pool.groups and len(cache.groups) == (3 if name == "gemma3" else 1)  # type: ignore[union-attr]


@pytest.mark.parametrize("attention", ["contiguous", "paged"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_quantized_disk_equals_quantized_cache(name: str, attention: str, tmp_path: Path) -> None:
    model = MODELS[name]
    reference = run(model, QuantizedCache(model, block_size=BLOCK, attention=attention), attention)  # type: ignore[arg-type]
    cache = QuantizedDiskCache(model, tmp_path, hot_tokens=HOT, block_size=BLOCK, attention=attention)  # type: ignore[arg-type]
    out = run(model, cache, attention)
    assert torch.equal(out.sequences, reference.sequences)
    for mine, theirs in zip(out.logits, reference.logits, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    if name == "gemma3":
        assert cache.stats().spills > 0  # the comparison covered blocks read back from disk


def test_with_a_hot_window_as_long_as_the_window_only_full_attention_blocks_are_written(tmp_path: Path) -> None:
    model = MODELS["gemma3"]  # groups (0 1) and (3 4) slide over 24 tokens, (2 5) attend to everything
    cache = DiskOffloadCache(model, tmp_path, hot_tokens=WINDOW, block_size=BLOCK)
    generate(model, cache)  # 2 rows of 70 + 40 tokens; the last step starts with 108 tokens stored
    assert all(isinstance(tables, TieredBlockTables) for tables in cache.all_tables)
    sliding, full = cache.all_tables[:2], cache.all_tables[2]
    # The full group spilled blocks 1 .. (108 - 24) // 8 - 1 = 9 of each row (block 0 stays: every query reads
    # it); rows differ from token 0 on, so 2 x 9 distinct blocks were written, and nothing of a sliding group.
    stats = cache.stats()
    assert [sum(b < 0 for b in row.block_ids) for row in full.rows] == [9, 9]
    assert all(b >= 0 for tables in sliding for row in tables.rows for b in row.live_ids)
    assert stats.spills == stats.spilled_blocks == 18
    # A block holds one layer per position of a group: 2 of the 6 layers, so a spilled block is 2 layers of K/V.
    assert cache.tier is not None and cache.tier.layout.layers == 2
    assert stats.bytes_written == 18 * cache.tier.layout.slot_bytes == 18 * cache.pool.bytes_per_block  # type: ignore[union-attr]
    # Resident, per row: each sliding group its window's 4 blocks (80..111), the full group block 0 and blocks
    # 10..13: 2 x 4 + 5 = 13 blocks, 26 for the batch.
    assert stats.resident_blocks == 26
    assert stats.resident_bytes == 26 * cache.pool.bytes_per_block + stats.read_buffer_bytes  # type: ignore[union-attr]


def test_a_shorter_hot_window_spills_inside_the_window_and_frees_what_leaves_it(tmp_path: Path) -> None:
    model = MODELS["gemma3"]
    cache = DiskOffloadCache(model, tmp_path, hot_tokens=HOT, block_size=BLOCK)
    generate(model, cache)
    stats, tier = cache.stats(), cache.tier
    assert tier is not None
    # At the last step's start (108 tokens): the full group spilled blocks 1 .. (108 - 16) // 8 - 1 = 10 of each
    # row; a sliding group keeps blocks 10 .. 13 (queries from 108 see 85 on) and spilled block 10, older than
    # the 16-token hot window: 10 + 1 + 1 spilled per row, 24 on disk for the batch.
    assert [[sum(b < 0 for b in row.live_ids) for row in t.rows] for t in cache.all_tables] == [
        [1, 1],
        [1, 1],
        [10, 10],
    ]
    assert stats.spilled_blocks == tier.stats().slots_in_use == 24
    # Every sliding block spilled earlier left the window since and gave its disk slot back: written once, freed.
    assert stats.spills > stats.spilled_blocks
    assert stats.resident_blocks == 20  # 6 fewer than with a 24-token hot window (the test above)


def test_a_model_whose_layers_all_slide_writes_nothing_with_a_hot_window_as_long(tmp_path: Path) -> None:
    model = MODELS["mistral"]
    cache = QuantizedDiskCache(model, tmp_path, hot_tokens=WINDOW, block_size=BLOCK)
    generate(model, cache)
    stats = cache.stats()
    assert stats.spills == 0 and stats.bytes_written == 0
    assert stats.spill_path is None  # the file is made when the first block spills: never
    assert [len(row.live_ids) for row in cache.tables.rows] == [4, 4]  # type: ignore[union-attr]  # blocks 10..13


@pytest.mark.parametrize("kwargs", [{"num_beams": 3}, {"num_return_sequences": 2, "do_sample": True, "top_k": 5}])
def test_beams_equal_dynamic_cache(kwargs: dict[str, Any], tmp_path: Path) -> None:
    model = MODELS["gemma3"]
    torch.manual_seed(3)
    reference = generate(model, DynamicCache(config=model.config), max_new_tokens=20, **kwargs).sequences
    torch.manual_seed(3)
    cache = DiskOffloadCache(model, tmp_path, hot_tokens=HOT, block_size=BLOCK)
    assert torch.equal(generate(model, cache, max_new_tokens=20, **kwargs).sequences, reference)


@pytest.mark.parametrize("kind", [DiskOffloadCache, QuantizedDiskCache])
def test_assisted_decoding_crops_into_spilled_blocks(kind: type, tmp_path: Path) -> None:
    model = MODELS["gemma3"]
    prompt = torch.randint(3, 20, (1, 60), generator=torch.Generator().manual_seed(2))
    prompt = torch.cat([prompt, prompt], dim=1)  # repeated text: prompt lookup proposes candidates, some rejected
    options = {"max_new_tokens": 30, "do_sample": False}
    plain = kind is DiskOffloadCache
    without_tier = DynamicCache(config=model.config) if plain else QuantizedCache(model, block_size=4)
    reference = model.generate(prompt, cache=without_tier, **options)
    cache = kind(model, tmp_path, hot_tokens=8, block_size=4)
    out = model.generate(prompt, cache=cache, prompt_lookup_num_tokens=4, **options)
    assert torch.equal(out, reference)
    assert cache.stats().spills > 0


def test_a_damaged_block_names_the_full_attention_layer_reading_it(tmp_path: Path) -> None:
    model = MODELS["gemma3"]
    cache = DiskOffloadCache(model, tmp_path, hot_tokens=WINDOW, block_size=BLOCK, prefetch=False)
    ids = torch.randint(3, 96, (1, 48), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        model(ids[:, :40], cache=cache)
        model(ids[:, 40:41], cache=cache)  # spills block 1 ((40 - 24) // 8 = 2: blocks 1 only): handle 0
    full = cache.all_tables[2]
    assert cache.tier is not None and full.rows[0].block_ids[1] == -1  # tokens 8..15: handle 0
    path, offset = cache.tier.location(0, 1)  # position 1 of the full group (2, 5): layer 5
    flip_byte(path, offset + 10)
    with pytest.raises(SpillCorrupted, match=r"block 0 \(tokens \[8, 16\)\), layer 5") as info, torch.inference_mode():
        model(ids[:, 41:42], cache=cache)
    assert (info.value.block, info.value.layer, info.value.tokens) == (0, 5, (8, 16))


def test_the_memory_cap_counts_each_groups_need(tmp_path: Path) -> None:
    model, hot = MODELS["gemma3"], 48
    probe = DiskOffloadCache(model, tmp_path, hot_tokens=hot, block_size=BLOCK)
    block = probe.pool.bytes_per_block  # type: ignore[union-attr]  # 2 layers of 8 tokens
    # One sequence keeps, in the full group, block 0 + ceil(48 / 8) hot blocks + the tail + one step = 9 blocks, and
    # in each sliding group its window: ceil(24 / 8) = 3 blocks + the tail + one step = 5: 19 blocks in all (a
    # count over every layer as one group would ask for 9 blocks of 6 layers, 27 of these).
    assert WINDOW == 24
    buffers = 4096
    with pytest.raises(ValueError, match="max_resident_bytes"):
        DiskOffloadCache(model, tmp_path, hot, 19 * block + buffers - 1, block_size=BLOCK, read_buffer_bytes=buffers)
    cache = DiskOffloadCache(model, tmp_path, hot, 19 * block + buffers, block_size=BLOCK, read_buffer_bytes=buffers)
    prompt, options = torch.arange(3, 73)[None], {"max_new_tokens": 30, "do_sample": False}
    reference = model.generate(prompt, cache=DynamicCache(config=model.config), **options)
    # A step may add one block per group: the prompt goes in block-sized chunks, as the cap's docs ask.
    assert torch.equal(model.generate(prompt, cache=cache, prefill_chunk_size=BLOCK, **options), reference)
    assert cache.stats().spills > 0
