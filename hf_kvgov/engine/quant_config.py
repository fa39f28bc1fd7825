"""`QuantConfig`: what a `QuantizedCache` stores in reduced precision, validated on construction."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hf_kvgov.codecs.base import KVCodec
from hf_kvgov.codecs.numerics import LOG_SCALE
from hf_kvgov.codecs.registry import get_codec
from hf_kvgov.format_defaults import format_defaults
from hf_kvgov.storage.layer_groups import LayerGroup, single_group
from hf_kvgov.storage.sealed_formats import CodecFormat, RawFormat, SealedFormat

# The block size for the most compact sealed blocks. Keys carry one scale (and zero point) per channel per
# block, so their cost per token falls as 1 / block_size; values carry theirs per token (fp8 values: a scale
# only). Per KV head and token, as a fraction of float16 K + V (4 x head_dim bytes), with fp16 scales:
#
#     int8  1/2 + 1/block_size + 1/head_dim        fp8  1/2 + 1/block_size + 1/(2 head_dim)
#     int4  1/4 + 1/block_size + 1/head_dim
#
# At head_dim 64 (SmolLM2) blocks of 16 (QuantizedCache's default, like PagedCache's) give int8 0.578, fp8
# 0.570, int4 0.328; blocks of 128 give 0.523, 0.516 and 0.273, within 0.53 / 0.53 / 0.30 for head_dim >= 64
# (blocks of 64 leave int8 at 0.531). Quality does not suffer: on SmolLM2, 2,048 tokens, int8 +0.00%, int4
# +0.27% perplexity (fp8 at blocks of 128: `eval/bench_fp8.py`). The price is a larger full-precision sink
# and tail per row (up to 2 x 128 tokens), which is why it is not the default: a short prompt would then hold
# nothing sealed.
COMPACT_BLOCK_SIZE = 128


# (fmt, bits) -> codec name. "fp8" is e4m3: one more mantissa bit than e5m2, and K/V never need e5m2's range
# once every group has its own scale.
CODEC_NAMES: dict[tuple[str, int], str] = {
    ("int", 8): "int8",
    ("int", 4): "int4",
    ("int", 2): "int2",
    ("fp8", 8): "fp8_e4m3",
    ("fp8_e4m3", 8): "fp8_e4m3",
    ("fp8_e5m2", 8): "fp8_e5m2",
}
# scale_bytes -> the codecs' scale dtype. One byte: a logarithmic scale byte and an e4m3 zero point
# (`hf_kvgov.codecs.numerics`), which is what takes int2 under 0.2x of float16 (`eval/RESULTS.md`).
SCALE_DTYPE_BY_BYTES: dict[int, torch.dtype] = {2: torch.float16, 1: LOG_SCALE, 4: torch.float32}
FULL_PRECISION = "full"  # a per-layer format: the layer's sealed blocks stay in the model's precision
# What `layer_formats` accepts per layer: every codec name, "fp8" for e4m3, and "full".
LAYER_FORMATS: tuple[str, ...] = (*dict.fromkeys(CODEC_NAMES.values()), "fp8", FULL_PRECISION)


@dataclass(frozen=True)
class QuantConfig:
    """How a `QuantizedCache` stores sealed blocks.

    Attributes:
        bits: 8, 4 or 2 (4 and 2 only with fmt="int"; 2 is KIVI's format, best with ``residual``).
        fmt: "int" (asymmetric integer codes), "fp8" (= "fp8_e4m3") or "fp8_e5m2".
        residual: the newest `residual` tokens stay in full precision (a block is sealed once it is full
            and all its tokens are older than that); 0 seals every full block.
        sink_blocks: leading blocks kept in full precision (attention sinks, where outliers live).
        full_precision_layers: layers whose sealed blocks are stored unquantized.
        group_size: head_dim elements per value scale (None: one scale per token and head).
        scale_bytes: bytes of each scale and zero point: 2 (float16, the default), 1 (a logarithmic scale byte
            and an e4m3 zero, `hf_kvgov.codecs.numerics`: half the statistics, for int2 above all) or 4
            (float32).
        layer_formats: per-layer formats overriding ``bits``/``fmt``, ``{layer: name}`` with names from
            `LAYER_FORMATS` ("int8", "int4", "int2", "fp8", "fp8_e5m2", "full"); stored sorted as pairs. A
            "full" layer joins ``full_precision_layers``. `QuantConfig.load` reads such a map from the JSON
            ``kvgov check-quant --recommend`` writes.
    """

    bits: int = 8
    fmt: str = "int"
    residual: int = 0
    sink_blocks: int = 1
    full_precision_layers: tuple[int, ...] = ()
    group_size: int | None = None
    layer_formats: Any = ()  # Mapping[int, str] or pairs; normalised to tuple[tuple[int, str], ...]
    scale_bytes: int = 2

    def __post_init__(self) -> None:
        if (self.fmt, self.bits) not in CODEC_NAMES:
            accepted = ", ".join(f"fmt={f!r} bits={b}" for f, b in CODEC_NAMES)
            raise ValueError(f"No KV format for fmt={self.fmt!r} with bits={self.bits!r}; accepted: {accepted}.")
        for name in ("residual", "sink_blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int; got {value!r}.")
        if isinstance(self.scale_bytes, bool) or self.scale_bytes not in SCALE_DTYPE_BY_BYTES:
            raise ValueError(
                f"scale_bytes must be 2 (float16), 1 (one byte: a logarithmic scale and an e4m3 zero) or 4 "
                f"(float32); got {self.scale_bytes!r}."
            )
        overrides = _layer_format_pairs(self.layer_formats)
        full = {layer for layer, name in overrides if name == FULL_PRECISION}
        layers = _layer_tuple(self.full_precision_layers)
        object.__setattr__(self, "full_precision_layers", tuple(sorted(set(layers) | full)))
        # Entries naming the default codec change nothing: dropped, so equal configurations compare equal.
        codecs = tuple(
            (layer, name)
            for layer, name in overrides
            if name not in (FULL_PRECISION, CODEC_NAMES[(self.fmt, self.bits)]) and layer not in layers
        )
        object.__setattr__(self, "layer_formats", codecs)
        self.codec()  # validates group_size
        for layer, _ in codecs:
            self.layer_codec(layer)

    @classmethod
    def filled(
        cls,
        head_dim: int,
        residual: int | None,
        group_size: int | str | None,
        scale_bytes: int | None,
        **fields: Any,
    ) -> QuantConfig:
        """The configuration with `format_defaults` where a setting is None (``group_size``: "auto"), for a model of
        this head_dim; the other ``fields`` as given."""
        defaults = format_defaults(fields.get("bits", 8), head_dim)
        return cls(
            residual=defaults["residual"] if residual is None else residual,
            group_size=defaults["group_size"] if isinstance(group_size, str) else group_size,
            scale_bytes=defaults["scale_bytes"] if scale_bytes is None else scale_bytes,
            **fields,
        )

    @classmethod
    def of_formats(cls, formats: Sequence[SealedFormat]) -> QuantConfig:
        """The configuration whose layers seal as ``formats`` do (a pool's, `QuantizedBlockPool.sealed.formats`):
        the most common codec the default, the other codecs per layer, raw layers in full precision. What a pool
        cannot say (the residual window, sink blocks) keeps its default."""
        coded = {layer: f.codec for layer, f in enumerate(formats) if isinstance(f, CodecFormat)}
        full = tuple(layer for layer in range(len(formats)) if layer not in coded)
        if not coded:
            return cls(full_precision_layers=full)
        names = [codec.name for codec in coded.values()]
        default = max(dict.fromkeys(names), key=names.count)
        fmt, bits = next(key for key, name in CODEC_NAMES.items() if name == default)
        first = next(codec for codec in coded.values() if codec.name == default)
        scale_bytes = next(n for n, dtype in SCALE_DTYPE_BY_BYTES.items() if dtype == first.scale_dtype)
        others = {layer: codec.name for layer, codec in coded.items() if codec.name != default}
        return cls(bits, fmt, 0, 1, full, first.group_size, others, scale_bytes)

    @property
    def codec_name(self) -> str:
        return CODEC_NAMES[(self.fmt, self.bits)]

    def codec(self) -> KVCodec:
        return self._codec_named(self.codec_name)

    def layer_format(self, layer: int) -> str:
        """The format layer ``layer`` seals its blocks in: a codec name, or "full"."""
        if layer in self.full_precision_layers:
            return FULL_PRECISION
        return dict(self.layer_formats).get(layer, self.codec_name)

    def layer_groups(self, groups: tuple[LayerGroup, ...]) -> tuple[LayerGroup, ...]:
        """`groups`, unless two layers at one position of them are sealed differently: then one group of every layer.

        The layers at one position share the sealed store's tensors, so they need one format. A layer kept in full
        precision among quantized ones would either force its whole position, in every group, into full precision
        (changing what the other layers store) or need the full-precision layers to fill whole positions of every
        group, which a handful of layers rarely do. So such a configuration keeps one group, as before layer
        groups: every layer keeps every token, and what each layer stores is what it asked for.
        """
        for position in range(len(groups[0].layers)):
            if len({self.layer_format(group.layers[position]) for group in groups}) > 1:
                return single_group(sum(len(group.layers) for group in groups))
        return groups

    def layer_codec(self, layer: int) -> KVCodec:
        """The codec of a quantized layer (its override, else the default)."""
        name = self.layer_format(layer)
        assert name != FULL_PRECISION, f"layer {layer} is kept in full precision"
        return self._codec_named(name)

    def _codec_named(self, name: str) -> KVCodec:
        return get_codec(name, group_size=self.group_size, scale_dtype=SCALE_DTYPE_BY_BYTES[self.scale_bytes])

    @classmethod
    def load(cls, path: str | Path) -> QuantConfig:
        """The configuration a JSON file holds: ``{"quant_config": {...QuantConfig fields...}}`` (what
        ``kvgov check-quant --recommend`` writes), or the fields themselves."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise ValueError(f"Cannot read a QuantConfig from {path}: {error}") from error
        fields = data.get("quant_config", data) if isinstance(data, dict) else None
        if not isinstance(fields, dict):
            raise ValueError(f"{path} must hold a JSON object of QuantConfig fields; got {type(fields).__name__}.")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"{path}: unknown QuantConfig fields {unknown}; accepted: {sorted(known)}.")
        layer_formats = {int(layer): name for layer, name in dict(fields.get("layer_formats") or {}).items()}
        return cls(**(fields | {"layer_formats": layer_formats}))

    def to_json(self) -> dict[str, Any]:
        """The fields as JSON-ready values (`load` reads them back)."""
        return {
            "bits": self.bits, "fmt": self.fmt, "residual": self.residual, "sink_blocks": self.sink_blocks,
            "full_precision_layers": list(self.full_precision_layers), "group_size": self.group_size,
            "scale_bytes": self.scale_bytes, "layer_formats": {str(layer): name for layer, name in self.layer_formats},
        }  # fmt: skip

    def check_model(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int) -> None:
        """Raise ValueError if this configuration cannot serve a model of this geometry."""
        outside = [layer for layer in self.full_precision_layers if layer >= num_layers]
        if outside:
            raise ValueError(
                f"full_precision_layers {outside} are not layers of this model, which has layers 0..{num_layers - 1}."
            )
        outside = [layer for layer, _ in self.layer_formats if layer >= num_layers]
        if outside:
            raise ValueError(f"layer_formats names layers {outside}, but this model has layers 0..{num_layers - 1}.")
        self.codec().bytes_per_token(num_kv_heads, head_dim, block_size)  # head_dim / group_size fit the codec
        for layer, _ in self.layer_formats:
            self.layer_codec(layer).bytes_per_token(num_kv_heads, head_dim, block_size)

    def formats(self, num_layers: int, dtype: torch.dtype) -> list[SealedFormat]:
        """The sealed format of each layer."""
        raw = RawFormat(dtype)
        formats: dict[str, SealedFormat] = {}  # layers of one codec share one format object
        for layer in range(num_layers):
            name = self.layer_format(layer)
            if name != FULL_PRECISION and name not in formats:
                formats[name] = CodecFormat(self.layer_codec(layer))
        return [formats.get(self.layer_format(layer), raw) for layer in range(num_layers)]

    def namespace(self, base: str) -> str:
        """`base` plus how blocks are sealed: caches that seal differently (codec, value groups, statistics' bytes,
        layers in full precision, sink blocks) never share a block in a prefix tree, nor does a full-precision one."""
        layers = ",".join(map(str, self.full_precision_layers))
        own = ",".join(f"{layer}={name}" for layer, name in self.layer_formats)
        stats = f":s={self.scale_bytes}" if self.scale_bytes != 2 else ""  # the fp16 default keeps its old namespace
        sealing = f"sealed:{self.codec_name}:g={self.group_size}{stats}:fp=[{layers}]:sink={self.sink_blocks}"
        return f"{base}\x00{sealing}" + (f":layers=[{own}]" if own else "")

    def describe(self) -> str:
        """One line for reports, e.g. "int4, layers 0, 1 in full precision"."""
        text = self.codec_name
        if self.group_size is not None:
            text += f" (value groups of {self.group_size})"
        if self.scale_bytes != 2:
            text += ", one-byte scales and zeros" if self.scale_bytes == 1 else ", float32 scales"
        if self.residual:
            text += f", newest {self.residual} tokens in full precision"
        for name in dict.fromkeys(name for _, name in self.layer_formats):
            layers = [str(layer) for layer, other in self.layer_formats if other == name]
            text += f", layer{'s' if len(layers) > 1 else ''} {', '.join(layers)} in {name}"
        if self.full_precision_layers:
            text += f", layers {', '.join(map(str, self.full_precision_layers))} in full precision"
        return text


def _layer_format_pairs(layer_formats: object) -> tuple[tuple[int, str], ...]:
    """``{layer: name}`` (or pairs) as sorted (layer, codec name) pairs, "fp8" read as "fp8_e4m3"."""
    items = layer_formats.items() if isinstance(layer_formats, Mapping) else layer_formats
    if isinstance(items, str | bytes) or not isinstance(items, Iterable):
        raise TypeError(f"layer_formats must map layer indices to format names; got {layer_formats!r}.")
    pairs: dict[int, str] = {}
    for item in items:
        if not (isinstance(item, tuple | list) and len(item) == 2):
            raise TypeError(f"layer_formats must map layer indices to format names; got the entry {item!r}.")
        layer, name = item
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise ValueError(f"layer_formats keys must be non-negative layer indices; got {layer!r}.")
        if name not in LAYER_FORMATS:
            raise ValueError(
                f"layer_formats[{layer}] = {name!r} is not a format; accepted: {', '.join(LAYER_FORMATS)}."
            )
        pairs[layer] = "fp8_e4m3" if name == "fp8" else name
    return tuple(sorted(pairs.items()))


def _layer_tuple(layers: Iterable[int]) -> tuple[int, ...]:
    if isinstance(layers, (str, bytes)):
        raise TypeError(f"full_precision_layers must be layer indices (ints); got {layers!r}.")
    values = tuple(layers)
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
        raise ValueError(f"full_precision_layers must be non-negative ints; got {values!r}.")
    return tuple(sorted(set(values)))
