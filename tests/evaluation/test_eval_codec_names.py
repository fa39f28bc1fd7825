"""Eviction cache names with a codec for their kept slots (`h2o@0.2:int8`, `sink@4+252:int4`): parsing, errors,
what they build."""

from __future__ import annotations

import pytest
import torch

from hf_kvgov import HeavyHitterCache, SinkCache
from hf_kvgov.registry import cache_name_forms, get_cache_spec
from tests.conftest import tiny_llama

MODEL = tiny_llama()


@pytest.mark.parametrize(
    ("name", "cls", "codec"),
    [
        ("h2o@0.2:int8", HeavyHitterCache, "int8"),
        ("h2o@256:int4", HeavyHitterCache, "int4"),
        ("h2o@0.5:fp8", HeavyHitterCache, "fp8_e4m3"),
        ("h2o@64:fp8_e5m2", HeavyHitterCache, "fp8_e5m2"),
        ("sink@4+252:int8", SinkCache, "int8"),
        ("sink@0+16:fp8_e4m3", SinkCache, "fp8_e4m3"),
        ("h2o@0.2", HeavyHitterCache, None),
        ("sink@4+252", SinkCache, None),
    ],
)
def test_codec_suffix_builds_a_quantized_slot_cache(name: str, cls: type, codec: str | None) -> None:
    spec = get_cache_spec(name)
    assert spec.name == name and not spec.lossless and spec.needs_attention_context
    cache = spec.build_for(MODEL, 37)  # fed to the model directly, so a fraction is of these 37 tokens
    assert isinstance(cache, cls) and cache.codec_name == codec and cache.stats().codec == codec
    with spec.attention(MODEL), torch.inference_mode():
        MODEL(torch.arange(3, 40)[None], cache=cache)
    assert cache.stats().codec == codec and cache.get_seq_length() == 37


def test_arguments_before_the_codec_still_reach_the_caches() -> None:
    assert get_cache_spec("h2o@256:int8").build(MODEL).budget == 256
    assert get_cache_spec("h2o@0.2:int8").build(MODEL).budget is None  # a fraction resolves on the prompt
    sized = get_cache_spec("h2o@0.2:int8").build_for(MODEL, 1000)
    assert (sized.budget, sized.codec_name) == (200, "int8")
    sink = get_cache_spec("sink@4+252:int4").build(MODEL)
    assert (sink.n_sink, sink.window, sink.budget, sink.codec_name) == (4, 252, 256, "int4")


def test_descriptions_say_how_the_kept_slots_are_stored() -> None:
    assert get_cache_spec("h2o@0.2:int8").description == (
        "HeavyHitterCache (H2O): 20% of the prompt per KV head, half recent window, half heavy hitters; kept "
        "slots stored as int8 codes with scales per slot (keys and values)"
    )
    assert "stored as int4 codes" in get_cache_spec("sink@4+252:int4").description
    assert "codes" not in get_cache_spec("h2o@0.2").description
    assert "codes" not in get_cache_spec("sink@4+252").description


def test_a_quantized_name_holds_fewer_bytes_than_the_same_name_without_codec() -> None:
    held = {}
    for name in ("h2o@8", "h2o@8:int8", "h2o@8:int4", "h2o@8:int2"):
        spec = get_cache_spec(name)
        cache = spec.build(MODEL)
        with spec.attention(MODEL), torch.inference_mode():
            MODEL(torch.arange(3, 40)[None], cache=cache)
        held[name] = cache.stats().kv_bytes
    # Per (layer, KV head) slot: float32 K + V = 128 bytes; int8 2 x (16 + 4) = 40; int4 2 x (8 + 4) = 24;
    # int2 2 x (4 + 4) = 16; 2 layers x 2 KV heads x 8 slots.
    assert held == {
        "h2o@8": 4 * 8 * 128, "h2o@8:int8": 4 * 8 * 40, "h2o@8:int4": 4 * 8 * 24, "h2o@8:int2": 4 * 8 * 16,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("name", "message"),
    [
        (
            "h2o@0.2:int9",
            "Cannot read the cache name 'h2o@0.2:int9': the codec after ':' must be one of int8, int4, int2, fp8, "
            "fp8_e4m3, fp8_e5m2; got 'int9'.",
        ),
        ("h2o@0.2:", "the codec after ':' must be one of int8, int4, int2, fp8, fp8_e4m3, fp8_e5m2; got ''."),
        ("sink@4+252:int3", "Cannot read the cache name 'sink@4+252:int3': the codec after ':' must be one of"),
        ("h2o@abc:int8", "Cannot read the cache name 'h2o@abc:int8': the budget must be a fraction in (0, 1]"),
        ("h2o@1.5:int8", "a number of tokens (256); got '1.5'."),
        ("h2o@:int8", "got ''."),
        ("sink@4:int8", "'sink@4:int8': the argument must be <sinks>+<window> in tokens, as in sink@4+252; got '4'."),
        ("sink@4+0:int8", "'sink@4+0:int8': the window must be an integer of at least 1; got '0'."),
        (
            "h2o@0.2:int8:int4",
            "the codec after ':' must be one of int8, int4, int2, fp8, fp8_e4m3, fp8_e5m2; got 'int8:int4'",
        ),
    ],
)
def test_bad_codec_suffixes_are_refused_with_a_sentence(name: str, message: str) -> None:
    with pytest.raises(ValueError) as raised:
        get_cache_spec(name)
    assert message in str(raised.value)


def test_unknown_names_show_the_codec_syntax() -> None:
    """The error names the families in one line; each family's forms, codecs included, are one listing away."""
    with pytest.raises(ValueError) as raised:
        get_cache_spec("nope")
    assert "h2o@..." in str(raised.value) and "kvgov demo --list-caches" in str(raised.value)
    forms = cache_name_forms()
    assert "h2o@<budget>[:<codec>]" in forms and "h2o@0.2:int8" in forms
    assert "sink@<sinks>+<window>[:<codec>]" in forms and "sink@4+252:int8" in forms
