"""PagedCache on hybrid models: sliding-window layer groups free what left their window, and generation stays
token-identical to DynamicCache (tiny random Gemma-3 and Mistral configs, both attention paths, left padding,
beams, num_return_sequences, assisted decoding through crop)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import DynamicCache

from hf_kvgov import PagedCache, QuantizedCache, QuantizedDiskCache, paged_attention
from hf_kvgov.quality.outliers import key_outlier_ratios, outlier_ratio
from hf_kvgov.storage.layer_groups import LayerGroup
from tests.conftest import FULL, SLIDING, tiny_gemma3, tiny_mistral

WINDOW, BLOCK = 24, 8
# 6 layers as Gemma-3 lays them out (sliding, sliding, full, repeated); Mistral: every layer sliding.
MODELS = {"gemma3": tiny_gemma3((SLIDING, SLIDING, FULL) * 2, window=WINDOW), "mistral": tiny_mistral(window=WINDOW)}


def batch() -> dict[str, torch.Tensor]:
    """Two rows of 70 tokens, the second left-padded by 9: both run well past the 24-token window."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 96, (2, 70), generator=generator)
    mask = torch.ones_like(ids)
    ids[1, :9], mask[1, :9] = 0, 0
    return {"input_ids": ids, "attention_mask": mask}


def generate(model: Any, cache: Any, **kwargs: Any) -> Any:
    options = {"max_new_tokens": 40, "do_sample": False, "return_dict_in_generate": True, "output_logits": True}
    return model.generate(**batch(), cache=cache, **(options | kwargs))


def test_layers_are_grouped_by_window() -> None:
    assert PagedCache(MODELS["gemma3"]).groups == (
        LayerGroup((0, 1), WINDOW), LayerGroup((3, 4), WINDOW), LayerGroup((2, 5), None),
    )  # fmt: skip
    assert PagedCache(MODELS["mistral"]).groups == (LayerGroup((0, 1), WINDOW),)
    assert QuantizedCache(MODELS["gemma3"]).groups == PagedCache(MODELS["gemma3"]).groups
    assert QuantizedDiskCache(MODELS["gemma3"]).groups == PagedCache(MODELS["gemma3"]).groups


@pytest.mark.parametrize("attention", ["contiguous", "paged"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_tokens_and_logits_equal_dynamic_cache(name: str, attention: str) -> None:
    model = MODELS[name]
    reference = generate(model, DynamicCache(config=model.config))
    cache = PagedCache(model, block_size=BLOCK, attention=attention)  # type: ignore[arg-type]
    if attention == "paged":
        with paged_attention(model):
            out = generate(model, cache)
    else:
        out = generate(model, cache)
    assert torch.equal(out.sequences, reference.sequences)
    for mine, theirs in zip(out.logits, reference.logits, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_sliding_groups_hold_only_their_window(name: str) -> None:
    model = MODELS[name]
    cache = PagedCache(model, block_size=BLOCK)
    generate(model, cache)  # 70 + 40 tokens per row; the last step's queries start at 108
    blocks = [len(tables.rows[0].live_ids) for tables in cache.all_tables]
    # Queries at 108 see keys from 108 - 24 + 1 = 85 on: blocks 10 (80-87) to 13 (104-109), 4 blocks a row;
    # a full-attention group holds ceil(109 / 8) = 14.
    assert blocks == [4 if group.window else 14 for group in cache.groups]
    stats = cache.stats()
    assert stats.blocks_in_use == 2 * sum(blocks)
    assert stats.bytes_used == stats.blocks_in_use * cache.pool.bytes_per_block  # type: ignore[union-attr]
    cache.release()
    assert cache.pool.num_used == 0  # type: ignore[union-attr]


@pytest.mark.parametrize("kwargs", [{"num_beams": 3}, {"num_return_sequences": 2, "do_sample": True, "top_k": 5}])
def test_beams_and_returned_sequences_equal_dynamic_cache(kwargs: dict[str, Any]) -> None:
    model = MODELS["gemma3"]
    torch.manual_seed(3)
    reference = generate(model, DynamicCache(config=model.config), max_new_tokens=20, **kwargs).sequences
    torch.manual_seed(3)
    out = generate(model, PagedCache(model, block_size=BLOCK), max_new_tokens=20, **kwargs).sequences
    assert torch.equal(out, reference)


def test_assisted_decoding_crops_within_what_the_window_kept() -> None:
    model = MODELS["gemma3"]
    prompt = torch.randint(3, 20, (1, 60), generator=torch.Generator().manual_seed(2))
    prompt = torch.cat([prompt, prompt], dim=1)  # repeated text: prompt lookup proposes candidates, some rejected
    options = {"max_new_tokens": 30, "do_sample": False}
    reference = model.generate(prompt, cache=DynamicCache(config=model.config), **options)
    cache = PagedCache(model, block_size=BLOCK)
    out = model.generate(prompt, cache=cache, prompt_lookup_num_tokens=4, **options)
    assert torch.equal(out, reference)


def test_cropping_into_freed_tokens_is_refused_and_changes_nothing() -> None:
    model = MODELS["gemma3"]
    cache = PagedCache(model, block_size=BLOCK)
    generate(model, cache, max_new_tokens=4)
    length = cache.get_seq_length()
    with pytest.raises(ValueError, match="already freed the tokens before"):
        cache.crop(-40)
    assert cache.get_seq_length() == length and [len(t.rows[0]) for t in cache.all_tables] == [10, 10, 10]


def test_layer_kv_reads_each_groups_own_table() -> None:
    model = MODELS["gemma3"]
    ids = batch()["input_ids"][:1, :41]
    cache, everything = PagedCache(model, block_size=BLOCK), DynamicCache()  # no config: every layer keeps all
    with torch.inference_mode():
        for kv in (cache, everything):
            model(ids[:, :40], cache=kv)
            model(ids[:, 40:], cache=kv)  # queries at 40 see 17..40: sliding layers keep block 2 (16-23) on
    ratios = key_outlier_ratios(cache)
    for index, group in ((index, cache.groups[cache.layout.group_of[index]]) for index in range(6)):
        first = 0 if group.window is None else 16
        keys = everything.layers[index].keys[:, :, first:]
        torch.testing.assert_close(cache.layer_kv(index)[0], keys)
        assert ratios[index] == outlier_ratio(keys)


@pytest.mark.parametrize("make", ["paged", "int8", "int8+disk"])
def test_layer_keys_and_values_read_the_blocks_as_transformers_layers_expose_them(make: str, tmp_path: Any) -> None:
    """`cache.layers[i].keys` / `.values` are what DynamicCache's layers hold (a sliding layer from its first kept
    block; int8 decoded, so within its error), None once the cache is reset, and cannot be assigned."""
    model = MODELS["gemma3"]
    ids = batch()["input_ids"][:1, :41]
    cache = {
        "paged": lambda: PagedCache(model, block_size=BLOCK),
        "int8": lambda: QuantizedCache(model, block_size=BLOCK),
        "int8+disk": lambda: QuantizedDiskCache(model, tmp_path / "spill", block_size=BLOCK, hot_tokens=BLOCK),
    }[make]()
    everything = DynamicCache()
    assert cache.layers[0].keys is None
    with torch.inference_mode():
        for kv in (cache, everything):
            model(ids[:, :40], cache=kv)
            model(ids[:, 40:], cache=kv)
    tolerance = {"rtol": 0.0, "atol": 0.0} if make == "paged" else {"rtol": 0.0, "atol": 0.05}
    for index in range(6):
        first = 16 if index % 3 != 2 else 0  # sliding layers keep block 2 (16-23) on; full layers keep all
        torch.testing.assert_close(cache.layers[index].keys, everything.layers[index].keys[:, :, first:], **tolerance)
        torch.testing.assert_close(
            cache.layers[index].values, everything.layers[index].values[:, :, first:], **tolerance
        )
    with pytest.raises(AttributeError, match="cannot be assigned a tensor"):
        cache.layers[0].keys = everything.layers[0].keys
    cache.reset()
    assert cache.layers[0].keys is None and cache.layers[0].values is None
