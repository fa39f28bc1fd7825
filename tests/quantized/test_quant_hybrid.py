"""QuantizedCache on hybrid models: layer groups free a sliding layer's blocks, sealed or full precision (the sink
too), once they leave its window; generation is token for token that of a single-group QuantizedCache, which
keeps every block (tiny random Gemma-3 and Mistral configs, both attention paths, left padding, beams, crop)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hf_kvgov import PagedCache, QuantizedCache, paged_attention
from hf_kvgov.storage.layer_groups import LayerGroup
from hf_kvgov.storage.pool import KVGeometry
from hf_kvgov.storage.quantized_pool import QuantizedBlockPool
from hf_kvgov.storage.sealed_formats import RawFormat
from tests.hf.test_paged_hybrid import BLOCK, MODELS, WINDOW, generate


class OneGroupQuantizedCache(QuantizedCache):
    """QuantizedCache without layer groups: one table for every layer, so sliding layers keep every block."""

    groups_layers = False


def run(model: Any, cache: Any, attention: str = "contiguous", **kwargs: Any) -> Any:
    if attention == "paged":
        with paged_attention(model):
            return generate(model, cache, **kwargs)
    return generate(model, cache, **kwargs)


def test_groups_follow_the_window_unless_a_position_mixes_formats() -> None:
    model = MODELS["gemma3"]
    assert QuantizedCache(model).groups == PagedCache(model).groups
    # Groups (0 1) (3 4) (2 5): position 0 holds layers 0, 3 and 2, position 1 layers 1, 4 and 5.
    assert QuantizedCache(model, full_precision_layers=(0, 2, 3)).groups == PagedCache(model).groups
    # Layer 0 alone in full precision would share sealed tensors with quantized layers 3 and 2: one group.
    assert QuantizedCache(model, full_precision_layers=(0,)).groups == (LayerGroup(tuple(range(6))),)


def test_full_precision_layers_filling_a_position_decode_as_the_single_group_cache() -> None:
    model = MODELS["gemma3"]
    reference = generate(model, OneGroupQuantizedCache(model, block_size=BLOCK, full_precision_layers=(0, 2, 3)))
    cache = QuantizedCache(model, block_size=BLOCK, full_precision_layers=(0, 2, 3))
    out = generate(model, cache)
    assert len(cache.groups) == 3 and torch.equal(out.sequences, reference.sequences)
    store = cache._quantized_pool.sealed
    assert [store.formats[layer].name for layer in (0, 3, 2, 1, 4, 5)] == ["full"] * 3 + ["int8"] * 3


def test_a_position_of_mixed_formats_is_refused_by_the_pool() -> None:
    geometry = KVGeometry(2, 2, 16, torch.float32, torch.device("cpu"))
    groups = (LayerGroup((0,), 8), LayerGroup((1,), None))
    formats = QuantizedCache(MODELS["mistral"]).quant.formats(2, torch.float32)
    with pytest.raises(ValueError, match="share sealed blocks"):
        QuantizedBlockPool(geometry, [formats[0], RawFormat(torch.float32)], block_size=BLOCK, groups=groups)
    pool = QuantizedBlockPool(geometry, formats, block_size=BLOCK, groups=groups)
    # One position: both layers' pieces are one tensor each, and a sealed block costs one layer's bytes.
    assert pool.sealed.pieces[0] is pool.sealed.pieces[1]
    single = QuantizedBlockPool(geometry, formats, block_size=BLOCK)
    assert 2 * pool.sealed.bytes_per_block == single.sealed.bytes_per_block


@pytest.mark.parametrize(
    ("bits", "fmt"), [(8, "int"), (4, "int"), (2, "int"), (8, "fp8")], ids=["int8", "int4", "int2", "fp8"]
)
@pytest.mark.parametrize("attention", ["contiguous", "paged"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_tokens_equal_the_single_group_cache(name: str, attention: str, bits: int, fmt: str) -> None:
    model = MODELS[name]
    options: dict[str, Any] = {"bits": bits, "fmt": fmt, "block_size": BLOCK, "attention": attention}
    reference = run(model, OneGroupQuantizedCache(model, **options), attention)
    cache = QuantizedCache(model, **options)
    out = run(model, cache, attention)
    assert len(cache.groups) > 1 or cache.groups[0].window is not None
    assert torch.equal(out.sequences, reference.sequences)
    for mine, theirs in zip(out.logits, reference.logits, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)  # attention sums over fewer masked keys


@pytest.mark.parametrize("name", sorted(MODELS))
def test_sliding_groups_hold_only_their_window(name: str) -> None:
    model = MODELS[name]
    cache = QuantizedCache(model, block_size=BLOCK)
    generate(model, cache)  # 70 + 40 tokens per row: 109 stored, the last step's queries at 108
    # Queries at 108 see keys from 108 - 24 + 1 = 85 on: blocks 10..13 a row, of which 10..12 are sealed and the
    # tail 13 is not; the sink (block 0) left the window too. A full-attention group holds all 14: the sink,
    # sealed 1..12 and the tail.
    assert WINDOW == 24
    for tables in cache.all_tables:
        for row in tables.rows:
            live = row.live_ids
            sealed = [block < 0 for block in live]
            expected = [False] + [True] * 12 + [False] if tables.group.window is None else [True] * 3 + [False]  # type: ignore[union-attr]
            assert sealed == expected
    sliding = sum(group.window is not None for group in cache.groups)
    full = len(cache.groups) - sliding
    stats = cache.stats()
    assert stats.sealed_blocks == 2 * (3 * sliding + 12 * full)  # two rows
    assert stats.full_precision_blocks == 2 * (sliding + 2 * full)
    pool = cache._quantized_pool
    assert (pool.sealed.num_used, pool.num_used) == (stats.sealed_blocks, stats.full_precision_blocks)
    assert stats.bytes_used == (
        stats.sealed_blocks * pool.sealed.bytes_per_block + stats.full_precision_blocks * pool.bytes_per_block
    )
    cache.release()
    assert (pool.num_used, pool.sealed.num_used) == (0, 0)


@pytest.mark.parametrize("kwargs", [{"num_beams": 3}, {"num_return_sequences": 2, "do_sample": True, "top_k": 5}])
def test_beams_and_returned_sequences_equal_the_single_group_cache(kwargs: dict[str, Any]) -> None:
    model = MODELS["gemma3"]
    torch.manual_seed(3)
    reference = generate(model, OneGroupQuantizedCache(model, block_size=BLOCK), max_new_tokens=20, **kwargs)
    torch.manual_seed(3)
    out = generate(model, QuantizedCache(model, block_size=BLOCK), max_new_tokens=20, **kwargs)
    assert torch.equal(out.sequences, reference.sequences)


@pytest.mark.parametrize("residual", [0, 8])
def test_assisted_decoding_crops_as_the_single_group_cache(residual: int) -> None:
    model = MODELS["gemma3"]
    prompt = torch.randint(3, 20, (1, 60), generator=torch.Generator().manual_seed(2))
    prompt = torch.cat([prompt, prompt], dim=1)  # repeated text: prompt lookup proposes candidates, some rejected
    options = {"max_new_tokens": 30, "do_sample": False, "prompt_lookup_num_tokens": 4}
    one_group = OneGroupQuantizedCache(model, block_size=BLOCK, residual=residual)
    reference = model.generate(prompt, cache=one_group, **options)
    cache = QuantizedCache(model, block_size=BLOCK, residual=residual)
    assert torch.equal(model.generate(prompt, cache=cache, **options), reference)


def test_crop_into_a_sealed_block_of_a_sliding_group_decodes_it() -> None:
    model = MODELS["gemma3"]
    cache = QuantizedCache(model, block_size=BLOCK)
    generate(model, cache, max_new_tokens=4)  # 73 tokens: blocks 1..8 sealed; sliding groups keep blocks 6.. on
    cache.crop(-2)  # 71 tokens: block 8 (64..71) takes writes again, in every group (queries at 71 see 48..)
    for tables in cache.all_tables:
        assert tables.rows[0].block_ids[8] >= 0
    with pytest.raises(ValueError, match="already freed the tokens before"):
        cache.crop(-40)
