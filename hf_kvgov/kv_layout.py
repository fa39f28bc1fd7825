"""Which transformers models cache K/V in a shape hf_kvgov can hold, in one torch-free place.

Every hf_kvgov cache, the serving engine and the planner hold per-head keys and values of one ``head_dim`` and one
KV-head count for every layer. These models cache something else, and are refused by name when a cache is built (or
a plan made), not at the first `update`: multi-head latent attention (deepseek_v2, deepseek_v3, minicpm3, every
config with a ``kv_lora_rank``), which caches one shared compressed latent and rotary key per token; value heads
narrower than key heads (MiMo-V2-Flash); layers of different head_dim or KV heads (Gemma 4); and encoder-decoder
models (T5, BART, Whisper), whose decoder caches the encoder's K/V beside its own (a block cache took both).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

_GEOMETRY = ("head_dim", "num_key_value_heads", "v_head_dim")  # what the pool's one geometry fixes for every layer
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")


def unsupported_layer_type(layer_type: object) -> str | None:
    """Why a decoder layer of `layer_type` (an entry of a config's ``layer_types``) is not one hf_kvgov can cache, or
    None when it is: chunked attention (Llama 4) and the state of linear-attention or Mamba layers are not K/V."""
    if layer_type in ATTENTION_LAYER_TYPES:
        return None
    return (
        f"Layer type {layer_type!r} is not supported by hf_kvgov caches; supported layer types are "
        "'full_attention' and 'sliding_attention' (attention-only decoders)."
    )


def unsupported_kv_layout(field: Callable[[str], Any], model_type: str) -> str | None:
    """Why a model of `model_type` whose config answers ``field(name)`` (None where it has no such field) caches
    K/V hf_kvgov cannot hold, or None when it can."""
    if field("is_encoder_decoder") is True:
        return (
            f"{model_type or 'This model'} is an encoder-decoder model: its decoder caches cross-attention K/V of "
            "the encoder's output beside its own (transformers' EncoderDecoderCache), and hf_kvgov's caches, serving "
            "engine and planner hold the self-attention K/V of decoder-only models. Use transformers' caches."
        )
    varying = _per_layer_geometry(field)
    if varying is not None:
        return (
            f"{model_type or 'This model'} gives its layers different attention geometry ({varying}), and hf_kvgov's "
            "caches, serving engine and planner hold one head_dim and KV-head count for every layer. Use transformers' "
            "DynamicCache."
        )
    latent = field("kv_lora_rank")
    if latent is not None:
        rope = field("qk_rope_head_dim")
        heads, dims = field("num_key_value_heads") or field("num_attention_heads"), _dims(field)
        per_head = f" instead of {heads} K/V heads of {dims}" if heads and dims else ""
        return (
            f"{model_type or 'This model'} uses multi-head latent attention: transformers caches one shared latent of "
            f"{latent} values and a rotary key of {rope} per token and layer{per_head}, and hf_kvgov's caches, serving "
            "engine and planner hold per-head keys and values of one head_dim. Use transformers' DynamicCache (the "
            "latent is already the compressed form of its K/V)."
        )
    value_dim, head_dim = field("v_head_dim"), field("head_dim")
    if isinstance(value_dim, int) and isinstance(head_dim, int) and value_dim != head_dim:
        return (
            f"{model_type or 'This model'} has value heads of dim {value_dim} and key heads of dim {head_dim}; "
            "hf_kvgov's caches, serving engine and planner hold keys and values of one head_dim. Use transformers' "
            "DynamicCache."
        )
    return None


def _per_layer_geometry(field: Callable[[str], Any]) -> str | None:
    """Which layers' K/V geometry differs from the rest (``per_layer_config``: Gemma 4's full-attention layers have
    twice the sliding ones' head_dim), as "layers 5, 11 have head_dim 512", or None. A config object gives one view
    per layer; a config.json, the overrides by layer index."""
    layers = field("per_layer_config")
    if not layers:
        return None
    if isinstance(layers, Mapping):
        rows = {int(index): dict(override) for index, override in layers.items()}
        base = {name: field(name) for name in _GEOMETRY}
    else:
        rows = dict(enumerate({name: getattr(layer, name, None) for name in _GEOMETRY} for layer in layers))
        base = rows.get(0, {})
    changes: dict[str, list[int]] = {}
    for index, values in sorted(rows.items()):
        for name in _GEOMETRY:
            if name in values and values[name] != base.get(name):
                changes.setdefault(f"{name} {values[name]}", []).append(index)
    if not changes:
        return None
    return "; ".join(
        f"layer {indices[0]} has {change}"
        if len(indices) == 1
        else f"layers {', '.join(map(str, indices))} have {change}"
        for change, indices in changes.items()
    )


def _dims(field: Callable[[str], Any]) -> str | None:
    nope, rope, value = field("qk_nope_head_dim"), field("qk_rope_head_dim"), field("v_head_dim")
    if all(isinstance(d, int) for d in (nope, rope, value)):
        return f"dim {nope + rope} (keys) and {value} (values)"
    return None
