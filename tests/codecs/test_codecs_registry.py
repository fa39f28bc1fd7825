"""The codec registry: names to factories, options passed through, clear errors."""

from __future__ import annotations

import pytest
import torch

from hf_kvgov.codecs import Fp8E4M3Codec, Int4Codec, Int8Codec, registry
from hf_kvgov.codecs.registry import available_codecs, get_codec, register_codec


def test_names_map_to_their_codecs_with_options() -> None:
    assert type(get_codec("int8")) is Int8Codec
    codec = get_codec("int4", group_size=32, scale_dtype=torch.float32, check_finite=False)
    assert codec == Int4Codec(group_size=32, scale_dtype=torch.float32, check_finite=False)
    assert get_codec("fp8_e4m3").name == "fp8_e4m3" and isinstance(get_codec("fp8_e4m3"), Fp8E4M3Codec)
    assert {n: get_codec(n).bits for n in available_codecs()} == {
        "fp8_e4m3": 8,
        "fp8_e5m2": 8,
        "int2": 2,
        "int4": 4,
        "int8": 8,
    }


def test_unknown_name_lists_the_accepted_ones() -> None:
    expected = "Unknown KV codec 'int3'; the accepted names are: fp8_e4m3, fp8_e5m2, int2, int4, int8."
    with pytest.raises(ValueError) as info:
        get_codec("int3")
    assert str(info.value) == expected


def test_unknown_option_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="bits"):
        get_codec("int8", bits=4)


def test_register_a_new_codec(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    register_codec("int8_g32", lambda **options: Int8Codec(group_size=32, **options))
    assert get_codec("int8_g32", check_finite=False) == Int8Codec(group_size=32, check_finite=False)
    assert "int8_g32" in available_codecs()
    with pytest.raises(ValueError, match="already registered"):
        register_codec("int8", Int8Codec)
    with pytest.raises(ValueError, match="non-empty string"):
        register_codec("", Int8Codec)
