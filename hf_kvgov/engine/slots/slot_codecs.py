"""The ``codec=`` argument of the eviction caches: a codec name or a `QuantConfig`, to one format per layer."""

from __future__ import annotations

from hf_kvgov.engine.quant_config import FULL_PRECISION, QuantConfig
from hf_kvgov.engine.slots.slot_store import DenseFormat, QuantizedFormat, SlotFormat

CodecSpec = str | QuantConfig | None

# Names ``codec=`` accepts -> (fmt, bits) of the `QuantConfig` they stand for; "fp8" is e4m3, as elsewhere.
SLOT_CODECS: dict[str, tuple[str, int]] = {
    "int8": ("int", 8),
    "int4": ("int", 4),
    "int2": ("int", 2),
    "fp8": ("fp8", 8),
    "fp8_e4m3": ("fp8_e4m3", 8),
    "fp8_e5m2": ("fp8_e5m2", 8),
}

_DEFAULTS = QuantConfig()


def slot_quant_config(codec: CodecSpec, owner: str) -> QuantConfig | None:
    """The validated `QuantConfig` that ``codec`` stands for, or None for slots in the model's precision."""
    if codec is None or isinstance(codec, QuantConfig):
        _check_block_options(codec, owner)
        return codec
    if not isinstance(codec, str):
        raise TypeError(
            f"{owner}: codec must be None, a codec name ({', '.join(SLOT_CODECS)}) or a QuantConfig; "
            f"got {codec!r} of type {type(codec).__name__}."
        )
    if codec not in SLOT_CODECS:
        raise ValueError(f"{owner}: unknown codec {codec!r}; the accepted names are {', '.join(SLOT_CODECS)}.")
    fmt, bits = SLOT_CODECS[codec]
    return QuantConfig(bits=bits, fmt=fmt)


def slot_formats(
    codec: CodecSpec, num_layers: int, num_kv_heads: int, head_dim: int, owner: str
) -> tuple[list[SlotFormat], QuantConfig | None]:
    """Each layer's slot format, and the validated configuration (None: every slot keeps the model's precision).

    Layers in ``QuantConfig.full_precision_layers`` keep their slots in the model's precision, and layers named
    in ``QuantConfig.layer_formats`` use their own codec.
    """
    config = slot_quant_config(codec, owner)
    dense = DenseFormat()
    if config is None:
        return [dense] * num_layers, None
    # Raises for layers the model lacks, or a head_dim the codec's packing or value groups do not divide.
    config.check_model(num_layers, num_kv_heads, head_dim, block_size=1)
    by_name: dict[str, SlotFormat] = {FULL_PRECISION: dense}  # layers of one codec share one format
    for layer in range(num_layers):
        name = config.layer_format(layer)
        if name not in by_name:
            by_name[name] = QuantizedFormat(config.layer_codec(layer))
    return [by_name[config.layer_format(layer)] for layer in range(num_layers)], config


def _check_block_options(config: QuantConfig | None, owner: str) -> None:
    """Refuse the `QuantConfig` options that only mean something for a cache made of blocks."""
    if config is None:
        return
    if config.residual != _DEFAULTS.residual:
        raise ValueError(
            f"{owner} cannot honour QuantConfig(residual={config.residual}): an eviction cache attends each "
            "step's new tokens in full precision and then stores every kept slot quantized, so there is no "
            f"full-precision tail to size. Leave residual at {_DEFAULTS.residual}."
        )
    if config.scale_bytes != _DEFAULTS.scale_bytes:
        raise ValueError(
            f"{owner} cannot honour QuantConfig(scale_bytes={config.scale_bytes}): its slots keep float16 "
            "statistics (a slot's records have a fixed layout in the pool). One-byte statistics are for sealed "
            f"blocks (QuantizedCache); leave scale_bytes at {_DEFAULTS.scale_bytes}."
        )
    if config.sink_blocks != _DEFAULTS.sink_blocks:
        raise ValueError(
            f"{owner} cannot honour QuantConfig(sink_blocks={config.sink_blocks}): it stores slots, not blocks, "
            "and which early tokens stay is the eviction policy's choice (SinkCache keeps n_sink of them). "
            f"Leave sink_blocks at {_DEFAULTS.sink_blocks}; to keep whole layers unquantized use "
            "full_precision_layers."
        )
