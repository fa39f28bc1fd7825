"""Per-layer formats (`QuantConfig.layer_formats`): each layer seals its blocks in its own codec.

Checked through generate against the fake-quantizing reference with the same per-layer codecs, on both
attention paths; bytes against the uniform caches layer by layer; the JSON map round trip; the disk tier and
the eviction caches with a mixed map; and every refusal.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from quant_fake_reference import FakeQuantCache

from hf_kvgov import HeavyHitterCache, QuantConfig, QuantizedDiskCache, eviction_attention, paged_attention
from hf_kvgov.hf.quantized_cache import QuantizedCache
from tests.conftest import tiny_llama

MODEL = tiny_llama(num_kv_heads=2)  # 2 layers, head_dim 16
LAYERS = {0: "int2", 1: "int8"}


def prompt(length: int = 27) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 96, (1, length), generator=torch.Generator().manual_seed(length))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def run(cache: Any, attention: str = "contiguous", new: int = 10) -> Any:
    with paged_attention(MODEL) if attention == "paged" else contextlib.nullcontext(), torch.inference_mode():
        return MODEL.generate(
            **prompt(), cache=cache, max_new_tokens=new, min_new_tokens=new, do_sample=False,
            return_dict_in_generate=True, output_scores=True,
        )  # fmt: skip


def assert_same(got: Any, expected: Any) -> None:
    assert torch.equal(got.sequences, expected.sequences)
    for a, b in zip(got.scores, expected.scores, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention", ["contiguous", "paged"])
def test_each_layer_seals_in_its_own_codec(attention: str) -> None:
    expected = run(FakeQuantCache(MODEL.config, "int4", block_size=4, layer_codecs=LAYERS))
    cache = QuantizedCache(MODEL, bits=4, block_size=4, layer_formats=LAYERS, attention=attention)  # type: ignore[arg-type]
    assert_same(run(cache, attention), expected)
    assert cache._quantized_pool.format_names == ("int2", "int8")
    # A different map is a different cache: the reference with int4 everywhere disagrees.
    uniform = run(FakeQuantCache(MODEL.config, "int4", block_size=4))
    assert not all(torch.equal(a, b) for a, b in zip(uniform.scores, expected.scores, strict=True))


def test_bytes_are_each_layers_codec_bytes() -> None:
    mixed = QuantizedCache(MODEL, block_size=4, layer_formats=LAYERS)
    run(mixed)
    per_layer = {}
    for name in ("int2", "int8"):
        uniform = QuantizedCache(MODEL, bits={"int2": 2, "int8": 8}[name], block_size=4, residual=0, scale_bytes=2)
        run(uniform)
        per_layer[name] = uniform.stats().sealed_bytes / 2  # both layers hold the same blocks
    stats = mixed.stats()
    assert stats.sealed_bytes == per_layer["int2"] + per_layer["int8"]
    assert mixed.quant.describe() == "int8, layer 0 in int2"


def test_full_joins_the_full_precision_layers() -> None:
    config = QuantConfig(bits=4, layer_formats={1: "full", 0: "fp8"})
    assert config.full_precision_layers == (1,) and config.layer_formats == ((0, "fp8_e4m3"),)
    assert [f.name for f in config.formats(2, torch.float32)] == ["fp8_e4m3", "full"]
    assert config.layer_format(1) == "full" and config.layer_format(0) == "fp8_e4m3"


def test_the_json_map_round_trips_into_a_cache(tmp_path: Path) -> None:
    config = QuantConfig(bits=8, residual=4, group_size=8, layer_formats={0: "int2", 1: "full"})
    path = tmp_path / "map.json"
    path.write_text(json.dumps({"quant_config": config.to_json(), "measured": {"ppl_increase_pct": 0.3}}))
    assert QuantConfig.load(path) == config
    cache = QuantizedCache.from_config(MODEL, path, block_size=4)
    assert cache.quant == config
    assert_same(run(cache), run(QuantizedCache.from_config(MODEL, config, block_size=4)))


def test_the_disk_tier_spills_each_layers_codes(tmp_path: Path) -> None:
    expected = run(QuantizedCache(MODEL, block_size=4, layer_formats=LAYERS))
    cache = QuantizedDiskCache(MODEL, str(tmp_path), hot_tokens=8, block_size=4, layer_formats=LAYERS)
    assert_same(run(cache), expected)
    stats = cache.stats()
    assert stats.spills > 0
    cache.release()


def test_eviction_slots_follow_the_map() -> None:
    codec = QuantConfig(bits=8, layer_formats={0: "int2"})
    cache = HeavyHitterCache(MODEL, budget=8, codec=codec)
    with eviction_attention(MODEL), torch.inference_mode():
        MODEL(**prompt(), cache=cache)
    # Per (layer, KV head) slot, head_dim 16: int2 2 x (4 + 4) = 16 bytes, int8 2 x (16 + 4) = 40; 2 heads x 8 slots.
    assert cache.stats().kv_bytes == 2 * 8 * (16 + 40)


@pytest.mark.parametrize(
    ("layer_formats", "error", "message"),
    [
        ({0: "int3"}, ValueError, "layer_formats\\[0\\] = 'int3' is not a format; accepted: int8, int4, int2"),
        ({-1: "int8"}, ValueError, "non-negative layer indices"),
        ("int8", TypeError, "must map layer indices to format names"),
        ({5: "int4"}, ValueError, "layer_formats names layers \\[5\\], but this model has layers 0..1"),
    ],
)
def test_bad_maps_are_refused(layer_formats: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        QuantizedCache(MODEL, layer_formats=layer_formats)


def test_a_bad_json_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"quant_config": {"bits": 8, "colour": "red"}}))
    with pytest.raises(ValueError, match="unknown QuantConfig fields \\['colour'\\]"):
        QuantConfig.load(path)
    with pytest.raises(ValueError, match="Cannot read a QuantConfig"):
        QuantConfig.load(tmp_path / "missing.json")
