"""Which transformers models cache K/V in a shape hf_kvgov can hold, in one torch-free place.

Every hf_kvgov cache, the serving engine and the planner hold per-head keys and values of one ``head_dim``. Two
families cache something else, and are refused by name when a cache is built (or a plan made), not at the first
`update`: multi-head latent attention (DeepSeek-V2/V3, Kimi K2, GLM-4.7-Flash, Mistral Large 3, ...), which caches
one shared compressed latent and rotary key per token, and models whose value heads are narrower than their key
heads (MiMo-V2-Flash). Encoder-decoder models (T5, BART, Whisper) are refused too: their decoder caches the
encoder's K/V for cross-attention beside its own, and a decoder-only cache handed to `generate` silently took both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def unsupported_kv_layout(field: Callable[[str], Any], model_type: str) -> str | None:
    """Why a model of `model_type` whose config answers ``field(name)`` (None where it has no such field) caches
    K/V hf_kvgov cannot hold, or None when it can."""
    if field("is_encoder_decoder") is True:
        return (
            f"{model_type or 'This model'} is an encoder-decoder model: its decoder caches cross-attention K/V of "
            "the encoder's output beside its own (transformers' EncoderDecoderCache), and hf_kvgov's caches, serving "
            "engine and planner hold the self-attention K/V of decoder-only models. Use transformers' caches."
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


def _dims(field: Callable[[str], Any]) -> str | None:
    nope, rope, value = field("qk_nope_head_dim"), field("qk_rope_head_dim"), field("v_head_dim")
    if all(isinstance(d, int) for d in (nope, rope, value)):
        return f"dim {nope + rope} (keys) and {value} (values)"
    return None
