"""Codec names -> factories, so callers pick a format by name instead of branching on types.

codec = get_codec("int4", group_size=32)       # options are the codec's dataclass fields
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hf_kvgov.codecs.base import KVCodec
from hf_kvgov.codecs.fp8 import Fp8E4M3Codec, Fp8E5M2Codec
from hf_kvgov.codecs.int2 import Int2Codec
from hf_kvgov.codecs.int4 import Int4Codec
from hf_kvgov.codecs.int8 import Int8Codec

CodecFactory = Callable[..., KVCodec]

_REGISTRY: dict[str, CodecFactory] = {}


def register_codec(name: str, factory: CodecFactory) -> None:
    """Make ``get_codec(name, **options)`` call ``factory(**options)``; names are unique."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"A codec name must be a non-empty string; got {name!r}.")
    if name in _REGISTRY:
        raise ValueError(f"A codec named {name!r} is already registered; pick another name.")
    _REGISTRY[name] = factory


def available_codecs() -> tuple[str, ...]:
    """The registered codec names, sorted."""
    return tuple(sorted(_REGISTRY))


def get_codec(name: str, **options: Any) -> KVCodec:
    """A new codec ``name`` built with ``options`` (group_size, scale_dtype, check_finite)."""
    factory = _REGISTRY.get(name)
    if factory is None:
        raise ValueError(f"Unknown KV codec {name!r}; the accepted names are: {', '.join(available_codecs())}.")
    return factory(**options)


for _codec in (Int8Codec, Int4Codec, Int2Codec, Fp8E4M3Codec, Fp8E5M2Codec):
    register_codec(_codec.name, _codec)
